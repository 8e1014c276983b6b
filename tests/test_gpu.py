"""The same engine on a CUDA device (skipped without one): tokens equal the CPU run's, alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_cuda_matches_cpu_and_batch_equals_alone(tiny_gguf: Path) -> None:
    prompts = [[5, 6, 7], list(range(1, 40)), [9] * 17, list(range(100, 120))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(device: str, ps: list[list[int]]) -> list[list[int]]:
        e = Engine(tiny_gguf, EngineConfig(device=device, max_num_batched_tokens=24), quiet=True)
        reqs = [e.add_request(p, params) for p in ps]
        while e.has_unfinished:
            e.step()
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
        return [r.output_token_ids for r in reqs]

    cpu = run("cpu", prompts)
    assert run("cuda", prompts) == cpu
    assert run("cuda", prompts[1:2]) == cpu[1:2]

"""Bit-exact engine equivalences for the mixture-of-experts families on the default path (`--dtype auto`).

Tiny random Qwen3-MoE, OLMoE and Mixtral models (tests/helpers/tiny_moe.py), each in a weight format the
expert kernels cover: Q8_0, Q4_0 (gguf's quantizer), Q4_K (plausible random blocks: gguf cannot quantize
K-quants) and an HF safetensors folder (float32 on the native row kernel). One set of engines each: cache
vs none, alone vs batch, chunked vs whole, prefix hit vs miss, preempted vs not, 1 vs 2 threads; every
step's float32 logits compared with `torch.equal`. Decode steps run the fused native step (the routed MLP
is csrc/moe.cpp's, as on the module path that prefill runs).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from deps import need_native
from engine_runs import assert_engine_equivalences
from quantize import synthetic_quantize
from tiny_moe import moe_config, moe_state_dict, write_moe_gguf, write_moe_hf_dir

from kvlm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# case -> (family, how the test writes it)
CASES: dict[str, tuple[str, str]] = {
    "qwen3_moe-Q8_0": ("qwen3_moe", "Q8_0"),
    "qwen3_moe-safetensors": ("qwen3_moe", "safetensors"),
    "olmoe-Q4_0": ("olmoe", "Q4_0"),
    "mixtral-Q4_K": ("mixtral", "Q4_K"),
}


@pytest.fixture(scope="module", params=list(CASES))
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    need_native()
    kind, fmt = CASES[request.param]
    root = tmp_path_factory.mktemp(kind)
    if fmt == "safetensors":
        cfg = moe_config(kind)
        return request.param, write_moe_hf_dir(root / "hf", cfg, moe_state_dict(cfg))
    if fmt.endswith("_K"):  # rows of whole 256-value super-blocks
        cfg = moe_config(kind, hidden_size=256, head_dim=64, intermediate_size=256)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf.quants, "quantize", synthetic_quantize)
            return request.param, write_moe_gguf(root / "tiny.gguf", cfg, moe_state_dict(cfg), tensor_type=fmt)
    cfg = moe_config(kind)
    return request.param, write_moe_gguf(root / "tiny.gguf", cfg, moe_state_dict(cfg), tensor_type=fmt)


def test_moe_equivalences_bit_for_bit(moe_model: tuple[str, Path]) -> None:
    name, path = moe_model
    main, _, _ = assert_engine_equivalences(path, name, GREEDY)
    assert main.runner.fused is not None and main.backend.decode == "fused", main.backend.reasons

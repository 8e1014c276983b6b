"""BF16 / F16 safetensors stay in their width under `--dtype auto`.

Their matrices stay views of the mapped shards (no float32 copy; decode reads half the bytes). The F16 row
kernel widens each stored value as it reads it (exact: every f16 value is a float32 value), then sums as it
sums float32 blocks, so an f16 folder gives the bits of the same values stored in float32. BF16 rows run
with bf16 activations (vdpbf16ps's arithmetic, csrc/kernels_bf16.h): their own bits, the same at any thread
count, and numbers near float32's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import random_state_dict, tiny_config, write_tiny_hf_dir

from kvlm.kernels import QuantTensor, kernel_path
from kvlm.kernels.ggml_types import GGMLQuantizationType as Q
from kvlm.llm import LLM
from kvlm.loader import load_checkpoint
from kvlm.loader.mapped_pages import file_mappings
from kvlm.sampling_params import SamplingParams

PROMPTS = [[5, 9, 17, 33, 2, 40], [7, 7, 8, 1]]
WIDTHS = {torch.bfloat16: Q.BF16, torch.float16: Q.F16, torch.float32: Q.F32}


def _run(path: Path, threads: int = 1) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = LLM(str(path), device="cpu", num_threads=threads)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_half_width_folder_stays_in_width(tmp_path: Path, dtype: torch.dtype, model_type: str) -> None:
    if kernel_path(WIDTHS[dtype]) == "reference":
        pytest.fail("the native kernels are not built: this path is the native row kernel's")
    cfg = tiny_config(model_type)
    half = {k: v.to(dtype) for k, v in random_state_dict(cfg, seed=3).items()}
    half_dir = write_tiny_hf_dir(tmp_path / "half", cfg, half)
    wide_dir = write_tiny_hf_dir(tmp_path / "wide", cfg, {k: v.float() for k, v in half.items()})

    _, state, _ = load_checkpoint(half_dir, quantized=True)
    mats = {k: v for k, v in state.items() if isinstance(v, QuantTensor)}
    assert set(mats) == {k for k, v in half.items() if v.ndim == 2}
    maps = file_mappings(half_dir / "model.safetensors")
    for k, m in mats.items():
        assert m.qtype == WIDTHS[dtype], k
        assert m.data.numel() == half[k].numel() * 2, k  # 2 bytes a weight, not 4
        assert any(lo <= m.data.data_ptr() < hi for lo, hi in maps), f"{k} is a copy, not a view of the file"

    half_run = _run(half_dir)
    if dtype == torch.float16:
        assert half_run == _run(wide_dir)  # token ids and top-5 logprobs, bit for bit
    else:  # bf16 activations: the first step's top-5 log-probabilities near float32's
        for (_, lp), (_, lp32) in zip(half_run, _run(wide_dir)):
            assert all(abs(lp[0][t] - lp32[0][t]) < 0.05 for t in lp[0].keys() & lp32[0].keys())
    assert _run(half_dir, threads=2) == half_run


def test_float32_reference_path_still_widens(tmp_path: Path) -> None:
    cfg = tiny_config()
    half_dir = write_tiny_hf_dir(tmp_path / "half", cfg, {k: v.bfloat16() for k, v in random_state_dict(cfg).items()})
    _, state, _ = load_checkpoint(half_dir, quantized=False)
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in state.values())


def test_a_tensor_past_the_end_of_its_shard_is_refused(tmp_path: Path) -> None:
    from kvlm.errors import ModelLoadError

    cfg = tiny_config()
    d = write_tiny_hf_dir(tmp_path / "m", cfg, {k: v.bfloat16() for k, v in random_state_dict(cfg).items()})
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # a truncated download
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        load_checkpoint(d, quantized=True)

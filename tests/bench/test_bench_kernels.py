"""`kvlm bench kernels`' attention rows: every KV cache format it takes, its bytes per call, and the flag's
error."""

from __future__ import annotations

import argparse

import pytest
import torch
from deps import need_native

from kvlm.bench import kernels
from kvlm.kernels import kv_quant, native


@pytest.mark.parametrize("kv", kernels.ATTN_KV)
def test_attention_row_per_format(kv: str) -> None:
    """A case of each format holds one cache per layer with the format's bytes per token, and the timed
    row reports them (K and V of 64 tokens, 3 kv heads of 64 values)."""
    need_native()
    case = kernels.AttentionCase.make(1, 64, kv, cold=False)
    k, v = case.caches[0]
    fmt = kv_quant.format_of(k, 64)
    assert (fmt is not None) == (kv in kv_quant.FORMATS)
    per_value = {"float32": 4, "float16": 2, "bfloat16": 2}.get(kv) or fmt.bytes_per_value
    assert case.kv_bytes == round(2 * 64 * 3 * 64 * per_value)
    row = kernels.bench_attention(1, 64, kv, 1, 0.01, cold=False)
    assert row["kv_dtype"] == kv and row["ms"] > 0 and row["ref_ms"] > 0


def test_attention_kv_flag_is_checked() -> None:
    p = argparse.ArgumentParser()
    kernels.add_args(p)
    a = p.parse_args(["--attention-kv", "float32,int2", "--attention-only"])
    with pytest.raises(ValueError, match="--attention-kv must be comma-separated formats of float32, float16"):
        kernels.run_args(a)


def test_formats_flag_takes_only_what_it_can_write() -> None:
    """A type with neither a quantizer in the gguf package nor random blocks here is refused up front, in
    one line that lists the types it takes."""
    p = argparse.ArgumentParser()
    kernels.add_args(p)
    with pytest.raises(ValueError, match=r"no random weights of IQ4_NL here; one of BF16, F16, F32, Q2_K, Q3_K"):
        kernels.run_args(p.parse_args(["--formats", "Q4_0,IQ4_NL", "--no-attention"]))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K"])
def test_k_quants_without_a_quantizer_get_random_blocks(name: str) -> None:
    """Q2_K and Q3_K (no native kernel, no gguf quantizer): random blocks whose float16 scales are finite, so
    the timed reference product is finite too."""
    import torch
    from gguf import GGMLQuantizationType

    w = kernels.random_weight(GGMLQuantizationType[name], 4, 512, torch.Generator().manual_seed(0))
    y = kernels.qmatmul(torch.ones(1, 512), w)
    assert y.shape == (1, 4) and torch.isfinite(y).all()


def test_a_forced_path_says_the_float32_matmul_is_not_held_to_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Under KVLM_KERNEL_ISA below this CPU's best, the header says torch's float32 matmul (the 'speedup'
    baseline) still runs on its own kernels; on the best path it says nothing of the kind."""
    need_native()
    if native.best_isa() == "scalar":
        pytest.skip("no path below this CPU's best to force")
    args = dict(formats=["Q4_0"], rows=[1], threads=None, min_s=0.001, attn_threads=None, shapes=((64, 64),))
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv(native.ENV_ISA, raising=False)  # the best path first, whatever the shell forced
        native.refresh()
        kernels.run(**args)
        assert "does not restrict" not in capsys.readouterr().out
        monkeypatch.setenv(native.ENV_ISA, "scalar")
        native.refresh()
        kernels.run(**args)
    finally:
        monkeypatch.undo()
        native.refresh()
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "path scalar" in out
    assert "KVLM_KERNEL_ISA does not restrict: 'speedup' sets kvlm's scalar path against" in out

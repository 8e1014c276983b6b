"""`kvlm bench kernels`' attention rows: every KV cache format it takes, its bytes per call, and the flag's
error."""

from __future__ import annotations

import argparse

import pytest
from deps import need_native

from kvlm.bench import kernels
from kvlm.kernels import kv_quant


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

"""Tests for `kv_cache.pool.KVBytes` and `formula_bytes_per_token` without a model: the pool's bytes counted
from its tensors equal the format's formula (float and int8), a request's held and filled bytes follow its
blocks in every layer group, and recompute mode holds nothing."""

from __future__ import annotations

import pytest
import torch
from tiny_gemma import WINDOW, gemma3_config
from tiny_models import tiny_config

from kvlm.config import EngineConfig, ModelConfig
from kvlm.kernels.kv_quant import INT8
from kvlm.kv_cache.layer_groups import GroupView
from kvlm.kv_cache.pool import KVBytes, formula_bytes_per_token, make_kv_cache
from kvlm.kv_cache.spec import SlidingWindow
from kvlm.kv_cache.storage import kv_format
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.mark.parametrize("elem", [torch.float32, torch.float16, INT8], ids=str)
def test_counted_equals_formula(elem: object) -> None:
    mc = ModelConfig.from_hf_dict(tiny_config(head_dim=32))  # 2 layers x 2 kv heads x head_dim 32
    per_value = {torch.float32: 4, torch.float16: 2, INT8: 34 / 32}[elem]  # int8: codes and a float16 scale per 32
    assert formula_bytes_per_token(mc, elem) == int(2 * 2 * 2 * 32 * per_value)
    for layout in ("paged", "contiguous"):
        fmt = kv_format(elem)
        cache, bm, _ = make_kv_cache(EngineConfig(kv_cache_layout=layout, kv_cache_memory=1 << 20), mc, 256, fmt, CPU)
        kv = KVBytes(cache, mc, fmt, bm.block_size)
        assert kv.per_token == formula_bytes_per_token(mc, elem) and kv.group_slot == [kv.per_token]


def test_request_bytes_over_layer_groups() -> None:
    """5 sliding layers (one group) and 1 full layer: a request's held bytes are its blocks in each group, its
    filled bytes the computed tokens of the full layer and all but the last block's empty slots of the other."""
    mc = ModelConfig.from_hf_dict(gemma3_config())  # 1 kv head x head_dim 32: 256 B a token slot a layer
    fmt = kv_format(torch.float32)
    cache, bm, groups = make_kv_cache(EngineConfig(block_size=4, max_num_seqs=1), mc, 256, fmt, CPU)
    kv = KVBytes(cache, mc, fmt, bm.block_size)
    assert kv.per_token == 6 * 256 and kv.group_slot == [256.0, 5 * 256.0]
    gbm, = groups
    assert gbm.spec == SlidingWindow(4, WINDOW)
    req = Request("r", list(range(10)), 10, SamplingParams())
    req.group_tables, req.group_cached, req.group_evicted = [[]], [0], [0]
    bm.allocate(req, 10)
    gbm.allocate(GroupView(req, 1), 10)
    req.num_computed_tokens = 10  # 3 blocks in each group, the last one half full
    assert kv.of_request(req) == (2 * 3 * 4 * 256 * 3, (10 + 5 * 10) * 256)


def test_recompute_mode_holds_nothing() -> None:
    mc = ModelConfig.from_hf_dict(tiny_config())
    cache, bm, _ = make_kv_cache(EngineConfig(enable_kv_cache=False), mc, 256, kv_format(torch.float32), CPU)
    kv = KVBytes(cache, mc, kv_format(torch.float32), bm.block_size)
    req = Request("r", [1, 2, 3], 3, SamplingParams())
    req.num_computed_tokens = 3
    assert kv.per_token == formula_bytes_per_token(mc, torch.float32) == 512 and kv.of_request(req) == (0, 0)

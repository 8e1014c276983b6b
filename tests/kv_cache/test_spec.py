"""Tests for kvlm.kv_cache.spec without a model (no torch but for the format's dtype): each cache spec's
eviction, naming and sizing rules, a request's bounded cache refining a group's spec, and the cache
config built once from a model config and the engine args."""

from __future__ import annotations

import hashlib

import torch
from tiny_gemma import WINDOW, gemma3_config

from kvlm.config import EngineConfig, ModelConfig
from kvlm.kernels.kv_quant import INT4, INT8
from kvlm.kv_cache.block_manager import BlockManager
from kvlm.kv_cache.pool import kv_cache_config
from kvlm.kv_cache.spec import UNBOUNDED, FullAttention, KVCacheConfig, SlidingWindow
from kvlm.kv_cache.storage import kv_format
from kvlm.kv_policy import BoundedKV
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams

H = hashlib.sha256(b"prefix").digest()


def test_full_attention_keeps_everything() -> None:
    full = FullAttention(4)
    assert [full.evict_upto(p) for p in (0, 100, 10_000)] == [0, 0, 0]
    assert full.sink_blocks == 0 and full.registrable_blocks == UNBOUNDED and full.block_name(7, H) == H
    assert full.attended(9) == 10 and full.blocks_per_seq(8) is None and full.tokens_held(300) == 300
    assert full.for_request(None) is full


def test_sliding_window_evicts_what_the_window_left() -> None:
    sw = SlidingWindow(4, 8)
    # row p sees p - 7 .. p: block i goes once its last token 4i + 3 < p - 7
    assert [sw.evict_upto(p) for p in (0, 7, 10, 11, 12, 15, 20)] == [0, 0, 0, 1, 1, 2, 3]
    assert sw.attended(3) == 4 and sw.attended(50) == 8 and sw.tokens_held(300) == 8
    assert sw.blocks_per_seq(8) == 6 and sw.blocks_per_seq(None) == 6  # ceil(16 / 4) + 2
    assert sw.sink_blocks == 0 and sw.block_name(3, H) == H


def test_bounded_request_refines_each_group() -> None:
    """A full group acts the request's sinks + window; a sliding one keeps evicting by its own window but
    lists the sinks and names blocks past the first eviction by the policy."""
    pol = BoundedKV.make(32, 4, 4, 256)  # 1 sink block, window 28
    assert FullAttention(4).for_request(pol) is pol
    sw = SlidingWindow(4, 8).for_request(pol)
    assert isinstance(sw, SlidingWindow) and sw.bounded is pol
    assert sw.sink_blocks == 1 and sw.registrable_blocks == pol.registrable_blocks == 8
    # the sliding window's rule, not the policy's
    assert [sw.evict_upto(p) for p in (11, 40)] == [1, 8] and sw.hit_start(10) == 8
    assert pol.evict_upto(40) == 4 and pol.hit_start(10) == 4 and FullAttention(4).hit_start(10) == 0
    assert sw.block_name(7, H) == pol.block_name(7, H) == H  # before the first eviction: the prefix alone
    assert sw.block_name(8, H) == pol.block_name(8, H) == pol.block_hash(H) != H


def test_block_manager_acts_its_spec() -> None:
    """The same request in a full and a sliding group's manager: eviction from the spec's evict_upto."""
    req = Request("r", list(range(20)), 20, SamplingParams())
    full, sliding = BlockManager(16, 4), BlockManager(16, 4, spec=SlidingWindow(4, 8))
    for bm in (full, sliding):
        bm.allocate(req, 20)
        p = 20
        bm.evict(req, p)
        n_held = sum(b >= 0 for b in req.block_table)
        assert n_held == (5 if bm is full else 2), bm.spec  # row 20 sees 13 .. 20: blocks 3 and 4
        bm.free(req)
        bm.check([req])


def test_format_bytes() -> None:
    assert kv_format(torch.float32).bytes_per_value == 4 and kv_format(torch.bfloat16).name == "bfloat16"
    assert kv_format(INT8).bytes_per_value == 34 / 32 and kv_format(INT4).token_bytes(2, 32) == 2 * 2 * 32 * 18 / 32
    assert not kv_format(INT8).centered and not kv_format(INT8).has_k0


def test_config_from_model_and_engine_args() -> None:
    """Gemma 3's pattern: group 0 its full layer, group 1 the sliding ones with room for each seat's window
    and a chunk; the page size follows the format."""
    mc = ModelConfig.from_hf_dict(gemma3_config())
    fmt = kv_format(torch.float32)
    cfg = kv_cache_config(EngineConfig(block_size=4, max_num_seqs=2, kv_cache_memory=1 << 20), mc, 256, fmt,
                          torch.device("cpu"))
    assert [g.spec for g in cfg.groups] == [FullAttention(4), SlidingWindow(4, WINDOW)]
    assert cfg.groups[1].num_blocks == 2 * SlidingWindow(4, WINDOW).blocks_per_seq(WINDOW)
    assert cfg.num_layers == mc.num_hidden_layers and cfg.group_of == tuple(
        0 if w is None else 1 for w in mc.layer_windows)
    assert cfg.page_size_bytes(0) == 4 * fmt.token_bytes(mc.num_key_value_heads, mc.head_dim)
    plain = KVCacheConfig.full(fmt, 3, 10, 16, 2, 8)
    assert plain.num_blocks == 10 and plain.group_of == (0, 0, 0) and plain.groups[0].spec == FullAttention(16)

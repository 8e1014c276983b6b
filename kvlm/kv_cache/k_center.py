"""The K center of a quantized KV cache: the mean post-RoPE key per layer and kv head of a model.

SmolLM2-135M's keys (post-RoPE) carry a large per-channel mean that every token's int4 codes must spend
their range on. A quantized cache stores k - mu instead (`kv_cache/storage.py`, `csrc/decode.cpp`), which
changes no attention output in exact arithmetic: q . (k - mu) = q . k - q . mu is the same shift for
every key of a query row, and softmax ignores it (attention logits go into softmax as they are: models
with attention soft-capping are refused at load, `config/`). docs/kv_quant.md measures what it buys.

mu comes from one prefill at engine load of a fixed sequence, `CALIBRATION_TOKENS` token ids drawn from
Python's `random.Random(CALIBRATION_SEED)` (Mersenne Twister and CPython's randrange: the same ids everywhere),
through the model as loaded, with a float32 cache, summed in float64 and rounded to float16: the same
model file gives the same mu bits on every run (the native path's bits do not depend on the thread count;
the float16 rounding absorbs the reference path's last-bit differences). No text, no download. Measured on
the default model (docs/kv_quant.md, `scripts/experiments/kv_k_center_calibration.py` at f97df0a): these ids do as
well as a page of written text or 1,024 tokens of the scored text itself, within the measurement's noise;
512 of them do worse.

The keys at position 0 are centered on a center of their own, k0 (`KeyCenter`): with no earlier token to
attend, the first token becomes the model's attention sink, its key is far from mu and alike for every
token (so mu leaves its codes a large, heavily weighted error), and attention adds q . (k0 - mu) back
to its score. k0 is the mean position-0 key of `FIRST_KEY_TOKENS` one-token prefills of seeded ids.

This module knows the model's forward and a cache that records keys; not the engine, not requests.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time

import torch

from kvlm.attention.metadata import AttentionMetadata, GatheredRows, StepKind
from kvlm.attention.paged import paged_rows
from kvlm.kernels.kv_quant import KeyCenter
from kvlm.kv_cache.recompute import NoKVCache

log = logging.getLogger("kvlm")

CALIBRATION_TOKENS = 1024
CALIBRATION_SEED = 0
# k0, the mean position-0 key: one-token prefills of this many more seeded ids (docs/kv_quant.md)
FIRST_KEY_TOKENS = 64
FIRST_KEY_SEED = 1


class _KeySums(NoKVCache):
    """A float32 `NoKVCache` for one sequence that also sums each layer's new keys (float64)."""

    def __init__(self) -> None:
        super().__init__(torch.float32)
        self.sums: dict[int, torch.Tensor] = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.sums[layer] = k.double().sum(0)  # (kv_heads, D) over the T rows
        super().write(layer, k, v, meta)


def calibration_ids(vocab_size: int, n: int = CALIBRATION_TOKENS, seed: int = CALIBRATION_SEED) -> list[int]:
    """n token ids uniform over the vocabulary, from a seeded Mersenne Twister."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def prefill_meta(T: int, device: torch.device, in_place: bool) -> AttentionMetadata:
    """The metadata of one sequence's whole prefill of T tokens from position 0 (a cache that keeps
    nothing, `NoKVCache`, serves it). in_place: every row attends with the native in-place kernel."""
    positions = torch.arange(T, device=device)
    return AttentionMetadata(
        kind=StepKind.PREFILL, positions=positions, slots=(positions,),
        tables=(torch.zeros(1, 1, dtype=torch.int32 if in_place else torch.long, device=device),),
        query_lens=(T,), seq_lens=(T,), logits_indices=torch.tensor([T - 1], device=device),
        attn=paged_rows(positions, [T], [T], [0]) if in_place else GatheredRows(None, None),  # causal
    )


@torch.inference_mode()
def key_sums(model: torch.nn.Module, ids: list[int], in_place: bool) -> torch.Tensor:
    """The sum of the post-RoPE keys of each layer and kv head over one prefill of `ids` (positions
    0..T-1) with a float32 cache: (layers, kv_heads, D) float64. in_place: attend with the native in-place
    kernel (the engine's CPU path), else the reference."""
    dev = model.model.norm.weight.device  # (embed_tokens may be a QuantEmbedding, without .weight)
    meta = prefill_meta(len(ids), dev, in_place)
    cache = _KeySums()
    model(torch.tensor(ids, device=dev), meta.positions, cache, meta)
    return torch.stack([cache.sums[i] for i in range(len(cache.sums))])


def mean_keys(model: torch.nn.Module, ids: list[int], in_place: bool) -> torch.Tensor:
    """`key_sums` / T: (layers, kv_heads, D) float32, rounded to float16 values."""
    return (key_sums(model, ids, in_place) / len(ids)).to(torch.float16).to(torch.float32)


def mean_first_keys(model: torch.nn.Module, ids: list[int], in_place: bool) -> torch.Tensor:
    """The mean position-0 key over one-token prefills of each of `ids` (a position-0 key depends on its
    token only), summed in float64 in the order of `ids`: (layers, kv_heads, D) float32, float16 values."""
    total = sum((key_sums(model, [i], in_place) for i in ids[1:]), key_sums(model, ids[:1], in_place))
    return (total / len(ids)).to(torch.float16).to(torch.float32)


def calibrate_k_center(model: torch.nn.Module, vocab_size: int, max_len: int, in_place: bool) -> KeyCenter:
    """The engine's K center for `model`: mu = `mean_keys` over `calibration_ids` (at most max_len of
    them) and k0 = `mean_first_keys` over `FIRST_KEY_TOKENS` more, on the path the engine's steps take
    (in_place: the backend's paged attention, `Backend.in_place`)."""
    t0 = time.perf_counter()
    ids = calibration_ids(vocab_size, min(CALIBRATION_TOKENS, max_len))
    mu = mean_keys(model, ids, in_place).contiguous()
    k0 = mean_first_keys(model, calibration_ids(vocab_size, FIRST_KEY_TOKENS, FIRST_KEY_SEED), in_place)
    log.info("kvlm: K center: %d + %d calibration tokens in %.2f s", len(ids), FIRST_KEY_TOKENS,
             time.perf_counter() - t0)
    return KeyCenter(mu, k0.contiguous())


def center_digest(center: KeyCenter | None) -> str:
    """What snapshots and the prefix cache's root hash record of a cache's K center: "none", or the first
    16 hex digits of sha256 over mu's float32 bytes, then k0's."""
    if center is None:
        return "none"
    h = hashlib.sha256(center.mu.detach().cpu().contiguous().numpy().tobytes())
    if center.k0 is not None:
        h.update(center.k0.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

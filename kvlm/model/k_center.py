"""The K center of a quantized KV cache: the mean post-RoPE key per layer and kv head of a model.

SmolLM2-135M's keys (post-RoPE) carry a large per-channel mean that every token's int4 codes must spend
their range on. A quantized cache stores k - mu instead (`kv_cache/storage.py`, `csrc/decode.cpp`), which
changes no attention output in exact arithmetic: q . (k - mu) = q . k - q . mu is the same shift for
every key of a query row, and softmax ignores it. docs/kv_quant.md measures what it buys.

mu comes from one prefill at engine load of a fixed sequence: `CALIBRATION_TEXT` (a page of prose
written for this, shipped here) through the model's own tokenizer, repeated to `CALIBRATION_TOKENS` ids,
through the model as loaded, with a float32 cache, summed in float64 and rounded to float16: the same
model file gives the same mu bits on every run (the native path's bits do not depend on the thread count;
the float16 rounding absorbs the reference path's last-bit differences). No download. Measured on the
default model (docs/kv_quant.md): this text's mu is as good as one from 1,024 tokens of the scored text
itself (int4 mean KLD 4.31e-2 against 4.32e-2), seeded random ids are worse (4.60e-2).

This module knows the model's forward and a cache that records keys; not the engine, not requests.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from kvlm.attention.metadata import AttentionMetadata, StepKind
from kvlm.kernels import native
from kvlm.kv_cache.storage import NoKVCache
from kvlm.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvlm")

CALIBRATION_TOKENS = 1024
# Written for this purpose (a mix of registers: narrative, instructions, dialogue, numbers, a little code),
# tokenized by the model's own tokenizer and repeated to CALIBRATION_TOKENS: keys of text, not of noise.
CALIBRATION_TEXT = """\
The rain had stopped by the time Mara reached the harbour, and the fishing boats rocked gently against
the stone wall. She counted them twice, as her grandfather had taught her: eleven boats, three with
blue hulls, one with a broken mast that nobody had bothered to repair since the storm in March. The
market behind her was opening. Someone was arguing about the price of onions, someone else was singing.

"You are late," said Tomas, without looking up from the net he was mending.
"The bus was late. I am exactly as late as the bus."
"Then the bus owes me an hour of work." He handed her a needle and a ball of green thread.

How to repot a small plant: water it the day before, so the roots hold together. Choose a pot about two
centimetres wider than the old one, with a hole in the bottom. Turn the plant upside down, support the
soil with your hand, and tap the rim until it slides out. Loosen the outer roots with your fingers, set
the plant at the same depth as before, fill the gaps with fresh soil and press lightly. Water again and
keep it out of direct sunlight for a week.

The committee met on Thursday, 14 October, at 9:30 in room 204. Present: six members and two guests.
The treasurer reported a balance of 12,480 euros, up from 9,915 at the previous meeting, mainly because
the spring concert sold 412 tickets at 15 euros each. Costs for the new roof were estimated between
18,000 and 22,500 euros; a decision was postponed until three written quotes are available.

Light from the Sun takes a little over eight minutes to reach the Earth. The Moon is about 384,000
kilometres away, and its light, which is only reflected sunlight, arrives in just over a second. Most of
the stars visible at night are within a few hundred light years, a short distance on the scale of the
galaxy, which is roughly a hundred thousand light years across.

def average(values):
    # the arithmetic mean of a non-empty list of numbers
    if not values:
        raise ValueError("average() needs at least one value")
    return sum(values) / len(values)

Question: If a train leaves at 7:45 and the journey takes two hours and forty minutes, when does it
arrive? Answer: at 10:25. Question: What is the capital of Canada? Answer: Ottawa.

Dear Mr. Alvarez, thank you for your letter of last week. We are sorry that the parcel arrived damaged.
A replacement has been sent today by express delivery, and you do not need to return the broken item.
Please let us know if there is anything else we can do. With kind regards, the customer service team.

In the evening the wind turned and came from the north, cold and steady. The boats were pulled higher,
the nets were hung to dry, and the lamps in the houses along the quay were lit one by one. Mara walked
home slowly, her fingers smelling of salt and tar, thinking about the broken mast and about March.
"""


class _KeySums(NoKVCache):
    """A float32 `NoKVCache` for one sequence that also sums each layer's new keys (float64)."""

    def __init__(self) -> None:
        super().__init__(torch.float32)
        self.sums: dict[int, torch.Tensor] = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.sums[layer] = k.double().sum(0)  # (kv_heads, D) over the T rows
        super().write(layer, k, v, meta)


def calibration_ids(tokenizer: Tokenizer, n: int = CALIBRATION_TOKENS) -> list[int]:
    """`CALIBRATION_TEXT`'s token ids (no special tokens), repeated to n."""
    ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def prefill_meta(T: int, device: torch.device, in_place: bool) -> AttentionMetadata:
    """The metadata of one sequence's whole prefill of T tokens from position 0 (a cache that keeps
    nothing, `NoKVCache`, serves it). in_place: every row attends with the native in-place kernel."""
    positions = torch.arange(T, device=device)
    i32 = torch.int32
    return AttentionMetadata(
        kind=StepKind.PREFILL, positions=positions, slot_mapping=positions,
        block_tables=torch.zeros(1, 1, dtype=i32 if in_place else torch.long, device=device),
        query_lens=(T,), seq_lens=(T,), q_pad_index=None, attn_mask=None,  # a lone whole prompt: causal
        logits_indices=torch.tensor([T - 1], device=device), in_place=in_place,
        row_seq=torch.zeros(T, dtype=i32, device=device) if in_place else None,
        row_ctx=(positions + 1).to(i32) if in_place else None,
        seq_lens_tensor=torch.tensor([T], dtype=i32, device=device) if in_place else None,
    )


@torch.inference_mode()
def mean_keys(model: torch.nn.Module, ids: list[int], in_place: bool) -> torch.Tensor:
    """The mean post-RoPE key of each layer and kv head over one prefill of `ids` (positions 0..T-1) with
    a float32 cache: (layers, kv_heads, D) float32, rounded to float16 values. in_place: attend with the
    native in-place kernel (the engine's CPU path), else the reference."""
    dev = model.model.norm.weight.device  # (embed_tokens may be a QuantEmbedding, without .weight)
    meta = prefill_meta(len(ids), dev, in_place)
    cache = _KeySums()
    model(torch.tensor(ids, device=dev), meta.positions, cache, meta)
    T = len(ids)
    sums = torch.stack([cache.sums[i] for i in range(len(cache.sums))])  # (layers, kv_heads, D) float64
    return (sums / T).to(torch.float16).to(torch.float32)


def calibrate_k_center(model: torch.nn.Module, tokenizer: Tokenizer, max_len: int) -> torch.Tensor:
    """The engine's K center for `model`: `mean_keys` over `calibration_ids` (at most max_len of them), on
    the path the engine's steps take (the native in-place attention on CPU where it is built)."""
    t0 = time.perf_counter()
    ids = calibration_ids(tokenizer, min(CALIBRATION_TOKENS, max_len))
    in_place = model.model.norm.weight.device.type == "cpu" and native.active_isa() != "reference"
    mu = mean_keys(model, ids, in_place).contiguous()
    log.info("kvlm: K center: %d calibration tokens in %.2f s", len(ids), time.perf_counter() - t0)
    return mu


def center_digest(k_center: torch.Tensor | None) -> str:
    """What snapshots and the prefix cache's root hash record of a cache's K center: "none", or the first
    16 hex digits of sha256 over its float32 bytes."""
    if k_center is None:
        return "none"
    return hashlib.sha256(k_center.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]

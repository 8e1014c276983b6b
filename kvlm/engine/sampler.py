"""Sampler: logits of a batch -> one token per row, each row under its own `SamplingParams`.

The order is vLLM V1's (vllm/v1/sample/sampler.py), step by step for each row:
  0. a grammar (structured_outputs): tokens it forbids get -inf (`kvlm.structured.mask`; a row verifying
     drafts, the mask after the drafts before it); rows without one, or inside a `<think>` span their
     grammar waits for, are not touched;
  1. min_tokens: EOS and the stop token ids are banned until the request has min_tokens outputs;
  2. penalties: repetition (HF, prompt + output), presence and frequency (OpenAI, output only);
  3. temperature < 1e-5: greedy, the argmax; top-k, top-p and min-p are ignored. Otherwise:
  4. logits / temperature;
  5. min-p: drop tokens whose probability is below min_p x the top probability;
  6. top-k, then top-p on what is left (top-k keeps ties with the k-th logit; top-p cuts by sorted
     position, see `filter_logits`);
  7. a draw from the renormalized distribution;
  8. a request whose reasoning budget is spent takes its forced token (`</think>`'s, one per step) instead
     of the row's choice (`kvlm.structured.reasoning_budget`): set after the draw, so the row's logits,
     its draw and every other row are what they would be without it.
Batched over rows with per-row parameters as tensors (temperature, top-k, top-p, min-p). Randomness is
keyed by position: the noise of the draw for the token at position p of a request is a function of
(request seed, p) only (`draw_key`), never of a stream that advances per call. So a seeded request draws
the same tokens alone, in any batch, after a preemption, and with speculative decoding on or off (a
position gets the same noise however many drafts were tried before it). Draws use the exponential race
(argmax of p / E, E = -log U ~ Exp(1)), which samples exactly from p without a host sync. Logprobs are
those of the model's raw distribution (before the grammar, penalties and temperature), as llama.cpp
returns them by default.

A request may bring several rows (speculative decoding, `kvlm.spec_decode`): row i with offset j draws
the token at position num_tokens + j, after the request's tokens and its first j drafts; min_tokens and
the penalties see that history, as if the drafts had been decoded one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.kernels.argmax import argmax_rows
from kvlm.request import Request
from kvlm.structured.mask import apply_grammar_masks

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit integers that scatters nearby inputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, position: int) -> int:
    """The generator seed of the draw for the token at `position` of a request seeded `seed` (any signed
    64-bit integer): the only input of that draw's noise. (A CPU generator keeps the low 32 bits, so the
    halves are folded first: keys of nearby seeds and positions differ there too.)"""
    x = _mix64((seed & _MASK64) ^ _mix64(position + 0x9E3779B97F4A7C15 & _MASK64))
    return (x ^ (x >> 32)) & 0xFFFFFFFF


def _history(r: Request, offset: int) -> list[int]:
    """The tokens before row `offset` of `r`: its tokens, then its first `offset` drafts."""
    return r.token_ids + r.draft_token_ids[:offset] if offset else r.token_ids


def apply_penalties(logits: torch.Tensor, reqs: list[Request], offsets: list[int] | None = None) -> torch.Tensor:
    """Repetition (HF: prompt + output), presence and frequency (output only) penalties, in place; row i
    sees the history before its own position (`offsets`: see `sample`)."""
    V = logits.shape[1]
    for i, r in enumerate(reqs):
        p = r.params
        if p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty):
            continue
        history = _history(r, offsets[i] if offsets else 0)
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(history)), device=logits.device, dtype=torch.long)
            ids = ids[ids < V]
            sel = logits[i, ids]
            logits[i, ids] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(history[r.num_prompt_tokens :], device=logits.device, dtype=torch.long)
            counts = torch.bincount(out[out < V], minlength=V).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what min-p (0 = off), then top-k (0 = off) and top-p (1 = off) exclude. logits: (B, V),
    already divided by the temperature; top_k (B,) long, top_p and min_p (B,) float.

    vLLM V1 semantics, step by step:
    * min-p on softmax(logits): keep tokens with p >= min_p x max p;
    * top-k on what is left: keep logits >= the k-th largest (ties with the k-th are kept, as in vLLM);
    * top-p on the distribution renormalized over the survivors: sort ascending (stable, so ties are
      ordered by token id), drop every token whose cumulative mass is <= 1 - top_p, always keep the
      most likely one. Cuts fall by sorted position: of tokens tied at the cut, the lower ids go first.
    """
    V = logits.shape[1]
    probs = logits.softmax(-1)
    logits = logits.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), float("-inf"))
    if bool(((top_k <= 0) | (top_k >= V)).all() and (top_p >= 1).all()):
        return logits  # neither top-k nor top-p: nothing to sort (the full sort would drop only zero mass)
    if bool((top_k > 0).all()) and int(top_k.max()) * 8 <= V:
        return _top_k_then_top_p(logits, top_k, top_p)
    return _sorted_cuts(logits, top_k, top_p)


def _sorted_cuts(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top-k then top-p (after min-p) by one stable ascending sort of the whole vocabulary."""
    V = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)  # (B, V) ascending
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
    kth = sorted_logits.gather(1, (V - k).unsqueeze(1))  # (B, 1): the k-th largest logit
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(-1).cumsum(-1)  # (B, V): mass of this token and every smaller one
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_k_then_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`filter_logits` after min-p when every row has a small top-k: the same cuts without sorting the
    vocabulary (262k entries for Gemma). top-k's threshold comes from `topk`; top-p then sorts only the
    survivors (the k largest and their ties), stably by value over ascending ids, the order the full sort
    gives them, while every other token is -inf there and adds no mass."""
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))  # (B, 1)
    keep = logits >= kth
    out = logits.masked_fill(~keep, float("-inf"))
    for r in torch.nonzero(top_p < 1).flatten().tolist():
        ids = torch.nonzero(keep[r]).flatten()  # ascending token ids
        vals, order = out[r, ids].sort(stable=True)  # ascending; ties keep id order
        drop = vals.softmax(-1).cumsum(-1) <= 1 - top_p[r]
        drop[-1] = False  # the most likely token always stays
        out[r, ids[order[drop]]] = float("-inf")
    return out


def apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Add each request's logit_bias (OpenAI: token id -> bias) to its row, in place."""
    for i, r in enumerate(reqs):
        for t, b in (r.params.logit_bias or {}).items():
            if t < logits.shape[1]:
                logits[i, t] += b
    return logits


def ban_stop_tokens(logits: torch.Tensor, reqs: list[Request], eos_token_ids: frozenset[int],
                    offsets: list[int] | None = None) -> torch.Tensor:
    """Until a request has min_tokens outputs, it may not pick EOS or its stop token ids (vLLM semantics)."""
    for i, r in enumerate(reqs):
        if r.num_output_tokens + (offsets[i] if offsets else 0) < r.params.min_tokens:
            ban = set(r.params.stop_token_ids or ()) | (set() if r.params.ignore_eos else set(eos_token_ids))
            ids = [t for t in ban if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")
    return logits


def _draft_masks(reqs: list[Request], rows: list[int], offsets: list[int] | None) -> torch.Tensor | None:
    """(R, W) grammar bitmasks of `rows` when some verify drafts (row offset j: the mask after the request's
    first j drafts), else None (each grammar's current mask). A request's rows are consecutive, offsets 0..k."""
    if offsets is None or not any(offsets[i] for i in rows):
        return None
    masks = []
    for i in rows:
        if offsets[i] == 0:
            r = reqs[i]
            along = r.grammar.masks_along(r.draft_token_ids)  # type: ignore[union-attr]
        masks.append(along[offsets[i]])
    return torch.stack(masks)


def position_noise(keys: list[int], V: int, device: torch.device) -> torch.Tensor:
    """(R, V) float32 uniforms in [0, 1): row j drawn from a generator seeded keys[j] (`draw_key`), so a
    row's noise depends on its key alone. One generator, re-seeded per row (~µs; no loop over the vocabulary)."""
    noise = torch.empty(len(keys), V, device=device)
    g = torch.Generator(device=device)
    for j, key in enumerate(keys):
        noise[j].uniform_(generator=g.manual_seed(key))
    return noise


def sample(logits: torch.Tensor, reqs: list[Request], eos_token_ids: frozenset[int] = frozenset(),
           writable: bool = False, offsets: list[int] | None = None) -> SamplerOutput:
    """logits: (B, V) float32, row i for reqs[i]. Returns the chosen token of each row. `logits` is not
    modified unless `writable` (the caller keeps no use for them): the grammar masks then go in place.
    offsets[i] (None: all 0): row i draws the token at position reqs[i].num_tokens + offsets[i], after the
    request's first offsets[i] drafts (`Request.draft_token_ids`; speculative decoding's verify rows)."""
    want_logprobs = any(r.params.logprobs is not None for r in reqs)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    constrained = [i for i, r in enumerate(reqs) if r.grammar_applies]
    if constrained:
        logits = apply_grammar_masks(logits, constrained, [reqs[i].grammar for i in constrained],  # type: ignore[misc]
                                     inplace=writable, bitmask=_draft_masks(reqs, constrained, offsets))
    if any(r.params.logit_bias for r in reqs):
        logits = apply_logit_bias(logits.clone(), reqs)
    if any(r.params.min_tokens for r in reqs):
        logits = ban_stop_tokens(logits.clone(), reqs, eos_token_ids, offsets)
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
           for r in reqs):
        logits = apply_penalties(logits.clone(), reqs, offsets)
    tokens = argmax_rows(logits)  # (B,) greedy choice for every row; sampled rows are overwritten
    rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rows:
        dev, V = logits.device, logits.shape[1]
        idx = torch.tensor(rows, device=dev)
        sub = logits[idx]  # (R, V)
        temp = torch.tensor([reqs[i].params.temperature for i in rows], device=dev, dtype=sub.dtype)
        top_k = torch.tensor([min(reqs[i].params.top_k, V) for i in rows], device=dev)
        top_p = torch.tensor([reqs[i].params.top_p for i in rows], device=dev, dtype=sub.dtype)
        min_p = torch.tensor([reqs[i].params.min_p for i in rows], device=dev, dtype=sub.dtype)
        # Shift so the top logit is 0 before dividing: a small temperature then sends the others
        # towards -inf (probability 0), never the top one to +inf (which would make softmax NaN).
        # softmax is shift-invariant, so the distribution is that of logits / temperature.
        scaled = (sub - sub.amax(-1, keepdim=True)) / temp.unsqueeze(1)
        probs = filter_logits(scaled, top_k, top_p, min_p).softmax(-1)
        # U in [0, 1), keyed by (the request's seed, the position of the token drawn)
        noise = position_noise([draw_key(reqs[i].seed, reqs[i].num_tokens + (offsets[i] if offsets else 0))
                                for i in rows], V, dev)  # type: ignore[arg-type]
        # E = -log U ~ Exp(1), in (0, inf]: U = 0 gives E = inf, so that token's p / E is 0 and cannot win.
        # Not exponential_: on CPU it costs ~16 ns a value (0.8 ms for a 49k row), six times a uniform
        # draw and its log.
        tokens[idx] = argmax_rows(probs / noise.log_().neg_())
    token_list = tokens.tolist()  # the one host sync of a step: the engine needs the ids
    for i, r in enumerate(reqs):  # (a request with a reasoning budget gets no drafts: one row, offset 0)
        if r.reasoning is not None and r.reasoning.forced is not None:
            token_list[i] = r.reasoning.forced
    lps: list[dict[int, float] | None] = [None] * len(reqs)
    if raw_logprobs is not None:
        for i, r in enumerate(reqs):
            k = r.params.logprobs
            if k is None:
                continue
            vals, ids = raw_logprobs[i].topk(k) if k else (raw_logprobs[i][:0], raw_logprobs[i][:0].long())
            d = dict(zip(ids.tolist(), vals.tolist()))
            d[token_list[i]] = float(raw_logprobs[i, token_list[i]])
            lps[i] = d
    return SamplerOutput(token_list, lps)

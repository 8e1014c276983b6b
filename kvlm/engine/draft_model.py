"""The `draft` proposer: a second, smaller model with the same tokenizer guesses the next k tokens greedily.

It is a second `Engine` (its own weights, KV pool, block manager and runner; no scheduler loop, no
speculation, no prefix cache) driven from here: each target request gets one draft `Request` in that
engine, whose token ids are the target's history followed by the drafts it last proposed, and whose
`num_computed_tokens` says how much of it has K/V in the draft's paged cache.

Before each target step, for every request the speculator asks drafts of (`propose_batch`):
* catch up and roll back: its tokens become the target's history; the longest common prefix of the two
  keeps its K/V, the draft's blocks past it (rejected drafts) go back to the draft's pool
  (`KVCacheManager.trim`), and the new tokens (the target's accepted drafts and its own next token) are
  computed as one chunk in the first draft step;
* propose: k steps of the draft model, all requests' rows in one forward pass per step, each picking its
  argmax (temperature 0), appended and fed to the next.
The draft's output never reaches the user: the target verifies every guess (`engine/speculator.py`), so
output is the same bits with this proposer as without speculation; a wrong or slow draft costs speed only.
A request's draft state (its blocks) is freed when it finishes or is preempted (`finish`, `forget_missing`).

Refused at start with one line (`ParameterError`): a draft whose tokenizer differs from the target's
(vocabulary, special tokens, BOS / EOS ids: `tokenizer_mismatch`), since its token ids would mean other text.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from kvlm.config import EngineConfig
from kvlm.engine.scheduler import ScheduledBatch
from kvlm.kv_cache.manager import KVCacheManager, StepKV
from kvlm.request import Request, RequestStatus
from kvlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvlm.engine.model_runner import ModelRunner
    from kvlm.tokenizer import Tokenizer

_GREEDY = SamplingParams(temperature=0)


def draft_config(target: EngineConfig, device: str) -> EngineConfig:
    """The draft engine's settings: the target's device, block size and step sizes, KV pool sized the same
    way; dtype "auto" whatever the target's (on a CPU the draft's GGUF weights stay in their quantized
    formats: the cheap guesser beside, say, a float32 target); no prefix cache (its blocks are private per
    request), no thread governor of its own (the target's sets the threads both use)."""
    return EngineConfig(device=device, dtype="auto", block_size=target.block_size,
                        max_num_seqs=target.max_num_seqs, max_num_batched_tokens=target.max_num_batched_tokens,
                        kv_cache_memory=target.kv_cache_memory, enable_prefix_caching=False, adaptive_threads=False)


def tokenizer_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why `draft` cannot propose token ids for `target` (None: it can). Compared: vocabulary size, every
    token's id, the special tokens and the BOS / EOS ids."""
    if target.vocab_size != draft.vocab_size:
        return f"vocabulary sizes differ ({target.vocab_size} vs {draft.vocab_size})"
    tv, dv = target.vocab(), draft.vocab()
    if tv != dv:
        diff = sorted((set(tv.items()) ^ set(dv.items())), key=lambda kv: kv[1])
        tok, i = diff[0]
        return (f"{len(diff)} token/id pairs differ (e.g. {tok!r} -> {i} in only one of them)")
    for name in ("bos_token_id", "eos_token_id", "eos_token_ids", "special_ids"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            show = (lambda s: sorted(s)) if isinstance(a, frozenset) else (lambda s: s)
            return f"{name} differs ({show(a)} vs {show(b)})"
    return None


class DraftModelProposer:
    """Greedy guesses of a draft model with its own paged KV cache (see the module docstring)."""

    def __init__(self, kv: KVCacheManager, runner: ModelRunner, max_model_len: int, vocab_size: int,
                 budget: int) -> None:
        """The draft engine's KV cache manager and runner (`Engine.__init__` builds that engine: `draft_config`),
        its context, the smaller of the two models' vocabularies and the token budget of one draft step."""
        self.kv, self.runner = kv, runner
        self.max_model_len, self.vocab_size, self.budget = max_model_len, vocab_size, budget
        self.state: dict[Hashable, Request] = {}  # target request -> its draft request
        self._ids = itertools.count()
        self.num_steps = 0  # draft forward passes (for stats and tests)

    # -- the Proposer interface ------------------------------------------------------------------
    def propose(self, key: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_batch([(key, tokens, k)])[0]

    def finish(self, key: Hashable, tokens: Sequence[int]) -> None:
        req = self.state.pop(key, None)
        if req is not None:
            self.kv.free(req)

    def forget_finished(self) -> None:
        pass  # it keeps nothing of finished requests

    def forget_missing(self, live: set[Hashable]) -> None:
        """Free the draft state of every request not in `live` (preempted ones: their K/V is recomputed
        from scratch when they run again, and so is the draft's)."""
        for key in [k for k in self.state if k not in live]:
            self.finish(key, ())

    # -- batched proposals -----------------------------------------------------------------------
    def _sync(self, key: Hashable, tokens: Sequence[int]) -> Request | None:
        """The draft request of `key`, its tokens set to `tokens`: K/V kept for their common prefix with
        what it held, blocks past it given back. None: too long for the draft's context."""
        if len(tokens) >= self.max_model_len:
            self.finish(key, ())
            return None
        req = self.state.get(key)
        if req is None:
            req = Request(f"draft-{next(self._ids)}", list(tokens), len(tokens), _GREEDY, seed=0)
            req.status = RequestStatus.RUNNING
            self.kv.add(req)
            self.state[key] = req
            return req
        old, n = req.token_ids, min(len(req.token_ids), len(tokens), req.num_computed_tokens)
        c = 0
        while c < n and old[c] == tokens[c]:
            c += 1
        req.token_ids = list(tokens)
        req.num_prompt_tokens = len(tokens)
        req.num_computed_tokens = min(c, len(tokens) - 1)  # the last token always runs: its row gives logits
        self.kv.trim(req, req.num_computed_tokens)
        return req

    def propose_batch(self, items: list[tuple[Hashable, Sequence[int], int]]) -> list[list[int]]:
        """Up to k greedy guesses for each (key, history, k); all requests advance together, one draft
        forward pass per step (the first one also computes each request's new tokens)."""
        out: list[list[int]] = [[] for _ in items]
        want: dict[int, int] = {}  # index into items -> drafts still wanted
        reqs: dict[int, Request] = {}
        for i, (key, tokens, k) in enumerate(items):
            k = min(k, self.max_model_len - len(tokens) - 1)
            if k <= 0:
                continue
            req = self._sync(key, tokens)
            if req is not None:
                reqs[i], want[i] = req, k
        while want:
            budget, batch = self.budget, ScheduledBatch(kv=StepKV())
            rows: list[int] = []
            for i in list(want):
                req = reqs[i]
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if self.kv.chunk_cap is not None:
                    n = min(n, self.kv.chunk_cap)
                if n <= 0:
                    continue
                if not self.kv.can_fit(req, req.num_computed_tokens + n):
                    del want[i]  # the draft's pool is full: this request gets what it has
                    continue
                self.kv.allocate(req, req.num_computed_tokens + n, batch.kv)
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                rows.append(i)
                budget -= n
            if not batch.requests:
                break
            result = self.runner.execute(batch)
            self.num_steps += 1
            picked = dict(zip(map(id, result.requests), result.token_ids))
            for i, n in zip(rows, batch.num_new_tokens):
                req = reqs[i]
                req.num_computed_tokens += n
                tok = picked.get(id(req))
                if tok is None:
                    continue  # a catch-up chunk that did not reach the end yet
                if tok >= self.vocab_size:  # (a padded row of a larger draft vocabulary: no guess)
                    del want[i]
                    continue
                req.token_ids.append(tok)
                out[i].append(tok)
                if len(out[i]) >= want[i]:
                    del want[i]
        return out

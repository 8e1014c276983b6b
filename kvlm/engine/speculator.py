"""Speculative decoding in the engine: which requests get drafts, how many, and what a verification keeps.

Before each step `propose` gives every decoding request up to k drafts (`Request.draft_token_ids`) from the
configured proposer (`kvlm.spec_decode`: ngram, suffix; `engine/draft_model.py`: a draft model, which
guesses for all requests in one batched draft forward pass per token). The scheduler runs such a request as
1 + k rows (its last token, then the drafts; fewer if the token budget or the KV pool is short), the
runner computes logits at all of them and the sampler picks the target's token at each, keyed by its
position (`engine/sampler.py`). With the native kernels a row's logits have the same bits alone or among
any others, so each pick is the one
plain decoding makes at that position, given the same tokens before it. `verify` keeps the drafts up to
the first one the target disagrees with, plus the target's own token there: the output is the same bits
with speculation on or off, greedy or seeded, and for unseeded requests the same distribution.

Depth (`spec_decode/depth.py`): each request keeps an estimate of its acceptance; `plan_depths` gives
drafts over all of the step's decoding requests, best first, while a draft's expected tokens beat its
row's cost in a step that costs a fixed part plus one unit per row, so a request whose drafts fail and
every request of a busy step draft little or nothing (a request left out probes with one draft now and
then). Within that, a step carries at most `draft_rows` (SpeculativeConfig, default 64) rows of running
requests and their drafts: each of B running requests proposes at most (draft_rows - B) // B drafts.
`cost_rule` False skips the plan: every request up to k, paused while its drafts keep failing.

Under a grammar, drafts it forbids are cut before verification (`RequestGrammar.valid_prefix`), each row
is masked as the grammar stands after the drafts before it (`masks_along`, which rolls the matcher back),
and the kept tokens are consumed one by one as any sampled token. A bounded cache (`kv_policy`) gets no
more drafts than keep a step's rows inside one position of its window (`chunk_limit`, as for a chunk).
Not drafted for (a plain decode row instead): requests with a reasoning budget, and embeddings; nothing
past max_tokens or the context is ever proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlm.config import SpeculativeConfig
from kvlm.engine.draft_model import DraftModelProposer
from kvlm.request import Request, RequestStatus
from kvlm.spec_decode import DraftDepth, Proposer, make_proposer, plan_depths


@dataclass(slots=True)
class SpecStats:
    """Engine-wide counts, vLLM's spec-decode metrics: verifications with drafts, drafts verified, drafts
    accepted, and accepted drafts by position (index i: the (i+1)-th draft of a verification)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def as_dict(self) -> dict[str, float | int | list[int] | None]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate}


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        """`proposer`: the one to use (the engine builds the draft model's, `engine/draft_model.py`);
        None: `config.method`'s (ngram, suffix)."""
        self.config = config
        self.k_max = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config.method, config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(accepted_per_pos=[0] * self.k_max)

    @staticmethod
    def drafts_allowed(req: Request) -> bool:
        """A decoding request (its next row is its last token) that may bring drafts."""
        return (req.status is RequestStatus.RUNNING and req.num_computed_tokens == req.num_tokens - 1
                and req.pooling is None and req.reasoning is None)

    def _room(self, req: Request) -> int:
        """Drafts that could all be emitted: past the last one comes the target's token, which must still
        fit under max_tokens and inside the context."""
        room = self.max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        return room

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` of every running request for the next step (empty: a plain row)."""
        cfg = self.config
        cap = (cfg.draft_rows - len(running)) // len(running) if running else 0
        allowed: list[tuple[Request, DraftDepth, int]] = []
        for req in running:
            req.draft_token_ids = []
            if not self.drafts_allowed(req):
                continue
            if req.draft_depth is None:
                req.draft_depth = DraftDepth()
            limit = min(self.k_max, cap, self._room(req))
            if limit > 0:
                allowed.append((req, req.draft_depth, limit))
        if cfg.cost_rule:  # drafts where they raise the step's tokens per second (spec_decode/depth.py)
            ks = plan_depths([d.p for _, d, _ in allowed], [lim for *_, lim in allowed], len(running))
            ks = [k or int(d.probe()) for k, (_, d, _) in zip(ks, allowed)]
        else:  # up to k each, paused while they keep failing
            ks = [0 if d.paused() else 1 if d.probing else lim for _, d, lim in allowed]
        asks = [(req, k) for k, (req, _, _) in zip(ks, allowed) if k > 0]
        p = self.proposer
        if isinstance(p, DraftModelProposer):  # one draft forward pass per guess for all requests together
            p.forget_missing(set(running))  # (finished ones are gone already; preempted ones go here)
            guesses = p.propose_batch([(req, req.token_ids, k) for req, k in asks])
        else:
            guesses = [p.propose(req, req.token_ids, k) for req, k in asks]
        for (req, _), drafts in zip(asks, guesses):
            if req.grammar is not None and drafts:  # cut what the grammar forbids before verifying it
                drafts = drafts[: req.grammar.valid_prefix(drafts)]
            req.draft_token_ids = drafts

    def verify(self, req: Request, sampled: list[int]) -> int:
        """`sampled`: the target's token at each of req's rows (1 + its drafts). Returns how many drafts are
        accepted (the longest prefix equal to the target's picks); counts them."""
        drafts = req.draft_token_ids
        a = 0
        while a < len(drafts) and sampled[a] == drafts[a]:
            a += 1
        s, m = self.stats, req.metrics
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += a
        for i in range(a):
            s.accepted_per_pos[i] += 1
        m.spec_num_drafts += 1
        m.spec_num_draft_tokens += len(drafts)
        m.spec_num_accepted_tokens += a
        if len(m.spec_accepted_per_pos) < a:
            m.spec_accepted_per_pos += [0] * (a - len(m.spec_accepted_per_pos))
        for i in range(a):
            m.spec_accepted_per_pos[i] += 1
        if req.draft_depth is not None:
            req.draft_depth.record(len(drafts), a)
        return a

    def finish(self, req: Request) -> None:
        """`req` ended: the proposer may keep its tokens (suffix) and drops its state."""
        req.draft_token_ids = []
        if req.pooling is None:
            self.proposer.finish(req, req.token_ids)

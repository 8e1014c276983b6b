"""How many drafts each request proposes next: a cost model of the step against each request's acceptance.

Cost. A step of R rows costs about FIXED_ROWS + R row-times on a CPU (the fixed part: reading the weights
once, the lm_head's call, the host's work; measured on the default model, docs/speculative.md: 6.4 ms for
1 row, 1.4 ms per row more, so FIXED_ROWS = 3.6). A draft is one more row.

Gain. Each request keeps `p`, its measured chance that a draft is accepted given the one before it was
(counts over the drafts verified so far, each draft weighing DECAY times the one after it, with a prior
of 1/2: `DraftDepth.record`); its j-th draft then adds p^j tokens on average.

Plan (`plan_depths`, per step over all decoding requests): start from the step's B plain rows, which
give B tokens; add drafts in order of their gain p^j while a draft's gain beats the step's tokens per
row-time so far, T / (FIXED_ROWS + R) (adding it then raises the step's tokens per second). Alone at
p = 1 every draft up to k pays; alone at p = 0.5 one draft does; at B = 16 only drafts with p^j > 0.8
do; at p < 0.22 none do, even alone. So one rule turns drafting down for a request whose drafts fail and
for a busy step, where a row costs as much as a plain request's row (vLLM's `disable_by_batch_size`).

Probes. A request the plan gives no drafts would never measure its acceptance again: after `pause`
steps without a verification it gets one draft anyway (a probe); `pause` starts at PAUSE and doubles at
every probe that fails (up to MAX_PAUSE), back to PAUSE after any accepted draft. A request whose drafts
keep failing thus spends one extra row in every PAUSE..MAX_PAUSE steps on them.

With the cost rule off (`SpeculativeConfig.cost_rule` False, for tests that want drafts in any batch)
each request proposes up to k, except that MISSES verifications in a row with nothing accepted pause it
as above.
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED_ROWS = 3.6  # a step's fixed cost, in rows (measured: docs/speculative.md, "The depth rule")
DECAY = 0.85  # weight of a judged draft one draft older in the acceptance estimate (a window of ~7 drafts)
PRIOR_ACCEPTED, PRIOR_TRIALS = 0.5, 1.0  # p = 1/2 before any verification (a prior that decays as drafts do)
MISSES = 3  # cost rule off: verifications in a row with nothing accepted before drafting pauses
PAUSE = 8  # steps without drafts before a probe, at first
MAX_PAUSE = 256


@dataclass(slots=True)
class DraftDepth:
    """One request's acceptance estimate and probe state (the engine's Speculator keeps one per request)."""

    accepted: float = PRIOR_ACCEPTED  # decayed count of accepted drafts (from the prior's)
    trials: float = PRIOR_TRIALS  # decayed count of drafts the target judged (those up to the first rejected one)
    misses: int = 0  # verifications in a row with nothing accepted
    idle: int = 0  # steps since its last verification (or its first chance to draft)
    pause: int = PAUSE  # steps without a verification before a probe
    probing: bool = False  # its drafts this step are a probe

    @property
    def p(self) -> float:
        """Estimated chance that a draft is accepted, given the draft before it was."""
        return self.accepted / self.trials

    def probe(self) -> bool:
        """A step in which the plan gives it no drafts: True when a probe is due (then it drafts 1)."""
        self.idle += 1
        self.probing = self.idle > self.pause
        return self.probing

    def paused(self) -> bool:
        """Cost rule off: True while it waits out a pause after MISSES failed verifications in a row."""
        if self.misses < MISSES:
            return False
        self.idle += 1
        self.probing = self.idle > self.pause
        return not self.probing

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts kept `accepted` of them."""
        if proposed <= 0:
            return
        judged = accepted + (accepted < proposed)  # the drafts up to and including the first rejected one
        for j in range(judged):  # oldest first: the accepted drafts, then the rejected one
            hit = j < accepted
            self.accepted = DECAY * self.accepted + hit
            self.trials = DECAY * self.trials + 1
        self.idle = 0
        if accepted:
            self.misses, self.pause = 0, PAUSE
        else:
            self.misses += 1
            if self.probing:  # a probe failed: the next pause is twice as long
                self.pause = min(2 * self.pause, MAX_PAUSE)
        self.probing = False


def plan_depths(ps: list[float], limits: list[int], base_rows: int, fixed_rows: float = FIXED_ROWS) -> list[int]:
    """Drafts per request for one step (module docstring): `ps` each request's acceptance estimate,
    `limits` the most each may propose, `base_rows` the step's rows without drafts."""
    ks = [0] * len(ps)
    gains = [p for p, lim in zip(ps, limits) if lim > 0]
    if not gains:
        return ks
    tokens, cost = float(base_rows), base_rows + fixed_rows
    nxt = [p if lim > 0 else 0.0 for p, lim in zip(ps, limits)]  # each request's next draft's gain
    while True:
        i = max(range(len(nxt)), key=nxt.__getitem__)
        g = nxt[i]
        if g <= 0 or g * cost <= tokens:  # it would lower the step's tokens per row-time
            return ks
        ks[i] += 1
        tokens, cost = tokens + g, cost + 1
        nxt[i] = g * ps[i] if ks[i] < limits[i] else 0.0

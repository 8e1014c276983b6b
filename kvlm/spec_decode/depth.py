"""How many drafts one request proposes next: its depth follows the acceptance measured so far.

The rule (per request; the engine adds the batch cap, `kvlm.engine.speculator`):
* start at k = k_max (`num_speculative_tokens`);
* after a verification of d drafts (d <= k: the proposer may find fewer) of which a were accepted: all
  accepted -> max(k, d + 1) (up to k_max), else k = a + 1 (the next guess reaches just past the break);
* `MISSES` verifications in a row with nothing accepted -> no drafts for `pause` steps, then try again at
  k = 1; `pause` starts at `PAUSE` steps and doubles at every such turn-off (up to `MAX_PAUSE`), back to
  `PAUSE` after any accepted draft. A request whose drafts keep failing thus spends at most one extra row
  in every `PAUSE`..`MAX_PAUSE` steps on them.
A draft costs one more row of the step; at batch 1 on a CPU that row is nearly free (the step reads the
weights once for all rows), so the rule is quick to try again and slow to give up. The constants here and
the engine's batch cap (`draft_rows` 16) are a first choice, not yet decided by measurement (`kvlm bench
spec` is the command for it; docs/speculative.md has its one run so far, on a loaded shared machine).
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES = 3  # verifications in a row with nothing accepted before drafting pauses
PAUSE = 8  # steps without drafts at the first pause
MAX_PAUSE = 256


@dataclass(slots=True)
class DraftDepth:
    k_max: int
    k: int = 0  # next depth (0 before the first call: k_max)
    misses: int = 0  # verifications in a row with nothing accepted
    paused: int = 0  # steps left without drafts
    pause: int = PAUSE  # the next pause's length

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    def want(self) -> int:
        """How many drafts to propose this step (0 while paused; each call is one step)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts kept `accepted` of them."""
        if proposed <= 0:
            return
        if accepted:
            self.misses, self.pause = 0, PAUSE
        else:
            self.misses += 1
        # all accepted: one more (a proposer that found fewer than asked does not lower k); else just past the break
        self.k = min(self.k_max, max(self.k, proposed + 1)) if accepted == proposed else accepted + 1
        if self.misses >= MISSES:
            self.misses, self.paused, self.k = 0, self.pause, 1
            self.pause = min(2 * self.pause, MAX_PAUSE)

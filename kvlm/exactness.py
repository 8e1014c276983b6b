"""The exactness oracle's vocabulary: where two runs of the same requests first differ, bit for bit.

kvlm's promise is that the KV cache, batching, chunking and paging change speed and memory, never a
token's logits. `LLM.check_exact` runs requests along several paths (alone, inside a batch, without the
KV cache) and compares each against the first with `first_difference`: token ids, then every returned
logprob with `==` on the float values (no tolerance). Anyone who changes a kernel runs it before and
after (`kvlm generate --check-exact`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlm.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class ExactDifference:
    """The first place where a path parts from the reference run."""

    path: str  # the path that differs (e.g. "no KV cache")
    prompt: int  # index of the prompt
    step: int  # index of the generated token
    token: int | None  # the reference's token there (None: the reference stopped earlier)
    other_token: int | None  # the path's token (None: the path stopped earlier)
    logprob: float | None  # the reference's logprob of its token
    other_logprob: float | None  # the path's logprob of the reference's token (or of its own)

    def __str__(self) -> str:
        return (f"differs from the reference on path {self.path!r}: prompt {self.prompt}, token {self.step}: "
                f"{self.token} (logprob {self.logprob!r}) vs {self.other_token} (logprob {self.other_logprob!r})")


@dataclass(frozen=True, slots=True)
class ExactReport:
    paths: tuple[str, ...]  # the paths compared against the reference (each prompt alone, with the cache)
    num_tokens: int  # generated tokens compared, per path
    difference: ExactDifference | None

    @property
    def identical(self) -> bool:
        return self.difference is None

    def __str__(self) -> str:
        if self.difference is None:
            return f"bit-identical on {self.num_tokens} tokens ({', '.join(self.paths)})"
        return str(self.difference)


def first_difference(path: str, ref: list[RequestOutput], other: list[RequestOutput]) -> ExactDifference | None:
    """The first token (prompt by prompt, step by step) whose id or logprobs differ between two runs of
    the same requests; the logprob dicts (top-k and the chosen token) must be equal as floats. A prompt
    one run has no output for differs at its token 0 (the missing side's token is None), even where the
    other side generated nothing: a path that drops outputs is not exact."""
    for i in range(max(len(ref), len(other))):
        if i >= len(ref) or i >= len(other):
            ta = ref[i].outputs[0].token_ids[:1] if i < len(ref) else []
            tb = other[i].outputs[0].token_ids[:1] if i < len(other) else []
            return ExactDifference(path, i, 0, ta[0] if ta else None, tb[0] if tb else None, None, None)
        ca, cb = ref[i].outputs[0], other[i].outputs[0]
        la, lb = ca.logprobs or [], cb.logprobs or []
        for k in range(max(len(ca.token_ids), len(cb.token_ids))):
            ta = ca.token_ids[k] if k < len(ca.token_ids) else None
            tb = cb.token_ids[k] if k < len(cb.token_ids) else None
            da = la[k] if k < len(la) else None
            db = lb[k] if k < len(lb) else None
            if ta != tb or da != db:
                lpa = None if da is None or ta is None else da.get(ta)
                lpb = None if db is None else db.get(ta, db.get(tb)) if ta is not None else db.get(tb)
                return ExactDifference(path, i, k, ta, tb, lpa, lpb)
    return None

"""Turning sampled token ids into a request's text: streaming detokenization and stop conditions.

For each new token it decides whether the request is finished (EOS, a stop token id, a stop string,
max_tokens, the context limit) and which text is final. Text that might be the beginning of a stop string
is held back (`Request.pending_text`) until it is known not to be one, so a stop string split across
tokens is never streamed in part and never appears in the output. A request ended without a token (an
abort, a grammar that failed to compile after it was queued) gets its final delta here too.
"""

from __future__ import annotations

import logging

from kvlm.outputs import StreamDelta
from kvlm.request import Request

log = logging.getLogger("kvlm")


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append_token(self, req: Request, token: int, logprobs: dict[int, float] | None) -> StreamDelta:
        """Record a sampled token; returns what a streaming client should receive now."""
        p = req.params
        if req.grammar_applies and not req.grammar.accept(token):  # type: ignore[union-attr]
            # The mask allowed only what the grammar accepts, so this is a bug; the matcher is now in error
            # and allows EOS only, so the request ends at its next token.
            log.warning("kvlm: request %s: the grammar refused sampled token %d", req.request_id, token)
        req.token_ids.append(token)
        req.metrics.num_generated_tokens += 1
        if req.reasoning is not None:
            req.reasoning.observe(token)  # may start forcing `</think>` from the next token
        if logprobs is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(logprobs)
        n_out = req.num_output_tokens
        can_stop = n_out >= p.min_tokens
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = "stop"
        elif can_stop and p.stop_token_ids and token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif req.detokenizer is not None:
            self._add_text(req, req.detokenizer.push(token), can_stop)  # may stop on a stop string
        # The context ends a request, unless its cache is bounded (then max_tokens None means up to a
        # context's worth of new tokens).
        full = req.num_tokens >= self.max_model_len if req.kv_policy is None else (
            p.max_tokens is None and n_out >= self.max_model_len)
        if req.finish_reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or full):
            req.finish_reason = "length"
        if req.finish_reason is not None:
            # Finished: everything held back is final. After a stop string the rest is discarded;
            # otherwise the detokenizer may still hold bytes of an incomplete character.
            if not isinstance(req.stop_reason, str) and req.detokenizer is not None:
                req.pending_text += req.detokenizer.flush()
            new_text, req.pending_text = req.pending_text, ""
        else:
            new_text = self._release_safe_text(req, can_stop)
        req.text += new_text
        return StreamDelta(req.request_id, new_text, [token], req.finish_reason is not None, req.finish_reason,
                           None if logprobs is None else [logprobs],
                           req.prompt_logprobs if n_out == 1 else None)

    @staticmethod
    def abort(req: Request, reason: str | None = None) -> StreamDelta:
        """End `req` without a token ("abort": a client's abort, or `reason`, its grammar's compile error);
        returns the final delta a streaming client receives."""
        req.finish_reason = "abort"
        if reason is not None:
            req.stop_reason = reason
        return StreamDelta(req.request_id, "", [], True, "abort")

    def _add_text(self, req: Request, piece: str, can_stop: bool) -> None:
        req.pending_text += piece
        stops = req.params.stop_strings
        if not stops or not can_stop:
            return
        # Released text never ends with a proper prefix of a stop string (see _release_safe_text), so a
        # stop string, once complete, lies wholly inside the held-back text.
        hay = req.pending_text
        best: tuple[int, str] | None = None
        for s in stops:
            i = hay.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            req.pending_text = hay[: i + len(s)] if req.params.include_stop_str_in_output else hay[:i]
            req.finish_reason, req.stop_reason = "stop", s

    @staticmethod
    def _release_safe_text(req: Request, can_stop: bool) -> str:
        """Release held-back text except a tail that could still grow into a stop string. Before
        min_tokens no stop string can end the request, so that text is final at once."""
        stops = req.params.stop_strings
        pending = req.pending_text
        if req.finish_reason is not None or not stops or not can_stop:
            req.pending_text = ""
            return pending
        hold = 0
        for s in stops:
            # Longest suffix of pending that is a proper prefix of s.
            for k in range(min(len(s) - 1, len(pending)), 0, -1):
                if pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out, req.pending_text = pending[: len(pending) - hold], pending[len(pending) - hold :]
        return out

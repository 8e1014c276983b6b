"""`/v1/completions`: prompts (text or token ids, one or many) x n choices, echo and logprobs, OpenAI's
legacy logprobs shape (tokens, token_logprobs, top_logprobs keyed by text, text_offset), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvlm.server.protocol import COMPLETION_DEFAULT_MAX_TOKENS, CompletionRequest, bad_request
from kvlm.server.serving import OpenAIServing, SSEStream, _Call, _Choice, sse


class CompletionServing(OpenAIServing):
    def completion_prompts(self, r: CompletionRequest) -> list[list[int] | str]:
        p = r.prompt
        if isinstance(p, str):
            prompts: list[list[int] | str] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return prompts

    async def completions(self, r: CompletionRequest, request_id: str) -> dict[str, Any] | SSEStream:
        lora = self.check_model(r.model)
        if r.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if r.logprobs is not None and not 0 <= r.logprobs <= self.opts.max_logprobs:
            raise bad_request(f"logprobs must be in [0, {self.opts.max_logprobs}], got {r.logprobs}", "logprobs")
        prompts = self.completion_prompts(r)
        self._check_common(r, len(prompts))
        constraint = await self._constraint(r)
        count = len(prompts) * r.n
        self.reserve(count)
        try:
            specs, prompt_ids = [], []
            for pi, p in enumerate(prompts):
                ids = self.tokenizer.encode(p) if isinstance(p, str) else p
                mt = self._check_prompt(ids, r.max_tokens, "prompt", COMPLETION_DEFAULT_MAX_TOKENS,
                                        bounded=self._bounded(r))
                prompt_ids.append(ids)
                for i in range(r.n):
                    plp = r.logprobs if r.echo and r.logprobs is not None else None
                    rid = request_id if count == 1 else f"{request_id}-{pi * r.n + i}"
                    specs.append((ids, self._params(r, mt, i, r.logprobs, plp, constraint), rid))
        except BaseException:
            self.aengine.release(count)
            raise
        sub = await self._submit(specs, count, "prompt", bool(r.stream), lora=lora)
        ctx = _Call(request_id, "cmpl", r.n, prompt_ids, sub, lora or self.model_name)
        if r.stream:
            return SSEStream(self._sse(ctx, "text_completion", r, self._stream_completion(r, ctx)), sub)
        choices = await ctx.collect()  # closes the submission however it ends
        out = []
        for idx, c in enumerate(choices):
            ids = prompt_ids[idx // r.n]
            text, lp = c.text, None
            prefix = self.tokenizer.decode(ids, skip_special_tokens=False) if r.echo else ""
            if r.logprobs is not None:
                lp = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                if r.echo:
                    plp = ctx.prompt_logprobs(idx) or [None] * len(ids)
                    lp = self._merge_echo(self._completion_logprobs(ids, plp, 0), lp)
            out.append({"index": idx, "text": prefix + text, "logprobs": lp, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason})
        return {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                "choices": out, "usage": ctx.usage()}

    def _completion_logprobs(self, ids: list[int], lps: list[dict[int, float] | None], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, d in zip(ids, lps):
            s = self.token_text(t)
            tokens.append(s)
            token_lps.append(None if d is None else d[t])
            tops.append(None if d is None else self._top_by_text(d))
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _top_by_text(self, d: dict[int, float]) -> dict[str, float]:
        """OpenAI keys top logprobs by token text; distinct ids with the same text keep the larger value."""
        out: dict[str, float] = {}
        for k, v in sorted(d.items(), key=lambda kv: kv[1]):
            out[self.token_text(k)] = v
        return out

    @staticmethod
    def _merge_echo(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {k: a[k] + b[k] for k in a}

    async def _stream_completion(self, r: CompletionRequest, ctx: _Call) -> AsyncIterator[str]:
        state = [_Choice() for _ in range(len(ctx.prompt_ids) * r.n)]
        async for idx, d in ctx.deltas():
            c = state[idx]
            text = d.text
            lp = None
            if r.echo and not c.started:
                ids = ctx.prompt_ids[idx // r.n]
                prefix = self.tokenizer.decode(ids, skip_special_tokens=False)
                text = prefix + text
                if r.logprobs is not None:
                    plp = d.prompt_logprobs or [None] * len(ids)
                    lp = self._completion_logprobs(ids, plp, 0)
                c.offset = len(prefix)
            c.started = True
            if r.logprobs is not None and d.logprobs:
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs
            if not text and not d.finished:
                continue  # never an empty text chunk; the token's logprobs go with the next one
            if r.logprobs is not None and c.token_ids:
                new = self._completion_logprobs(c.token_ids, c.logprobs, c.offset)
                c.offset += sum(len(s) for s in new["tokens"])
                lp = new if lp is None else self._merge_echo(lp, new)
                c.token_ids, c.logprobs = [], []
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                      "stop_reason": ctx.stop_reason(d)}
            yield sse({"id": ctx.id, "object": "text_completion", "created": ctx.created,
                       "model": ctx.model, "choices": [choice]})

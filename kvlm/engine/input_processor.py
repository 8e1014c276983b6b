"""Input processing: a prompt (text or token ids) and its `SamplingParams` -> a validated `Request`.

What needs the model and the engine's shape is checked here, once, before anything is queued (vLLM v1's
`InputProcessor` has the same place): token ids inside the vocabulary (the prompt's, stop token ids,
logit-bias ids), the prompt against the context, prompt + max_tokens against the whole KV pool, the
request's bounded-cache policy, a free request id, and the grammar (a compile already known bad is
refused now; one still compiling is submitted and waits in the scheduler). A request that passes is
translated: its detokenizer, its seed (params.seed or one drawn now), its grammar state, its reasoning budget.

Every refusal is a `ParameterError` (`PromptTooLongError`, a `ParameterError` too) with the field's API name
in `.param`, except a request id already in use (`ValueError`). Sampling fields that need no model are
checked earlier, by `SamplingParams` itself. This module queues nothing and knows no step: the engine adds
the request to its scheduler.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Container, Sequence

import torch

from kvlm.config import EngineConfig
from kvlm.errors import ParameterError, PromptTooLongError
from kvlm.kv_cache.block_manager import BlockManager
from kvlm.kv_policy import BoundedKV
from kvlm.request import Request
from kvlm.sampling_params import PoolingParams, SamplingParams
from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.reasoning_budget import ReasoningBudget, ThinkTokens
from kvlm.tokenizer.detokenizer import IncrementalDetokenizer
from kvlm.tokenizer.tokenizer import Tokenizer


class InputProcessor:
    """Validates and translates requests for one engine. `block_manager` is group 0's (the whole pool a
    request must fit in), `windows` the sliding windows of the cache's other layer groups (none: every
    layer full). A bad engine-wide `--max-kv-tokens` / `--sink-tokens` is refused here, at start."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 block_manager: BlockManager, windows: Sequence[int], grammars: GrammarCompiler,
                 device: torch.device) -> None:
        self.config, self.tokenizer, self.vocab_size, self.max_model_len = config, tokenizer, vocab_size, max_model_len
        self.block_manager, self.windows, self.grammars, self.device = block_manager, windows, grammars, device
        self._ids = itertools.count()  # "req-N" for requests without an id
        # the think tags' ids, for reasoning budgets: found once, from the tokenizer
        self.think_tokens = ThinkTokens.from_encoder(lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.kv_policy(SamplingParams())

    def process(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                in_use: Container[str] = (), pooling: PoolingParams | None = None) -> Request:
        """The `Request` for `prompt` (text is tokenized) under `params`, or the first check it fails.
        `in_use`: the ids of the engine's live requests. `pooling` (resolved): a prompt-only request, an
        embedding, which samples nothing, so its prompt may fill the whole context."""
        if params is None:  # an embedding's: it only needs room for its prompt (_check_pool)
            params = SamplingParams(temperature=0, max_tokens=1) if pooling is not None else SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self._check_ids(ids, params)
        policy = self.kv_policy(params)
        if policy is None and len(ids) > self.max_model_len - (pooling is None):
            if pooling is not None:
                raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len}")
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                "(room for at least one output token is needed)"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in in_use:
            raise ValueError(f"request id {rid!r} is already in use")
        self._check_pool(len(ids), params, policy)
        req = Request(rid, ids, len(ids), params, prompt=text, kv_policy=policy, pooling=pooling)
        req.metrics.num_prompt_tokens = len(ids)
        if pooling is not None:
            return req  # no text, no grammar, no samples
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        if params.structured_outputs is not None:
            req.grammar = self.grammars.request_grammar(params.structured_outputs)
            if req.grammar.error is not None:  # known bad (cached): refuse now, as any other bad parameter
                raise req.grammar.error
        if params.reasoning or params.reasoning_budget is not None:
            req.reasoning = ReasoningBudget.start(self.think_tokens, params.reasoning_budget, ids)
        return req

    def _check_ids(self, ids: list[int], params: SamplingParams) -> None:
        """Every token id the request names lies in the vocabulary."""
        if not ids:
            raise ParameterError("prompt", "prompt is empty")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ParameterError("prompt_token_ids", f"prompt_token_ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids or ()):
            raise ParameterError("stop_token_ids", f"stop_token_ids must be in [0, {vocab}) (the vocabulary), "
                                 f"got {max(params.stop_token_ids or ())}")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ParameterError("logit_bias", f"logit_bias token ids must be in [0, {vocab}) (the vocabulary), "
                                 f"got {max(params.logit_bias or ())}")

    def _check_pool(self, num_prompt: int, params: SamplingParams, policy: BoundedKV | None) -> None:
        """The request's most K/V at once (prompt + max_tokens, capped by the context or its bounded
        cache's window and a block) fits in the whole pool, so it can run once the others are done."""
        bm = self.block_manager
        want = num_prompt + (params.max_tokens or self.max_model_len - num_prompt)
        need = min(want, self.max_model_len) if policy is None else min(want, policy.max_tokens + policy.block_size)
        if bm.blocks_for(need) > bm.num_blocks:
            raise PromptTooLongError(
                f"request needs {need} tokens of KV cache but the whole pool holds {bm.num_blocks * bm.block_size}"
            )

    def kv_policy(self, params: SamplingParams) -> BoundedKV | None:
        """The bounded-cache policy of a request with `params` (its own, else the engine's; None: unbounded)."""
        cfg = self.config
        n = params.max_kv_tokens if params.max_kv_tokens is not None else cfg.max_kv_tokens
        if n is None:
            return None
        if not cfg.enable_kv_cache or cfg.kv_cache_layout != "paged":
            raise ParameterError("max_kv_tokens", "max_kv_tokens (a bounded KV cache) needs the paged KV cache; "
                                 "drop --no-kv-cache / --kv-cache-layout contiguous")
        sinks = params.sink_tokens if params.sink_tokens is not None else cfg.sink_tokens
        policy = BoundedKV.make(n, sinks, self.block_manager.block_size, self.max_model_len)
        # Sliding layer groups keep their own window and never see the sinks: the kept tokens must cover it.
        widest = max(self.windows, default=0)
        if widest and policy.window - policy.block_size < widest:
            least = widest + policy.num_sinks + policy.block_size
            raise ParameterError("max_kv_tokens", f"max_kv_tokens must be at least {least} on this model (its "
                                 f"sliding layers' window of {widest} tokens, the {policy.num_sinks} sinks and a "
                                 f"block), got {n}")
        return policy

    # -- grammars compiled after the request was queued ---------------------------------------------
    @staticmethod
    def failed_grammars(waiting: Sequence[Request]) -> list[Request]:
        """Queued requests whose grammar compile has failed since `process` (it was still running then):
        refused late, as `process` refuses one already known bad. Callers that wait for the compile
        first (the server, `LLM`) never have any."""
        return [r for r in waiting if r.grammar is not None and r.grammar.error is not None]

    @staticmethod
    def wait_for_grammars(waiting: Sequence[Request], timeout: float = 0.05) -> bool:
        """Wait up to `timeout` s for one of the queued requests' grammar compiles; False if none is
        compiling. Briefly: a server loop still reads its inbox meanwhile."""
        compiling = [r.grammar.future for r in waiting if not r.grammar_ready]  # type: ignore[union-attr]
        if compiling:
            concurrent.futures.wait(compiling, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return bool(compiling)

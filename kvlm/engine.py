"""The engine: requests in, tokens out, one `step()` at a time (schedule -> execute -> update).

It wires the pieces: the model and KV cache (in the runner), the block manager and scheduler (plain
Python bookkeeping) and the output processor (text and stop conditions). `LLM` and the CLI are thin loops
over `add_request()` and `step()`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import torch

from kvlm.config import EngineConfig, ModelConfig
from kvlm.errors import PromptTooLongError
from kvlm.kv_cache import KVCache
from kvlm.kv_pool import describe_kv_pool, make_kv_cache
from kvlm.loader import load_checkpoint, resolve_model
from kvlm.model import LlamaForCausalLM
from kvlm.output_processor import OutputProcessor
from kvlm.request import Request, StreamDelta
from kvlm.runner import ModelRunner, StepResult
from kvlm.sampling_params import SamplingParams
from kvlm.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger("kvlm")

# "auto": float32 activations and KV cache; GGUF weights stay quantized where the device is a CPU.
_TORCH_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


class Engine:
    def __init__(self, model: str | os.PathLike = "smollm2-135m", config: EngineConfig | None = None,
                 quiet: bool = False) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _TORCH_DTYPES[cfg.dtype]
        self.model_path: Path = resolve_model(str(model), quiet=quiet)
        # --dtype auto on CPU: weights computed on in their stored block formats (kvlm.kernels);
        # an explicit dtype (and any GPU) dequantizes them at load: the dense reference path.
        self.quantized = cfg.dtype == "auto" and self.device.type == "cpu"
        model_config, state, self.tokenizer = load_checkpoint(self.model_path, quantized=self.quantized)
        self.model_config: ModelConfig = model_config
        self.max_model_len = min(cfg.max_model_len or min(model_config.max_position_embeddings, 4096),
                                 model_config.max_position_embeddings)
        if model_config.sliding_window and self.max_model_len > model_config.sliding_window:
            # The attention here is full, which equals sliding-window attention only within the window.
            log.warning("kvlm: context capped at the model's sliding window of %d tokens", model_config.sliding_window)
            self.max_model_len = model_config.sliding_window
        with torch.device("meta"):  # no random init of weights that load_weights replaces
            net = LlamaForCausalLM(model_config, self.max_model_len)
        net.load_weights(state)
        del state
        self.model = net.to(device=self.device, dtype=self.dtype).eval()
        self.model.rope_cos, self.model.rope_sin = self.model.rope_cos.float(), self.model.rope_sin.float()
        if self.device.type == "cpu":
            self.model.to_input_major()

        self.kv_cache: KVCache
        self.kv_cache, self.block_manager = make_kv_cache(cfg, model_config, self.max_model_len,
                                                          self.kv_bytes_per_token, self.dtype, self.device)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   recompute_all=not cfg.enable_kv_cache)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.tokenizer.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}  # live requests by id, for abort()
        self._ids = itertools.count()
        self.num_steps = 0
        log.info(self.describe_cache())  # shown when the "kvlm" logger is at INFO (the CLI without -q)

    # -- setup -------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.model_config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8))

    def describe_cache(self) -> str:
        return describe_kv_pool(self.config, self.kv_cache, self.block_manager, self.max_model_len,
                                self.kv_bytes_per_token)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, reuse: Request | None = None) -> Request:
        """Queue a prompt (text or token ids). `reuse`: a finished request whose KV blocks were kept
        (`release_kv=False` in `step`-driven sessions); its longest common prefix is not recomputed."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} (room for at least one output token is needed)"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        want = len(ids) + (params.max_tokens or self.max_model_len - len(ids))
        need = min(want, self.max_model_len)
        if self.block_manager.blocks_for(need) > self.block_manager.num_blocks:
            raise PromptTooLongError(
                f"request needs {need} tokens of KV cache but the whole pool holds "
                f"{self.block_manager.num_blocks * self.block_manager.block_size}"
            )
        req = Request(rid, ids, len(ids), params, prompt=text)
        req.metrics.num_prompt_tokens = len(ids)
        req.detokenizer = self.tokenizer.incremental_detokenizer(ids, skip_special_tokens=params.skip_special_tokens)
        req.generator = torch.Generator(device=self.device)
        if params.seed is not None:
            req.generator.manual_seed(params.seed)
        else:
            req.generator.seed()
        if reuse is not None:
            self._adopt_cache(req, reuse)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def _adopt_cache(self, req: Request, old: Request) -> None:
        """Move `old`'s kept KV blocks to `req` and skip recomputing their common prefix."""
        n = 0
        limit = min(old.num_computed_tokens, req.num_tokens - 1)  # the last prompt token must run
        while n < limit and old.token_ids[n] == req.token_ids[n]:
            n += 1
        req.block_table, old.block_table = old.block_table, []
        self.block_manager.truncate(req, n)
        req.num_computed_tokens = n
        req.metrics.num_cached_tokens = n

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return False
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        req.metrics.finished_time = time.perf_counter()
        return True

    def release(self, req: Request) -> None:
        """Free the blocks a finished request kept for reuse."""
        self.block_manager.free(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ----------------------------------------------------------------------------------
    def step(self, keep_kv: bool = False, keep_logits: bool = False) -> list[StreamDelta]:
        """Schedule -> execute -> update. Returns one delta per request that produced a token.

        keep_kv: finished requests keep their blocks (for `reuse`; call `release` when done).
        keep_logits: attach this step's logits to `self.last_result` (tests and benchmarks).
        """
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.scheduler.waiting:  # cannot happen given the admission check; never spin silently
                raise RuntimeError("scheduler made no progress with requests waiting")
            return []
        result = self.runner.execute(batch, keep_logits=keep_logits)
        self.last_batch: ScheduledBatch = batch
        self.last_result: StepResult = result
        self.num_steps += 1
        return self._update(batch.requests, batch.num_new_tokens, result, keep_kv)

    def _update(self, reqs: list[Request], num_new: list[int], result: StepResult,
                keep_kv: bool) -> list[StreamDelta]:
        now = time.perf_counter()
        bpt, bs = self.kv_bytes_per_token, self.block_manager.block_size
        for req, n in zip(reqs, num_new):
            req.num_computed_tokens += n
            m = req.metrics
            m.blocks_held = len(req.block_table)
            m.kv_bytes_held = m.blocks_held * bs * bpt if self.config.enable_kv_cache else 0
            m.kv_bytes_used = req.num_computed_tokens * bpt if self.config.enable_kv_cache else 0
            if not self.config.enable_kv_cache:
                req.num_computed_tokens = 0  # nothing is kept: the next step recomputes everything
        deltas = []
        for req, tok, lp in zip(result.requests, result.token_ids, result.logprobs):
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            delta = self.output_processor.append_token(req, tok, lp)
            if req.finish_reason is not None:
                req.metrics.finished_time = now
                self.scheduler.finish(req, free_blocks=not (keep_kv and self.config.enable_kv_cache))
                self.requests.pop(req.request_id, None)
            deltas.append(delta)
        return deltas

"""The engine: requests in, tokens out, one `step()` at a time (schedule -> execute -> update).

It wires the pieces: the input processor (validation, prompt -> `Request`), the model and KV cache (in the
runner), the block manager and scheduler (plain Python bookkeeping) and the output processor (text and
stop conditions), and keeps the live requests. `LLM` and the CLI are thin loops over `add_request()` and
`step()`; teacher-forced scoring (`prompt_logits`) is a loop over `step()` too (`scoring.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvlm.config import DTYPES, EngineConfig, ModelConfig, SpeculativeConfig
from kvlm.engine import scoring
from kvlm.engine.draft_model import DraftModelProposer, draft_config, tokenizer_mismatch
from kvlm.engine.input_processor import InputProcessor
from kvlm.engine.model_runner import ModelRunner, StepResult
from kvlm.engine.output_processor import OutputProcessor
from kvlm.engine.pooling import ModelPooling
from kvlm.engine.scheduler import ScheduledBatch, Scheduler
from kvlm.engine.speculator import Speculator
from kvlm.engine.threads import ThreadGovernor
from kvlm.errors import KvlmError, LoRAError, ParameterError, SnapshotError
from kvlm.kernels.kv_quant import FORMATS, GROUP, KVQuantFormat
from kvlm.kv_cache import snapshot as kv_snapshot
from kvlm.kv_cache.block_manager import held_blocks
from kvlm.kv_cache.k_center import calibrate_k_center, center_digest
from kvlm.kv_cache.pool import KVBytes, describe_kv_pool, make_kv_cache
from kvlm.kv_cache.prefix_misses import PrefixHistory
from kvlm.kv_cache.snapshot import SnapshotInfo, prefix_cached, snapshot_header
from kvlm.kv_cache.storage import KVCache, KVElement, kv_format
from kvlm.kv_cache.tier_pool import PoolTier, make_pool_tier
from kvlm.loader import resolve_model
from kvlm.loader.build import load_model
from kvlm.loader.fingerprint import model_files, model_fingerprint
from kvlm.loader.heap import keep_freed_memory, trim_heap
from kvlm.loader.lora import load_lora
from kvlm.lora import LoRAAdapter, LoRARegistry
from kvlm.model.llama import LlamaForCausalLM
from kvlm.outputs import StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import PoolingParams, SamplingParams
from kvlm.structured.compiler import GrammarCompiler

log = logging.getLogger("kvlm")

# "auto": float32 activations; GGUF weights stay quantized where the device is a CPU.
_TORCH_DTYPES = {name: torch.float32 if name == "auto" else getattr(torch, name) for name in DTYPES}


def resolve_kv_cache_dtype(cfg: EngineConfig, dtype: torch.dtype) -> KVElement:
    """The KV cache's element type: as configured, "auto" being the compute dtype; int8 / int4 are the
    quantized formats of `kernels/kv_quant.py`.

    Not float16 by default (llama.cpp's choice): with the native kernels every K/V type gives the same
    logits bits cached or recomputed (tests/kv_cache/test_kv_cache_dtype.py, tests/engine/test_exact_kv_quant.py),
    but a narrower one moves them away from the float32 model's (scripts/kv_dtype_deviation.py measures by
    how much), so "auto" keeps the compute dtype. It is a flag: `--kv-cache-dtype float16`."""
    if cfg.kv_cache_dtype == "auto":
        return dtype
    name = cfg.kv_cache_dtype_name
    return FORMATS[name] if name in FORMATS else _TORCH_DTYPES[name]


class Engine:
    def __init__(self, model: str | os.PathLike = "smollm2-135m", config: EngineConfig | None = None,
                 quiet: bool = False) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's freed activations stay mapped for the next (loader/heap.py)
        self.dtype = _TORCH_DTYPES[cfg.dtype]
        self.kv_cache_dtype = resolve_kv_cache_dtype(cfg, self.dtype)
        self.model_path: Path = resolve_model(str(model), quiet=quiet)
        # --dtype auto on CPU: weights computed on in their stored block formats (kvlm.kernels);
        # an explicit dtype (and any GPU) dequantizes them at load: the dense reference path.
        self.quantized = cfg.dtype == "auto" and self.device.type == "cpu"
        loaded = load_model(self.model_path, cfg.max_model_len, self.dtype, self.device, quantized=self.quantized)
        self.model, self.tokenizer, self.max_model_len = loaded.model, loaded.tokenizer, loaded.max_model_len
        self.model_config: ModelConfig = loaded.config
        model_config = loaded.config
        if isinstance(self.kv_cache_dtype, KVQuantFormat) and model_config.head_dim % GROUP:
            raise ParameterError("kv_cache_dtype", f"kv_cache_dtype {self.kv_cache_dtype} needs head_dim % {GROUP} "
                                                   f"== 0; this model's is {model_config.head_dim}: use float16")

        # int8 / int4: keys stored centered on the model's mean key (kv_cache/k_center.py), one prefill at load
        self.k_center = (calibrate_k_center(self.model, model_config.vocab_size, self.max_model_len,
                                            in_place=loaded.backend.in_place)
                         if isinstance(self.kv_cache_dtype, KVQuantFormat) else None)
        self.kv_cache: KVCache
        self.kv_format = kv_format(self.kv_cache_dtype, self.k_center)  # how K/V are stored (kv_cache/spec.py)
        self.kv_cache, self.block_manager, groups = make_kv_cache(cfg, model_config, self.max_model_len,
                                                                  self.kv_format, self.device, compute_dtype=self.dtype)
        self.kv_bytes = KVBytes(self.kv_cache, model_config, self.kv_format, self.block_manager.block_size)
        history = None
        if self.block_manager.enable_prefix_caching:
            keys = self._prefix_hash_keys()
            for bm in [self.block_manager, *groups]:  # one chain: groups share the hashes
                bm.set_extra_keys(keys)
            history = PrefixHistory(cfg.block_size, describe=self.tokenizer.decode)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   recompute_all=not cfg.enable_kv_cache, prefix_history=history, groups=groups)
        # The disk tier under the prefix cache (kv_cache/tier.py, tier_pool.py); None: off
        self.tier: PoolTier | None = None
        if cfg.kv_tier_dir is not None:  # refused (ParameterError) where the tier cannot work: tier_pool.py
            self.tier = make_pool_tier(cfg, self.block_manager, self.kv_cache, bool(groups), self.kv_bytes_per_token,
                                       self._snapshot_header(), self.model_config.vocab_size)
        if history is not None and self.tier is not None:
            history.tier = True
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, loaded.backend, self.tokenizer.eos_token_ids)
        self.backend = self.runner.backend  # the kernels this engine runs on, and why (kernels/backend.py)
        # which kernels and why: at DEBUG (-v; `kvlm info` and `kvlm serve`'s ready line show it), a warning
        # when the native kernels are here but this model's attention cannot use them exactly
        (log.warning if self.backend.degraded else log.debug)("kvlm: %s", self.backend.describe())
        # Embeddings: this model's default pooling and the `dimensions` it supports (engine/pooling.py)
        self.pooling = ModelPooling.of(self.model_path, model_config.hidden_size, cfg.pooling)
        self.output_processor = OutputProcessor(self.tokenizer.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}  # live requests by id, for abort()
        # structured_outputs: compiled in a worker thread, cached per grammar (nothing built until first use)
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size)
        # Validation, prompt -> Request; a bad engine-wide --max-kv-tokens fails here, at start, not per request
        windows = [bm.spec.window for bm in groups if bm.spec.window is not None]  # the sliding groups'
        self.input_processor = InputProcessor(cfg, self.tokenizer, model_config.vocab_size, self.max_model_len,
                                              self.block_manager, windows, self.grammars, self.device)
        self.num_steps = 0
        self.loras = LoRARegistry()  # LoRA adapters by name (kvlm/lora), applied per row, never merged
        # Speculative decoding (engine/speculator.py): drafts proposed before each step, verified in it
        spec = cfg.speculative_config
        if spec is not None and not cfg.enable_kv_cache:
            raise ParameterError("speculative_config", "speculative decoding needs the KV cache (no --no-kv-cache)")
        self.speculator: Speculator | None = None
        self.draft_engine: Engine | None = None  # method draft: the draft model's own engine
        if spec is not None:
            assert isinstance(spec, SpeculativeConfig)
            proposer = self._draft_proposer(spec.model) if spec.method == "draft" else None
            self.speculator = Speculator(spec, self.max_model_len, proposer)
        # Fewer threads while other processes hold cores (engine/threads.py); the count never changes bits.
        self.governor = (ThreadGovernor(torch.get_num_threads()) if cfg.adaptive_threads and self.device.type == "cpu"
                         else None)
        # The last step's plan and result, kept for inspection (`kvlm bench latency`'s breakdown reads its
        # logits; tests read which tokens each step ran). Two references per step; nothing is copied.
        self.last_batch: ScheduledBatch | None = None
        self.last_result: StepResult | None = None
        trim_heap()  # the load's freed temporaries (tokenizer parse, GGUF walk) off the resident set
        log.debug(self.describe_cache())  # a sizing detail: shown at DEBUG (the CLI's -v; `kvlm info` has it too)

    # -- setup -------------------------------------------------------------------------------------
    def _draft_proposer(self, model: str | None) -> DraftModelProposer:
        """Speculative method draft: a second engine for the draft model, its own weights and KV pool
        (engine/draft_model.py); refused with one line if its tokenizer is not the target's."""
        try:
            self.draft_engine = Engine(str(model), draft_config(self.config, str(self.device)), quiet=True)
        except KvlmError as e:  # (not found, unsupported, a bad setting for it): named as the draft's
            raise ParameterError("speculative_config", f"draft model: {e}") from e
        draft = self.draft_engine
        why = tokenizer_mismatch(self.tokenizer, draft.tokenizer)
        if why is not None:
            raise ParameterError("speculative_config", f"draft model {draft.model_path.name} does not share the "
                                                       f"target's tokenizer: {why}")
        return DraftModelProposer(draft.scheduler.kv, draft.runner, draft.max_model_len,
                                  min(self.model_config.vocab_size, draft.model_config.vocab_size),
                                  self.config.max_num_batched_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes per token, counted from the pool's tensors (`KVBytes`)."""
        return self.kv_bytes.per_token

    @property
    def max_kv_tokens(self) -> int | None:
        """The engine-wide bounded cache's budget (`--max-kv-tokens`; None: unbounded)."""
        return self.config.max_kv_tokens

    def _prefix_hash_keys(self) -> str:
        """Everything besides token ids that changes K/V: the root of the prefix cache's hash chain."""
        files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in model_files(self.model_path)]
        return json.dumps({"model": files, "config": dataclasses.asdict(self.model_config), "dtype": self.config.dtype,
                           "kv_dtype": str(self.kv_cache_dtype), "kv_layout": self.config.kv_cache_layout,
                           "k_center": center_digest(self.k_center),
                           "block_size": self.config.block_size})

    def _prefetch_tier(self) -> None:
        """Before admission: the requests about to be admitted load what the tier has past their pool hit."""
        assert self.tier is not None
        seats = self.config.max_num_seqs - len(self.scheduler.running)
        for req in self.scheduler.waiting:
            if seats <= 0:
                break
            if not req.grammar_ready or req.pooling is not None:
                continue
            seats -= 1
            loaded = self.tier.prefetch(req)
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_tier_tokens += loaded

    def flush_kv_tier(self) -> None:
        """Wait until the tier's writer has stored every block handed to it (before a restart, in tests)."""
        if self.tier is not None:
            self.tier.tier.flush()

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """sha256 over the model's files (for KV snapshots; computed on first use, cached on disk)."""
        return model_fingerprint(self.model_path)

    def describe_cache(self) -> str:
        return describe_kv_pool(self.config, self.kv_cache, self.block_manager, self.max_model_len,
                                self.kv_bytes_per_token)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, lora: str | None = None) -> Request:
        """Queue a prompt (text or token ids), validated first (`InputProcessor`: `ParameterError` with the
        field's `.param`). Its leading full blocks already in the prefix cache (an earlier request's, a
        chat's previous turns, a loaded snapshot) are reused at admission. With `PoolingParams` it is an
        embedding (engine/pooling.py): prefilled, pooled, finished in the step that completes its prompt
        (its vector on the final delta and `Request.embedding`). `lora`: the name of a loaded adapter
        (`load_lora`) the request runs under (`UnknownLoRAError` if there is none by that name)."""
        adapter = None if lora is None else self.loras.get(lora)
        if isinstance(params, PoolingParams):
            req = self.input_processor.process(prompt, None, request_id, in_use=self.requests,
                                               pooling=self.pooling.resolve(params))
        else:
            req = self.input_processor.process(prompt, params, request_id, in_use=self.requests)
        req.lora = adapter
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return False
        self.output_processor.abort(req)
        self._finish(req, time.perf_counter())
        return True

    def _finish(self, req: Request, now: float) -> None:
        """`req` has its finish reason: free its blocks and forget it."""
        if self.tier is not None:
            self.tier.write_through(req)  # (before its blocks are released: no-op unless write-through is on)
        self.scheduler.finish(req)
        if self.speculator is not None:
            self.speculator.finish(req)
        req.metrics.finished_time = now
        self.requests.pop(req.request_id, None)

    # -- LoRA adapters -----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | os.PathLike, scale: float = 1.0) -> LoRAAdapter:
        """Load a LoRA adapter (a PEFT folder or a GGUF LoRA file) under `name`, for requests that name it.
        The base model is untouched: adapters are applied per row at run time (kvlm/lora). `LoRAError`
        (one line) when the file is missing or its rank or targets do not fit the base, or the name is taken."""
        self.loras.check_new(name)
        if type(self.model) is not LlamaForCausalLM or self.device.type != "cpu":
            raise LoRAError(f"LoRA adapter {name!r}: adapters are served for the Llama family on the CPU only")
        if self.model_config.num_experts:
            raise LoRAError(f"LoRA adapter {name!r}: adapters on mixture-of-experts models are not served yet")
        return self.loras.add(load_lora(name, path, self.model_config, self.loras.next_id(), scale))

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (`UnknownLoRAError` if none): new requests cannot name it; running ones finish."""
        adapter = self.loras.remove(name)
        if self.runner.fused is not None:
            self.runner.fused.forget_lora(adapter.id)

    # -- prefix cache ------------------------------------------------------------------------------
    def save_prefix(self, token_ids: list[int], path: str | os.PathLike, lora: str | None = None) -> SnapshotInfo:
        """Write the K/V of `token_ids`' full blocks to a safetensors snapshot (computing them if needed),
        under the loaded adapter named `lora` (None: the base); the file records the adapter's name and key."""
        adapter = None if lora is None else self.loras.get(lora)
        groups = self.scheduler.groups
        nblk = len(token_ids) // self.block_manager.block_size
        if nblk and not prefix_cached(self.block_manager, token_ids, groups, adapter):
            req = self.add_request(list(token_ids), SamplingParams(temperature=0, max_tokens=1), lora=lora)
            while not req.is_finished:
                self.step()
        return kv_snapshot.save_prefix(self.block_manager, self.kv_cache, self._snapshot_header(adapter), token_ids,
                                       path, groups, adapter)

    def load_prefix(self, path: str | os.PathLike) -> SnapshotInfo:
        """Load a snapshot into the prefix cache; `SnapshotError` (engine unchanged) if it does not fit. A
        snapshot saved under an adapter loads only while an adapter of the same weights and scale is loaded
        (any name), and its blocks then serve that adapter's requests."""
        ident = kv_snapshot.snapshot_lora(path)
        adapter = None
        if ident is not None:
            adapter = next((a for a in self.loras.adapters.values() if a.key == ident["key"]), None)
            if adapter is None:
                same = self.loras.adapters.get(ident["name"])
                raise SnapshotError(f"{path}: snapshot was saved under LoRA adapter {ident['name']!r} ("
                                    f"{ident['key'][:12]}), " + ("which is not loaded" if same is None else
                                    f"and the adapter loaded as {ident['name']!r} here differs ({same.key[:12]})"))
        return kv_snapshot.load_prefix(self.block_manager, self.kv_cache, self._snapshot_header(adapter), path,
                                       vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                                       groups=self.scheduler.groups, lora=adapter)

    def _snapshot_header(self, lora: LoRAAdapter | None = None) -> dict[str, str]:
        mc = self.model_config
        return snapshot_header(self.model_fingerprint, self.config.dtype, self.kv_cache_dtype,
                               self.block_manager.block_size, mc.num_hidden_layers, mc.num_key_value_heads,
                               mc.head_dim, getattr(self.kv_cache, "layer_group", None), center_digest(self.k_center),
                               lora)

    def prompt_logits(self, token_ids: list[int], first: int, max_kv_tokens: int | None = None,
                      sink_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Teacher-forced logits of `token_ids` from position `first` on, a chunk at a time (`scoring.py`)."""
        return scoring.prompt_logits(self, token_ids, first, max_kv_tokens, sink_tokens)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody reads now; returns how many."""
        return self.block_manager.reset_prefix_cache()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ----------------------------------------------------------------------------------
    def step(self, keep_logits: bool = False) -> list[StreamDelta]:
        """Schedule -> execute -> update. Returns one delta per request that produced a token.

        keep_logits: attach this step's logits to `self.last_result` (tests and benchmarks).
        """
        if self.governor is not None:
            self.governor.tick()
        failed = self._refuse_failed_grammars()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        if self.tier is not None and self.scheduler.waiting:
            self._prefetch_tier()
        batch = self.scheduler.schedule()
        if batch.is_empty:  # nothing can run: wait briefly for a grammar still compiling, if any
            if not self.input_processor.wait_for_grammars(self.scheduler.waiting) and self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests waiting")  # admission forbids it
            return failed
        result = self.runner.execute(batch, keep_logits=keep_logits)
        self.last_batch, self.last_result = batch, result
        self.num_steps += 1
        return failed + self._update(batch.requests, batch.num_new_tokens, result)

    def _refuse_failed_grammars(self) -> list[StreamDelta]:
        """Finish ("abort", the compile error as stop reason) queued requests whose grammar failed to
        compile after `add_request` (`InputProcessor.failed_grammars`)."""
        now, deltas = time.perf_counter(), []
        for req in self.input_processor.failed_grammars(self.scheduler.waiting):
            deltas.append(self.output_processor.abort(req, str(req.grammar.error)))  # type: ignore[union-attr]
            self._finish(req, now)
        return deltas

    def _update(self, reqs: list[Request], num_new: list[int], result: StepResult) -> list[StreamDelta]:
        now = time.perf_counter()
        bm = self.block_manager
        pooled = []
        for req, n in zip(reqs, num_new):
            m = req.metrics
            start = req.num_computed_tokens
            m.num_prefilled_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
            m.num_computed_tokens += n
            req.num_computed_tokens += n - len(req.draft_token_ids)  # drafts count once accepted (_emit)
            if req.pooling is None:  # (an embedding's blocks are not kept: engine/pooling.py)
                self.scheduler.cache_full_blocks(req)  # newly full blocks become reusable (every layer group)
            elif req.embedding is not None:
                pooled.append(req)
            held = held_blocks(req)
            m.blocks_held = len(held)
            if bm.enable_prefix_caching:
                m.blocks_shared = sum(1 for b in held if bm.ref_counts[b] > 1)
            m.kv_bytes_held, m.kv_bytes_used = self.kv_bytes.of_request(req)
            if not self.config.enable_kv_cache:
                req.num_computed_tokens = 0  # nothing is kept: the next step recomputes everything
        deltas = []
        for req in pooled:  # its prompt is complete: done, and its blocks free for this very next step
            req.finish_reason = "stop"
            self._finish(req, now)
            deltas.append(StreamDelta(req.request_id, "", [], True, "stop", embedding=req.embedding.tolist()))
        i, rows = 0, result.requests
        while i < len(rows):
            req = rows[i]
            k = len(req.draft_token_ids)  # a request verifying k drafts has k + 1 rows here
            deltas += self._emit(req, result.token_ids[i : i + k + 1], result.logprobs[i : i + k + 1], now)
            i += k + 1
        return deltas

    def _emit(self, req: Request, tokens: list[int], logprobs: list[dict[int, float] | None],
              now: float) -> list[StreamDelta]:
        """Append `req`'s new tokens: its one sampled token, or with drafts the accepted ones and the target's
        token after them (`Speculator.verify`), each a delta, none past a stop."""
        keep = 1
        if len(tokens) > 1:
            keep = self.speculator.verify(req, tokens) + 1  # type: ignore[union-attr]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        deltas = []
        for tok, lp in zip(tokens[:keep], logprobs[:keep]):
            deltas.append(self.output_processor.append_token(req, tok, lp))
            if req.finish_reason is not None:
                self._finish(req, now)
                return deltas
        if len(tokens) > 1:
            req.num_computed_tokens += keep - 1  # the accepted drafts' K/V are theirs; the rest is given back
            req.draft_token_ids = []
            self.scheduler.keep_computed(req)
        return deltas

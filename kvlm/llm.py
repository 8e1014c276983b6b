"""`LLM`: the offline Python API, shaped like vLLM's (`LLM(model).generate(prompts, params)`).

A thin loop over `Engine.add_request()` and `Engine.step()`: it knows nothing about caches or batching.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Union

from kvlm.config import EngineConfig
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError
from kvlm.exactness import ExactReport, first_difference
from kvlm.kv_cache.snapshot import SnapshotInfo
from kvlm.lora import LoRARequest
from kvlm.outputs import EmbeddingRequestOutput, RequestOutput, StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import PoolingParams, SamplingParams
from kvlm.structured.tool_parser import parse_tool_calls
from kvlm.structured.tools import call_grammar, chat_inputs, check_tools, tool_format_for, tool_mode

PromptType = Union[str, dict[str, Any]]  # "text" or {"prompt_token_ids": [...]} / {"prompt": "text"}
LoRAName = Union[str, LoRARequest, None]  # an adapter by name, vLLM's LoRARequest, or None: the base
Message = dict[str, Any]  # {"role", "content"} plus, for tool calling, "tool_calls" / "tool_call_id"


def _prompt_input(p: PromptType) -> str | list[int]:
    """One prompt as the engine takes it; anything else is a `ParameterError` naming the field."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ParameterError("prompt_token_ids", f"prompt_token_ids must be a list of integers, "
                                                     f"got {type(ids).__name__}")
        return list(ids)  # the engine checks each id against the vocabulary
    if isinstance(p, dict) and "prompt" in p:
        if not isinstance(p["prompt"], str):
            raise ParameterError("prompt", f"prompt must be a string, got {type(p['prompt']).__name__}")
        return p["prompt"]
    raise ParameterError("prompts", "prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', "
                                    f"or a list of them; got {type(p).__name__}")


class LLM:
    """Load a model (alias, .gguf file or HF folder) and generate from it.

    Keyword arguments are `EngineConfig` fields (dtype, device, enable_kv_cache, max_model_len,
    kv_cache_layout, block_size, max_num_seqs, max_num_batched_tokens, kv_cache_memory, num_threads,
    enable_prefix_caching, speculative_config={"method": "ngram" | "suffix" | "draft", "num_speculative_tokens": k,
    "model": DRAFT_PATH (method draft only)}).
    """

    def __init__(self, model: str | os.PathLike = "smollm2-135m", quiet: bool = True, **engine_kwargs: Any) -> None:
        self.llm_engine = Engine(model, EngineConfig(**engine_kwargs), quiet=quiet)
        self.tokenizer = self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora: LoRAName | Sequence[LoRAName] = None) -> list[RequestOutput]:
        """Generate for every prompt (batched by the engine); outputs in input order. `lora`: the adapter
        every prompt (or, as a list, each prompt) runs under: a loaded adapter's name (`load_lora`), vLLM's
        `LoRARequest(name, id, path)` (loaded on first use), or None for the base model."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ParameterError("prompts", "prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', "
                                            f"or a list of them; got {type(prompts).__name__}")
        prompts = [_prompt_input(p) for p in prompts]  # check them all before any is queued
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        for sp in params_list:  # a bad schema or regex is a ParameterError now, before anything is queued
            if sp is not None and sp.structured_outputs is not None:
                self.llm_engine.grammars.compile(sp.structured_outputs)
        if lora is None or isinstance(lora, (str, LoRARequest)):
            loras = [self._lora_name(lora)] * len(prompts)
        else:
            loras = [self._lora_name(a) for a in lora]
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA adapters for {len(prompts)} prompts")
        reqs = self._add_all(prompts, params_list, use_tqdm and sys.stderr.isatty() and len(prompts) > 1, loras)
        return [RequestOutput.from_request(r) for r in reqs]

    def load_lora(self, name: str, path: str | os.PathLike, scale: float = 1.0) -> None:
        """Load a LoRA adapter (PEFT folder or GGUF LoRA file) for requests that name it (`Engine.load_lora`)."""
        self.llm_engine.load_lora(name, path, scale)

    def _lora_name(self, lora: LoRAName) -> str | None:
        if isinstance(lora, LoRARequest):
            if lora.lora_name not in self.llm_engine.loras and lora.lora_path:
                self.llm_engine.load_lora(lora.lora_name, lora.lora_path)
            return lora.lora_name
        return lora

    def embed(self, prompts: PromptType | list[int] | Sequence[PromptType | list[int]], pooling: str | None = None,
              normalize: bool = True, dimensions: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (`.outputs.embedding`, vLLM's shape): texts, token-id lists or prompt dicts,
        prefilled by the engine in one batch and pooled from the final-norm hidden states (engine/pooling.py);
        no token is sampled and no KV block is kept. pooling: "last", "mean" or "cls" (None: the model's
        default, `engine.pooling`); normalize: unit L2 norm; dimensions: Matryoshka models only. A text's
        vector has the same bits alone or in any batch."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence):
            raise ParameterError("prompts", "prompts must be a string, a list of token ids, or a list of them; "
                                            f"got {type(prompts).__name__}")
        inputs = [list(p) if isinstance(p, (list, tuple)) else _prompt_input(p) for p in prompts]
        params = PoolingParams(pooling, normalize, dimensions)
        reqs = self._add_all(inputs, [params] * len(inputs), use_tqdm and sys.stderr.isatty() and len(inputs) > 1)
        return [EmbeddingRequestOutput.from_request(r) for r in reqs]

    def _add_all(self, prompts: list[str | list[int]], params: Sequence[SamplingParams | PoolingParams | None],
                 progress: bool = False, loras: Sequence[str | None] | None = None) -> list[Request]:
        """Queue every prompt and step until all are finished; on any error, abort them all."""
        eng = self.llm_engine
        reqs: list[Request] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                reqs.append(eng.add_request(p, sp, lora=None if loras is None else loras[i]))
            self._run(reqs, progress)
        except BaseException:
            for r in reqs:
                eng.abort(r.request_id)
            raise
        return reqs

    def _run(self, reqs: list[Request], progress: bool) -> None:
        from tqdm import tqdm

        eng = self.llm_engine
        with tqdm(total=len(reqs), desc="generating", unit="req", disable=not progress) as bar:
            while any(not r.is_finished for r in reqs):
                for d in eng.step():
                    if d.finished:
                        bar.update(1)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        tools (OpenAI's `[{"type": "function", "function": {name, description, parameters}}]`) and
        tool_choice ("auto", the default; "required"; "none"; {"type": "function", "function": {"name": N}})
        work as on the server: the tools go into the prompt, the output is constrained to a valid call
        (from the first token for required/named; once the model opens a call for auto), and the calls come
        back parsed on `outputs[0].tool_calls` (arguments as a JSON string). Messages may hold earlier calls
        (assistant `tool_calls`, content None) and results (role "tool")."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        functions, constraint = None, None
        if tools is not None:
            functions = check_tools(tools)
            mode, name = tool_mode(tool_choice, functions)
            fmt = tool_format_for(self.tokenizer.chat_template)
            constraint = call_grammar(functions, mode, fmt, parallel_tool_calls, name)
            functions = functions if mode != "none" else None
        prompts = [self.render_chat(c, add_generation_prompt, functions) for c in convs]  # type: ignore[arg-type]
        if constraint is not None:
            base = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
            sampling_params = [dataclasses.replace(p or SamplingParams(), structured_outputs=constraint) for p in base]
        outs = self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)
        if functions:
            for o in outs:
                _, calls = parse_tool_calls(o.outputs[0].text)
                o.outputs[0].tool_calls = (calls if parallel_tool_calls else calls[:1]) or None
        return outs

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation; `tools` are function specs ({name, description, parameters})."""
        msgs, kwargs = chat_inputs(list(messages), tools, self.tokenizer.chat_template)
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               lora: LoRAName = None) -> Iterator[StreamDelta]:
        """Yield text and token ids as they are generated (UTF-8 safe, stop strings never partial).

        The finished `Request` (with metrics) is available as `self.last_request` afterwards. A chat turn
        reuses every earlier turn's K/V through the prefix cache: nothing needs to be kept by hand.
        """
        eng = self.llm_engine
        if sampling_params is not None and sampling_params.structured_outputs is not None:
            eng.grammars.compile(sampling_params.structured_outputs)  # a bad grammar raises here, as in generate
        req = eng.add_request(_prompt_input(prompt), sampling_params, lora=self._lora_name(lora))
        self.last_request = req
        try:
            while not req.is_finished:
                for d in eng.step():
                    if d.request_id == req.request_id:
                        yield d
        finally:
            if not req.is_finished:  # the consumer stopped early (or raised): free the request
                eng.abort(req.request_id)

    def check_exact(self, prompts: PromptType | Sequence[PromptType], params: SamplingParams | None = None,
                    others: Sequence[PromptType] = ()) -> ExactReport:
        """Run `prompts` along several paths and report the first token whose id or logprobs differ.

        The reference is each prompt alone on this engine (prefix cache emptied first, so nothing is
        reused). Compared against it, bit for bit: all prompts together inside a batch with `others`
        (default: three unrelated prompts, so steps mix prefill chunks and decodes), and each prompt alone
        on a second engine with the same configuration but no KV cache (every step recomputes). Greedy, or
        seeded sampling: a path's tokens then depend only on its logits. Logprobs (top 5 at least) are
        compared too, as floats with `==`."""
        base = params or SamplingParams()
        if base.temperature > 0 and base.seed is None:
            raise ParameterError("seed", "check_exact needs greedy sampling or a seed: unseeded samples differ")
        sp = dataclasses.replace(base, logprobs=max(base.logprobs or 0, 5))
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        eng = self.llm_engine

        def alone(llm: LLM) -> list[RequestOutput]:
            outs = []
            for p in items:
                llm.llm_engine.reset_prefix_cache()
                outs += llm.generate([p], sp, use_tqdm=False)
            return outs

        ref = alone(self)
        fill = list(others) or [{"prompt_token_ids": [(7 * j + 3 * i) % 200 + 10 for j in range(9 + 23 * i)]}
                                for i in range(3)]
        eng.reset_prefix_cache()
        batch = self.generate(fill[:1] + items + fill[1:], [SamplingParams(temperature=0, max_tokens=sp.max_tokens,
                                                                           ignore_eos=True)]
                              + [sp] * len(items) + [SamplingParams(temperature=0, max_tokens=9)] * (len(fill) - 1),
                              use_tqdm=False)[1 : 1 + len(items)]
        cfg = dataclasses.asdict(eng.config)
        # the reference recomputes every step and never speculates (drafts need a KV cache to verify against)
        recompute = LLM(eng.model_path, quiet=True, **{**cfg, "enable_kv_cache": False, "speculative_config": None})
        runs = {"inside a batch": batch, "no KV cache": alone(recompute)}
        n = sum(len(o.outputs[0].token_ids) for o in ref)
        for path, outs in runs.items():
            d = first_difference(path, ref, outs)
            if d is not None:
                return ExactReport(tuple(runs), n, d)
        return ExactReport(tuple(runs), n, None)

    def save_prefix(self, prompt: PromptType, path: str | os.PathLike, lora: str | None = None) -> SnapshotInfo:
        """Save the K/V of `prompt`'s full blocks to a safetensors file (see `kvlm.kv_cache.snapshot`), computed
        under the loaded LoRA adapter named `lora` (None: the base); the file records the adapter."""
        p = _prompt_input(prompt)
        ids = self.tokenizer.encode(p) if isinstance(p, str) else p
        return self.llm_engine.save_prefix(ids, path, lora)

    def load_prefix(self, path: str | os.PathLike) -> SnapshotInfo:
        """Load a saved prefix into the prefix cache: the next prompt starting with it skips its prefill.
        Raises `SnapshotError` (and changes nothing) for another model, dtype, block size or a bad file."""
        return self.llm_engine.load_prefix(path)

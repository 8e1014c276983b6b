"""`kvlm generate [MODEL] PROMPT`: one prompt streamed to stdout, one JSON document, or a file of prompts.

The prompt is the PROMPT word, or a whole document: `-f FILE`, `-` (stdin), or stdin when no PROMPT is
given and stdin is not a terminal (`cat notes.txt | kvlm generate`); `--prompts-file` is one prompt a line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvlm.args import add_engine_args, add_sampling_args, engine_kwargs_from_args, sampling_params_from_args
from kvlm.cli.loading import loading
from kvlm.cli.lora import add_lora_flag, load_lora_flags
from kvlm.cli.snapshot import add_prefix_snapshot_flag, load_prefix_snapshot
from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    s.add_argument("inputs", nargs="*", metavar="[MODEL] PROMPT",
                   help="model alias or path (default smollm2-135m when only PROMPT is given), then the prompt; "
                        "PROMPT - (or none, with stdin not a terminal) reads the whole of stdin as the prompt")
    s.add_argument("-f", "--prompt-file", metavar="FILE",
                   help="the whole file is the prompt, newlines and all (default: none)")
    s.add_argument("--prompts-file",
                   help="one prompt per line, or JSONL with 'prompt' or 'prompt_token_ids' (default: none)")
    s.add_argument("--chat", action="store_true", help="apply the model's chat template")
    s.add_argument("--system", default=None, help="system message (with --chat; default: none)")
    s.add_argument("--stats", action="store_true", help="print generation stats on stderr")
    s.add_argument("--json", action="store_true", help="print one JSON document instead of streaming")
    s.add_argument("--check-exact", action="store_true",
                   help="run the prompt(s) alone, inside a batch with other prompts and without the KV cache, and "
                        "say whether every token and logprob is bit-identical (else the first step and path that "
                        "differ); exit 1 if not")
    g = s.add_argument_group("structured output (one of)")
    g.add_argument("--json-schema", metavar="FILE|JSON", help="output must be JSON valid against this schema "
                   "(a file, or the schema itself; compact JSON; default: none)")
    g.add_argument("--regex", help="output must match this regular expression (default: none)")
    g.add_argument("--choice", action="append", metavar="TEXT",
                   help="output must be one of these (repeat the flag; default: none)")
    g.add_argument("--grammar", metavar="FILE", help="output must follow this Lark or GBNF grammar (default: none)")
    add_prefix_snapshot_flag(s)
    add_lora_flag(s, "the prompt runs under it (at most one)")
    add_sampling_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_generate)



def _format_stats(m: dict[str, Any]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    tier = f" ({m['tier_tokens']} from the KV tier)" if m.get("tier_tokens") else ""
    line = (f"prompt tokens {m['prompt_tokens']} (cached {m['cached_tokens']}{tier}, "
            f"computed {m['prefilled_tokens']}), "
            f"generated {m['generated_tokens']}, "
            f"TTFT {f(m['ttft_s'], '.3f')} s, decode {f(m['decode_tokens_per_s'], '.1f')} tok/s, "
            f"KV held {m['kv_bytes_held'] / 2**20:.2f} MiB in {m['kv_blocks_held']} blocks "
            f"({m['kv_blocks_shared']} shared)")
    if "spec_draft_tokens" in m:  # speculative decoding: drafts verified and accepted
        line += f", drafts accepted {m['spec_accepted_tokens']}/{m['spec_draft_tokens']}"
    return line + (f"; prefix cache: {m['prefix_cache_miss']}" if m.get("prefix_cache_miss") else "")


def _looks_like_model(arg: str) -> bool:
    """A model path or alias, not a prompt: one word naming a model file, a folder, a path or an alias."""
    from kvlm.loader.registry import MODELS

    if not arg or any(c.isspace() for c in arg):
        return False
    return (arg in MODELS or arg.endswith((".gguf", ".safetensors")) or "/" in arg or os.sep in arg
            or Path(arg).expanduser().exists())


def _model_and_prompt(a: argparse.Namespace) -> tuple[str, str | None]:
    """`generate [MODEL] PROMPT`: one positional list (so options may sit anywhere), split here; the prompt
    comes from PROMPT, -f FILE, `-` or a piped stdin (None: --prompts-file gives the prompts)."""
    from kvlm.loader.registry import DEFAULT_MODEL

    inputs = list(a.inputs)
    sources = [f for f, v in (("--prompts-file", a.prompts_file), ("--prompt-file", a.prompt_file)) if v]
    if len(sources) > 1:
        raise ParameterError("prompt", "give --prompt-file (one prompt) or --prompts-file (one a line), not both")
    if sources:
        if len(inputs) > 1 or (inputs and (inputs[0] == "-" or not _looks_like_model(inputs[0]))):
            raise ParameterError("prompt", f"give either PROMPT or {sources[0]}, not both")
        model = inputs[0] if inputs else DEFAULT_MODEL
        return model, (None if a.prompts_file else _read_prompt(a.prompt_file, "--prompt-file"))
    if len(inputs) > 2:
        raise ParameterError("prompt", f"expected [MODEL] PROMPT, got {len(inputs)} positional arguments "
                                       "(quote a prompt of several words)")
    if inputs[-1:] == ["-"]:
        return (inputs[0] if len(inputs) == 2 else DEFAULT_MODEL), _read_prompt(None, "-")
    if len(inputs) == 2:
        return inputs[0], inputs[1]
    if inputs and not _looks_like_model(inputs[0]):
        return DEFAULT_MODEL, inputs[0]
    model = inputs[0] if inputs else DEFAULT_MODEL
    piped = "" if sys.stdin is None or sys.stdin.isatty() else _read_prompt(None, "stdin")
    if piped:
        return model, piped
    if inputs:
        raise ParameterError("prompt", f"no PROMPT after the model {inputs[0]!r} (give one after it, -f FILE, "
                                       "pipe it on stdin, or use --prompts-file)")
    raise ParameterError("prompt", "give a PROMPT (or -f FILE, a prompt piped on stdin, or --prompts-file)")


def _read_prompt(path: str | None, what: str) -> str:
    """A whole file (None: stdin) as one prompt, UTF-8."""
    try:
        data = sys.stdin.buffer.read() if path is None else Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ParameterError("prompt", f"{what}: cannot read {e.filename or 'stdin'}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParameterError("prompt", f"{what}: not UTF-8 text (byte {e.start})") from None
    if not text and path is not None:
        raise ParameterError("prompt", f"{what}: {path} is empty")
    return text


def _structured(a: argparse.Namespace) -> StructuredOutputsParams | None:
    """--json-schema / --regex / --choice / --grammar as one constraint (ParameterError names the flag)."""
    given = [f for f, v in (("--json-schema", a.json_schema), ("--regex", a.regex), ("--choice", a.choice),
                            ("--grammar", a.grammar)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ParameterError(given[1], f"give one of --json-schema, --regex, --choice, --grammar; got {given}")
    try:
        if a.json_schema is not None:
            path = Path(a.json_schema).expanduser()
            text = path.read_text(encoding="utf-8") if not a.json_schema.lstrip().startswith("{") else a.json_schema
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ParameterError("--json-schema", f"--json-schema: not a JSON schema ({e.msg})") from None
            return StructuredOutputsParams(json=schema)
        if a.grammar is not None:
            return StructuredOutputsParams(grammar=Path(a.grammar).expanduser().read_text(encoding="utf-8"))
        if a.regex is not None:
            return StructuredOutputsParams(regex=a.regex)
        return StructuredOutputsParams(choice=a.choice)
    except OSError as e:
        flag = given[0]
        raise ParameterError(flag, f"{flag}: cannot read {e.filename}: {e.strerror}") from None
    except ParameterError as e:
        raise ParameterError(given[0], str(e).replace("structured_outputs", given[0], 1)) from None


def cmd_generate(a: argparse.Namespace) -> int:
    a.model, a.prompt = _model_and_prompt(a)
    params = sampling_params_from_args(a)
    structured = _structured(a)
    if structured is not None:
        flag = next(f for f in ("--json-schema", "--regex", "--choice", "--grammar")
                    if getattr(a, f[2:].replace("-", "_")) is not None)
        try:
            params = dataclasses.replace(params, structured_outputs=structured)
        except ParameterError as e:  # "structured_outputs cannot be combined with min_tokens or ignore_eos"
            raise ParameterError(flag, str(e).replace("structured_outputs", flag, 1)
                                 .replace("min_tokens or ignore_eos", "--ignore-eos")) from None
    with loading(a.freeze_after_load):
        from kvlm.llm import LLM

        llm = LLM(a.model, quiet=a.quiet, **engine_kwargs_from_args(a))
    load_prefix_snapshot(llm.llm_engine, a.prefix_snapshot, a.quiet)
    if len(a.lora) > 1:
        raise ParameterError("--lora", "kvlm generate runs one adapter: give --lora once")
    if a.lora and a.check_exact:
        raise ParameterError("--lora", "--check-exact does not take --lora (tests/lora checks adapters' exactness)")
    lora = (load_lora_flags(llm.llm_engine, a.lora, a.quiet) or [None])[0]
    if structured is not None:  # a bad schema or regex: one line naming the flag, before any output
        try:
            llm.llm_engine.grammars.compile(structured)
        except ParameterError as e:
            raise ParameterError(flag, str(e).replace("structured_outputs", flag, 1)) from None

    def as_input(text: str):
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": text}]
            return {"prompt_token_ids": llm.render_chat(msgs)}
        return text

    if a.check_exact:
        prompts = _file_prompts(a, as_input) if a.prompts_file else [as_input(a.prompt)]
        report = llm.check_exact(prompts, params)
        print(f"kvlm: {report}")
        return 0 if report.identical else 1
    if a.prompts_file:
        return _generate_batch(llm, a, params, as_input, lora)
    if a.json:
        out = llm.generate([as_input(a.prompt)], params, use_tqdm=False, lora=lora)[0]
        c = out.outputs[0]
        doc = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason, "prompt_token_ids": out.prompt_token_ids,
               "stats": out.metrics.as_dict()}
        if c.logprobs is not None:
            doc["logprobs"] = [{str(k): v for k, v in d.items()} for d in c.logprobs]
        print(json.dumps(doc, ensure_ascii=False))
        return 0
    for d in llm.stream(as_input(a.prompt), params, lora=lora):
        sys.stdout.write(d.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.stats:
        print("kvlm: " + _format_stats(llm.last_request.metrics.as_dict()), file=sys.stderr)
    return 0


def _file_prompts(a: argparse.Namespace, as_input: Any) -> list[Any]:
    """--prompts-file: one prompt per line, or JSONL with 'prompt' or 'prompt_token_ids'."""
    lines = [ln for ln in Path(a.prompts_file).read_text().splitlines() if ln.strip()]
    prompts = []
    for i, ln in enumerate(lines, 1):
        if ln.lstrip().startswith("{"):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ValueError(f"{a.prompts_file}:{i}: invalid JSON ({e.msg})") from None
            prompts.append(as_input(obj["prompt"]) if "prompt" in obj else obj)
        else:
            prompts.append(as_input(ln))
    return prompts


def _generate_batch(llm: Any, a: argparse.Namespace, params: Any, as_input: Any, lora: str | None) -> int:
    outs = llm.generate(_file_prompts(a, as_input), params, lora=lora)
    for o in outs:
        c = o.outputs[0]
        if a.json:
            print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                              "stats": o.metrics.as_dict()}, ensure_ascii=False))
        else:
            print(c.text.replace("\n", "\\n"))
    return 0

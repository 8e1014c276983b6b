"""The `kvlm` command line: pull, generate, chat, info, kv-size, bench.

Only a consumer of the library (`LLM`, `Engine`, `SamplingParams`). User mistakes (bad flags, unknown
models, broken files, prompts that do not fit) print one line on stderr and exit 2 (usage) or 1
(runtime); there is no traceback for them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from kvlm.cache_cli import add_prefix_snapshot_flag, load_prefix_snapshot
from kvlm.errors import KvlmError, ParameterError

_FREEZE_AFTER_LOAD = False  # set by run(): a `kvlm` process, not a caller of main()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Import torch and load the model with the cyclic garbage collector paused: those imports and the
    load create a million objects and no cyclic garbage, and the collector's passes over them cost
    ~0.15 s of every start. In a `kvlm` process everything alive then is frozen out of later
    collections too (`gc.freeze`), so decode steps never walk torch's objects."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _FREEZE_AFTER_LOAD:
            gc.freeze()
        if was:
            gc.enable()


class _Parser(argparse.ArgumentParser):
    """argparse with our error contract: one line `kvlm: error: ...` on stderr and exit 2 (no usage dump;
    `--help` still shows it). Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        print(f"kvlm: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


DTYPE_BYTES = {"float32": 4.0, "fp32": 4.0, "float16": 2.0, "fp16": 2.0, "bfloat16": 2.0, "bf16": 2.0,
               "int8": 1.0, "int4": 0.5}


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): GGUF weights computed on in their stored formats, float32 activations "
                        "and KV cache; float32/bfloat16/float16: dense weights (float32 is the exact reference)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    g.add_argument("--max-model-len", type=int, default=None, help="context length to allow (default min(model, 4096))")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step (same tokens, slower)")
    g.add_argument("--kv-cache-layout", default="paged", choices=["paged", "contiguous"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="K/V element type (auto: the compute dtype; float16 halves KV memory and attention reads)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step (prefill chunk budget)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes (2GiB, 512MB, or a bare whole number of bytes) or a share of the "
                        "memory available now (30%%); more than 90%% of it is refused")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse cached K/V blocks of earlier requests with the same beginning")


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    from kvlm.config import parse_bytes

    mem = None if a.kv_cache_memory is None else parse_bytes(a.kv_cache_memory)
    return dict(dtype=a.dtype, device=a.device, num_threads=a.threads, max_model_len=a.max_model_len,
                enable_kv_cache=not a.no_kv_cache, kv_cache_layout=a.kv_cache_layout,
                kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=mem,
                enable_prefix_caching=not a.no_prefix_caching)


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="return this many top logprobs per token (with --json)")


def _sampling_params(a: argparse.Namespace):
    from kvlm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos,
                          logprobs=a.logprobs)


def cmd_pull(a: argparse.Namespace) -> int:
    from kvlm.loader.registry import pull

    print(pull(a.model, force=a.force))
    return 0


def _format_stats(m: dict[str, Any]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    line = (f"prompt tokens {m['prompt_tokens']} (cached {m['cached_tokens']}, computed {m['prefilled_tokens']}), "
            f"generated {m['generated_tokens']}, "
            f"TTFT {f(m['ttft_s'], '.3f')} s, decode {f(m['decode_tokens_per_s'], '.1f')} tok/s, "
            f"KV held {m['kv_bytes_held'] / 2**20:.2f} MiB in {m['kv_blocks_held']} blocks "
            f"({m['kv_blocks_shared']} shared)")
    return line + (f"; prefix cache: {m['prefix_cache_miss']}" if m.get("prefix_cache_miss") else "")


def _looks_like_model(arg: str) -> bool:
    """A model path or alias, not a prompt: one word naming a model file, a folder, a path or an alias."""
    from kvlm.loader.registry import MODELS

    if not arg or any(c.isspace() for c in arg):
        return False
    return (arg in MODELS or arg.endswith((".gguf", ".safetensors")) or "/" in arg or os.sep in arg
            or Path(arg).expanduser().exists())


def _model_and_prompt(inputs: list[str], from_file: bool) -> tuple[str, str | None]:
    """`generate [MODEL] PROMPT`: one positional list (so options may sit anywhere), split here."""
    from kvlm.loader.registry import DEFAULT_MODEL

    if from_file:
        if len(inputs) > 1:
            raise ParameterError("prompt", "give either PROMPT or --prompts-file, not both")
        return (inputs[0] if inputs else DEFAULT_MODEL), None
    if not inputs:
        raise ParameterError("prompt", "give a PROMPT (or --prompts-file)")
    if len(inputs) == 1:
        if _looks_like_model(inputs[0]):
            raise ParameterError("prompt", f"no PROMPT after the model {inputs[0]!r} "
                                           "(give one after it, or use --prompts-file)")
        return DEFAULT_MODEL, inputs[0]
    if len(inputs) > 2:
        raise ParameterError("prompt", f"expected [MODEL] PROMPT, got {len(inputs)} positional arguments "
                                       "(quote a prompt of several words)")
    return inputs[0], inputs[1]


def cmd_generate(a: argparse.Namespace) -> int:
    a.model, a.prompt = _model_and_prompt(a.inputs, bool(a.prompts_file))
    params = _sampling_params(a)
    with loading():
        from kvlm.llm import LLM

        llm = LLM(a.model, quiet=a.quiet, **_engine_kwargs(a))
    load_prefix_snapshot(llm, a.prefix_snapshot, a.quiet)

    def as_input(text: str):
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": text}]
            return {"prompt_token_ids": llm.render_chat(msgs)}
        return text

    if a.prompts_file:
        return _generate_batch(llm, a, params, as_input)
    if a.json:
        out = llm.generate([as_input(a.prompt)], params, use_tqdm=False)[0]
        c = out.outputs[0]
        doc = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason, "prompt_token_ids": out.prompt_token_ids,
               "stats": out.metrics.as_dict()}
        if c.logprobs is not None:
            doc["logprobs"] = [{str(k): v for k, v in d.items()} for d in c.logprobs]
        print(json.dumps(doc, ensure_ascii=False))
        return 0
    for d in llm.stream(as_input(a.prompt), params):
        sys.stdout.write(d.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.stats:
        print("kvlm: " + _format_stats(llm.last_request.metrics.as_dict()), file=sys.stderr)
    return 0


def _generate_batch(llm: Any, a: argparse.Namespace, params: Any, as_input: Any) -> int:
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
    outs = llm.generate(prompts, params)
    for o in outs:
        c = o.outputs[0]
        if a.json:
            print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                              "stats": o.metrics.as_dict()}, ensure_ascii=False))
        else:
            print(c.text.replace("\n", "\\n"))
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    with loading():
        from kvlm.llm import LLM

        llm = LLM(a.model, quiet=a.quiet, **_engine_kwargs(a))
    load_prefix_snapshot(llm, a.prefix_snapshot, a.quiet)
    params = _sampling_params(a)
    messages: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    print("kvlm chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.render_chat(messages)
        reply = []
        # Earlier turns are in the prefix cache: only the new tokens of this turn are prefilled.
        for d in llm.stream({"prompt_token_ids": ids}, params):
            sys.stdout.write(d.text)
            sys.stdout.flush()
            reply.append(d.text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        m = llm.last_request.metrics
        print(f"[{m.num_prompt_tokens} prompt tokens: {m.num_cached_tokens} reused from the cache, "
              f"{m.num_prompt_tokens - m.num_cached_tokens} prefilled; {m.num_generated_tokens} generated]"
              + (f" [prefix cache: {m.prefix_miss}]" if a.stats and m.prefix_miss else ""), file=sys.stderr)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from kvlm.loader import load_config, resolve_model

    path = resolve_model(a.model)
    c = load_config(path)
    info = {"model": str(path), "architecture": c.architecture, "parameters": c.num_parameters,
            "layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "attention_heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "context_length": c.max_position_embeddings, "kv_bytes_per_token_fp32": int(c.kv_bytes_per_token(4)),
            "kv_bytes_per_token_fp16": int(c.kv_bytes_per_token(2))}
    formats = _weight_formats(path)
    if formats:
        info["weight_formats"] = formats
    if a.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            if k != "weight_formats":
                print(f"{k:26s} {v:,}" if isinstance(v, int) else f"{k:26s} {v}")
        for name, f in formats.items():  # which kernel computes on each stored format (--dtype auto)
            print(f"{'weights ' + name:26s} {f['tensors']} tensors, {f['bytes'] / 2**20:.1f} MiB -> {f['kernel']}")
    return 0


def _weight_formats(path: Path) -> dict[str, Any]:
    """GGUF only: per tensor type, the count, bytes and kernel path (loader.gguf.weight_formats)."""
    if path.suffix != ".gguf" or not path.is_file():
        return {}
    from kvlm.loader.gguf import read_gguf, weight_formats

    return weight_formats(read_gguf(path)[0])


def cmd_kv_size(a: argparse.Namespace) -> int:
    from kvlm.config import ModelConfig
    from kvlm.loader import load_config, resolve_model

    if a.config:
        try:
            c = ModelConfig.from_hf_dict(json.loads(Path(a.config).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise KvlmError(f"{a.config}: cannot read config ({e})") from None
    elif a.model:
        c = load_config(resolve_model(a.model))
    else:
        raise ValueError("give MODEL or --config FILE")
    b = DTYPE_BYTES[a.dtype]
    per_tok = c.kv_bytes_per_token(b)
    mha = c.kv_bytes_per_token(b, kv_heads=c.num_attention_heads)
    total, total_mha = per_tok * a.context * a.batch, mha * a.context * a.batch
    from kvlm.bench import kv_size_plot

    weights = c.num_parameters * b  # weights in the same dtype as the cache
    cross = kv_size_plot.crossover_context(c, batch=a.batch)  # same for every dtype: b cancels
    doc = {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "attention_heads": c.num_attention_heads,
           "head_dim": c.head_dim, "dtype": a.dtype, "context": a.context, "batch": a.batch,
           "bytes_per_token": per_tok, "total_bytes": total, "mha_bytes_per_token": mha, "mha_total_bytes": total_mha,
           "gqa_saving": 1 - per_tok / mha, "parameters": c.num_parameters, "weight_bytes": weights,
           "crossover_context": cross}
    if a.compare_known:
        doc["known"] = kv_size_plot.known_summary(a.context, b, a.batch)
    if a.plot:
        name = a.model or Path(a.config).stem
        doc["plot"] = kv_size_plot.plot(c, name, a.dtype, b, a.plot, a.batch, a.compare_known)
    if a.json:
        print(json.dumps(doc))
        return 0
    print(f"KV cache = 2 x {c.num_hidden_layers} layers x {c.num_key_value_heads} kv heads x {c.head_dim} dims x {b:g} B")
    print(f"  per token:        {per_tok:,.0f} B ({per_tok / 1024:.1f} KiB)")
    print(f"  {a.batch} x {a.context} tokens: {total:,.0f} B ({total / 2**20:.1f} MiB)")
    print(f"  MHA equivalent ({c.num_attention_heads} kv heads): {mha:,.0f} B/token, {total_mha / 2**20:.1f} MiB "
          f"-> GQA saves {100 * (1 - per_tok / mha):.0f}%")
    print(f"  outgrows the weights ({c.num_parameters:,} params x {b:g} B = {weights / 2**20:,.1f} MiB) "
          f"at {cross:,} tokens{' per sequence' if a.batch > 1 else ''} (in any dtype shared by both)")
    if a.compare_known:
        print(f"known models ({a.dtype}, {a.batch} x {a.context} tokens):")
        print(f"  {'model':16s} {'layers':>6s} {'heads':>5s} {'kv':>3s} {'dim':>4s} {'params':>8s} {'KV B/token':>11s} "
              f"{'KV total':>10s} {'weights':>10s} {'KV > weights at':>15s}")
        for k in doc["known"]:
            print(f"  {k['name']:16s} {k['layers']:6d} {k['attention_heads']:5d} {k['kv_heads']:3d} {k['head_dim']:4d} "
                  f"{k['parameters'] / 1e9:7.2f}B {k['bytes_per_token']:11,.0f} {k['total_bytes'] / 2**30:6.2f} GiB "
                  f"{k['weight_bytes'] / 2**30:6.2f} GiB {k['crossover_context']:15,d}"
                  + (f"  (sliding window {k['sliding_window']:,})" if k["sliding_window"] else ""))
    if a.plot:
        print(f"plot: {doc['plot']}")
    if a.plot or a.compare_known:  # bench-style use: end with the JSON document, like `kvlm bench ...`
        print(json.dumps(doc))
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser. `argv` (default: the command line) only decides whether the `bench` subcommands
    are built: several import torch at module level, which `kvlm --help` or `kvlm generate` need not pay
    for while parsing (generate imports torch later, with the engine)."""
    p = _Parser(prog="kvlm", description="A small, exact LLM inference engine built around the KV cache.")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or cache log on stderr")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("pull", help="fetch a named model into $KVLM_HOME")
    s.add_argument("model", nargs="?", default="smollm2-135m")
    s.add_argument("--force", action="store_true", help="download again even if present")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    s.add_argument("inputs", nargs="*", metavar="[MODEL] PROMPT",
                   help="model alias or path (default smollm2-135m when only PROMPT is given), then the prompt")
    s.add_argument("--prompts-file", help="one prompt per line, or JSONL with 'prompt' or 'prompt_token_ids'")
    s.add_argument("--chat", action="store_true", help="apply the model's chat template")
    s.add_argument("--system", default=None, help="system message (with --chat)")
    s.add_argument("--stats", action="store_true", help="print generation stats on stderr")
    s.add_argument("--json", action="store_true", help="print one JSON document instead of streaming")
    add_prefix_snapshot_flag(s)
    _add_sampling_flags(s)
    _add_engine_flags(s)
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", help="interactive multi-turn chat; earlier turns are reused from the prefix cache")
    s.add_argument("model", nargs="?", default="smollm2-135m")
    s.add_argument("--system", default=None)
    s.add_argument("--stats", action="store_true", help="also say why a turn reused less than it could have")
    add_prefix_snapshot_flag(s)
    _add_sampling_flags(s, max_tokens=512)
    _add_engine_flags(s)
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("info", help="architecture, parameters, context length, KV bytes per token")
    s.add_argument("model", nargs="?", default="smollm2-135m")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("kv-size", help="KV cache memory for a model, context and batch")
    s.add_argument("model", nargs="?")
    s.add_argument("--config", help="a Hugging Face config.json instead of a model")
    s.add_argument("--context", type=int, default=4096)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--dtype", default="float16", choices=sorted(DTYPE_BYTES))
    s.add_argument("--json", action="store_true")
    s.add_argument("--plot", metavar="FILE", help="write a PNG: KV memory vs context (MHA/GQA/MQA, dtypes, crossover "
                   "with the weights); the text output then ends with the JSON line")
    s.add_argument("--compare-known", action="store_true",
                   help="also show the shipped reference models (Llama-3-8B/70B, Qwen2.5-7B, Mistral-7B, SmolLM2-135M)")
    s.set_defaults(func=cmd_kv_size)

    from kvlm.server.cli import add_parser as add_serve_parser

    add_serve_parser(sub, _add_engine_flags)

    from kvlm.bench import BENCH_HELP, add_bench_parser
    from kvlm.cache_cli import add_cache_parser

    add_cache_parser(sub)
    words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    if words[:1] == ["bench"]:
        add_bench_parser(sub)
    else:  # listed in `kvlm --help`; its subcommands are built when the command line asks for them
        sub.add_parser("bench", help=BENCH_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # argparse takes a command's positional words in one run, so `generate MODEL --max-tokens 3 PROMPT`
    # leaves PROMPT over: words after options belong to the same positional list.
    if extra and isinstance(getattr(args, "inputs", None), list) and not any(x.startswith("-") for x in extra):
        args.inputs += extra
    elif extra:
        print(f"kvlm: error: unrecognized arguments: {' '.join(extra)} (see `kvlm {args.command} --help`)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KvlmError as e:
        flag = {"num_threads": "--threads: "}.get(getattr(e, "param", ""), "")  # where the flag's name differs
        print(f"kvlm: error: {flag}{e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OverflowError) as e:  # invalid values, bad prompts: usage errors
        print(f"kvlm: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `kvlm` command: `main()`, then exit without the interpreter's teardown.

    Tearing down a process that imported torch takes about 0.4 s (module and extension finalizers, the
    thread pool); a command has nothing left to clean up once `main` returns (files are closed, the
    server has drained), so it flushes its streams and leaves with `os._exit`."""
    try:
        code = main()
    except SystemExit as e:  # argparse's --help / usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (e.g. `kvlm ... | head`)
            pass
    os._exit(code)

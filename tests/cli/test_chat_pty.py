"""`kvlm chat` driven through a pseudo-terminal, as a user at a keyboard drives it: the process sees a
real terminal (readline, Ctrl-C as SIGINT from the line discipline, Ctrl-D as end of input).

The model is a tiny random GGUF with a 4096-token context, so a reply with --ignore-eos runs for seconds
and Ctrl-C lands in the middle of it. Turn lines ("[N prompt tokens: C reused from the cache, P
prefilled; G generated]") are what the tests read the cache's work from.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import tiny_config, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
TURN = re.compile(r"\[(\d+) prompt tokens: (\d+) reused from the cache, (\d+) prefilled; (\d+) generated\]")


class Terminal:
    """A child process on a pseudo-terminal: `send` types, `expect` waits for a pattern in what it printed."""

    def __init__(self, args: list[str], cwd: Path, term: str = "dumb") -> None:
        master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TERM": term}
        # A session of its own whose controlling terminal is the pty: Ctrl-C there is SIGINT to the child.
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlm", *args], stdin=slave, stdout=slave, stderr=slave,
                                     cwd=cwd, env=env, start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.fd = master
        self.out = ""  # everything printed so far
        self.pos = 0  # where the next expect starts looking

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def _read(self, timeout: float) -> None:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if r:
            try:
                self.out += os.read(self.fd, 65536).decode("utf-8", "replace").replace("\r\n", "\n")
            except OSError:  # the child closed the terminal
                pass

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.out, self.pos)
            if m:
                self.pos = m.end()
                return m
            exited = self.proc.poll() is not None and not select.select([self.fd], [], [], 0)[0]
            if time.monotonic() > deadline or exited:
                raise AssertionError(f"no {pattern!r} in:\n{self.out[self.pos:]}")
            self._read(0.2)

    def at_prompt(self) -> None:
        """Wait until the child has printed its prompt, and a moment more for it to block in select()."""
        self.expect(">>> ")
        time.sleep(0.3)

    def ctrl_c_at_prompt(self, pattern: str, tries: int = 4) -> None:
        """Press Ctrl-C at the prompt until `pattern` shows, as a user presses it again when nothing happens.
        Readline prints the prompt, then blocks in select(); a SIGINT that lands between the two only sets
        Python's flag, which CPython's readline checks when select() is interrupted, so that press shows
        nothing yet. The next press interrupts select(), and Python runs its handler once for both (the
        flag coalesces them): the child still sees one Ctrl-C. A child that exits fails at once."""
        self.at_prompt()
        for i in range(tries):
            self.send("\x03")
            try:
                self.expect(pattern, timeout=5.0 if i < tries - 1 else 120.0)
                return
            except AssertionError:
                if i == tries - 1 or self.proc.poll() is not None:
                    raise

    def turn(self, timeout: float = 120.0) -> tuple[int, int, int, int]:
        return tuple(int(x) for x in self.expect(TURN.pattern, timeout).groups())  # type: ignore[return-value]

    def close(self, wait: float = 30) -> int:
        """Wait for the exit (its status); past `wait` seconds the process is killed (-9)."""
        try:
            return self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            os.close(self.fd)


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 4096-token context: room for a reply long enough to interrupt."""
    path = tmp_path_factory.mktemp("chatpty") / "tiny4k.gguf"
    return write_tiny_gguf(path, tiny_config(max_position_embeddings=4096))


@contextlib.contextmanager
def chat(model: Path, cwd: Path, *flags: str, term: str = "dumb") -> Iterator[Terminal]:
    """`kvlm chat MODEL` on a terminal, at its first prompt; killed on the way out if a test left it running."""
    t = Terminal(["chat", str(model), "--block-size", "4", "--threads", "1", *flags], cwd, term)
    try:
        t.expect(r"/help lists the commands")
        t.expect(">>> ")
        yield t
    finally:
        if t.proc.poll() is None:
            t.close(wait=0.1)


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(long_gguf: Path, tmp_path: Path) -> None:
    with chat(long_gguf, tmp_path, "--max-tokens", "3000", "--ignore-eos", "--temperature", "1", "--seed", "1") as t:
        t.send("tell me a very long story\r")
        t.expect(r"\S{20}")  # the reply is streaming
        t.send("\x03")  # Ctrl-C, as the terminal sends it
        t.expect(r"\[stopped\]")
        prompt1, _, _, gen1 = t.turn()
        assert 0 < gen1 < 3000  # stopped mid-reply
        t.expect(">>> ")  # back at the prompt, the process alive
        t.send("and then?\r")
        t.expect(r"\S{20}")
        t.send("\x03")  # stop this one too, once it streams
        prompt2, reused2, prefilled2, _ = t.turn()
        assert prompt2 > prompt1 + gen1 // 2  # the stopped reply is in the history
        assert reused2 >= prompt1 // 4 * 4 and prefilled2 < prompt2 - prompt1 + gen1 // 2  # the cache carried it
        t.expect(">>> ")
        t.send("\x04")  # Ctrl-D at an empty prompt
        t.expect("kvlm chat: bye")
        assert t.close() == 0


def test_commands_save_and_load(long_gguf: Path, tmp_path: Path) -> None:
    save = tmp_path / "chat.json"
    with chat(long_gguf, tmp_path, "--max-tokens", "12", "--ignore-eos") as t:
        t.send("/help\r")
        for c in ("/reset", "/system TEXT", "/stats", "/save FILE", "/load FILE", "/exit"):
            t.expect(re.escape(c))
        t.send("/foo\r")
        t.expect(r"unknown command /foo; commands: /help /reset /system /stats /save /load /exit")
        t.send("hello there, how are you today?\r")
        t.expect(r"… \[cut off: --max-tokens 12 reached\]")  # a reply cut by the limit says so
        first = t.turn()
        assert first[1] == 0 and first[3] == 12
        t.send('"""\rline one\rline two\r"""\r')  # a multi-line message
        second = t.turn()
        assert second[1] >= first[0] // 4 * 4  # the first turn came from the cache
        t.send("/stats\r")
        t.expect(r"last turn: prompt \d+ tokens, \d+ reused from the cache, \d+ prefilled; 12 generated, [\d.]+ tok/s")
        t.expect(r"KV held [\d.]+ MiB")
        t.send(f"/save {save}\r")
        t.expect(r"\[saved 4 messages to")
        t.send("/reset\r")
        t.expect(r"\[conversation cleared: 4 messages forgotten\]")
        t.ctrl_c_at_prompt(r"Ctrl-C again")  # the first press asks
        t.ctrl_c_at_prompt("kvlm chat: bye")  # the second quits
        assert t.close() == 0
    assert save.exists() and save.with_name("chat.kv.safetensors").exists()

    # A new process resumes the saved chat: its history comes from the snapshot, only the new turn prefills.
    with chat(long_gguf, tmp_path, "--max-tokens", "12", "--ignore-eos") as t:
        t.send(f"/load {save}\r")
        saved = int(t.expect(r"\[loaded 4 messages from .*; (\d+) tokens of K/V").group(1))
        assert saved >= second[0]  # the snapshot holds both turns
        t.send("one more question\r")
        prompt, reused, prefilled, _ = t.turn()
        # Everything the snapshot held is reused; only the new turn's own tokens (and the partial block the
        # snapshot could not hold) are prefilled.
        assert reused >= saved // 4 * 4 and prefilled <= prompt - saved + 4, (prompt, saved, reused, prefilled)
        t.send("/exit\r")
        t.expect("kvlm chat: bye")
        assert t.close() == 0


def test_a_pasted_block_of_lines_is_one_message(long_gguf: Path, tmp_path: Path) -> None:
    """On a terminal that brackets pastes (xterm), readline keeps a pasted text's newlines in the line: the
    whole paste is one message, one turn."""
    text = "first pasted line\nsecond pasted line"
    with chat(long_gguf, tmp_path, "--max-tokens", "3", term="xterm") as t:
        t.send(f"\x1b[200~{text}\x1b[201~\r")
        prompt, _, _, _ = t.turn()
        assert prompt > len(text)  # byte-level vocabulary: both lines are in this one prompt
        t.expect(">>> ")
        t.send("/exit\r")
        t.expect("kvlm chat: bye")
        assert t.close() == 0
    assert len(TURN.findall(t.out)) == 1, t.out

"""Start-up cost: what a fresh process imports, parses and keeps before its first token.

Each check runs in a fresh interpreter where it is about imports (sys.modules is per process):
`import kvlm` and the CLI parser stay free of torch, building an engine never imports torch._dynamo
(~1 s and ~45 MB when a meta-device op pulls it in), long GGUF metadata arrays are decoded only when
used, and the native extension's stamp lets a start skip the compiler and the source hash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON document as its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAVY = ("torch", "jinja2", "transformers", "tokenizers")


def test_import_and_parser_stay_light() -> None:
    """`import kvlm`, the parser of any non-bench command and reading a GGUF config import no torch."""
    got = run_fresh(f"""
import json, sys
import kvlm, kvlm.cli.main
kvlm.cli.main.build_parser(["generate", "hi"])
kvlm.cli.main.build_parser(["kv-size"])
from kvlm.loader import load_config, resolve_model
print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))
""")
    assert not any(got.values()), got


def test_bench_parser_is_built_for_bench(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlm.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser(["-q", "bench", "--help"]).parse_args(["-q", "bench", "--help"])
    assert "compare" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser(["--help"]).parse_args(["--help"])
    assert "bench" in capsys.readouterr().out  # still listed


def test_engine_build_does_not_import_dynamo(tiny_gguf: Path) -> None:
    """Both dtypes in one fresh process (one import of torch, not two), auto first: a module the auto path
    imports shows in its own entry."""
    got = run_fresh(f"""
import json, sys
from kvlm import LLM, SamplingParams
got = {{}}
for dtype in ("auto", "float32"):
    llm = LLM({str(tiny_gguf)!r}, dtype=dtype)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    got[dtype] = {{"dynamo": "torch._dynamo" in sys.modules, "jinja2": "jinja2" in sys.modules,
                  "tokens": len(out[0].outputs[0].token_ids)}}
print(json.dumps(got))
""")
    assert got == {dtype: {"dynamo": False, "jinja2": False, "tokens": 4} for dtype in ("auto", "float32")}


def test_long_metadata_arrays_decode_lazily(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every array lazy, the fields equal gguf.GGUFReader's, and a tokenizer built from them works."""
    import gguf

    from kvlm.loader import gguf_file
    from kvlm.tokenizer.tokenizer import Tokenizer

    monkeypatch.setattr(gguf_file, "LAZY_ARRAY_MIN", 2)
    fields = gguf_file.GGUFFile(tiny_gguf).fields
    lazy = {k for k, v in fields.items() if isinstance(v, gguf_file.LazyArray)}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"} <= lazy
    reader = gguf.GGUFReader(str(tiny_gguf))
    expected = {name: field.contents() for name, field in reader.fields.items()}
    for key in lazy:
        assert len(fields[key]) == len(expected[key])
        assert list(fields[key]) == expected[key], key
        assert fields[key][-1] == expected[key][-1]
    tok = Tokenizer.from_gguf_fields(fields)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_real_vocabulary_is_not_decoded_at_load(smollm2_gguf: Path) -> None:
    from kvlm.loader.gguf import read_gguf
    from kvlm.loader.gguf_file import LazyArray

    _, fields = read_gguf(smollm2_gguf)
    tokens = fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, LazyArray) and tokens._values is None and len(tokens) == 49152
    assert tokens[1] == "<|im_start|>"


def test_native_stamp_skips_the_full_key_until_a_source_changes(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from kvlm.kernels import native

    csrc = tmp_path / "csrc"
    shutil.copytree(native._CSRC, csrc)
    monkeypatch.setattr(native, "_CSRC", csrc)
    monkeypatch.setenv("KVLM_HOME", str(tmp_path / "home"))
    key = native._build_key()
    assert native._cached_key() is None  # no stamp yet
    native._write_stamp(key)
    assert native._cached_key() is None  # a stamp without its library is not trusted
    lib = native._library(key)
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    calls: list[str] = []
    monkeypatch.setattr(native, "_compiler", lambda: calls.append("c++ --version") or "c++")
    assert native._cached_key() == key and not calls  # a start: stats only
    src = csrc / native._SOURCES[0]
    src.write_text(src.read_text() + "\n// changed\n")
    assert native._cached_key() is None  # an edited source misses the stamp...
    assert native._build_key() != key  # ...and the full key sees the change: rebuild


def test_trim_heap_runs_here() -> None:
    from kvlm.loader.heap import trim_heap

    assert trim_heap() is sys.platform.startswith("linux")


# Tensors of 1 to 24 MiB allocated, touched and freed, 5 rounds after a first: the page faults a round takes.
_FAULT_PROBE = """
import json, resource, torch
from kvlm.loader.heap import keep_freed_memory
kept = keep_freed_memory()
def step():
    ts = [torch.empty(n << 20, dtype=torch.uint8).fill_(1) for n in (1, 2, 4, 8, 16, 24, 12, 6)]
    del ts
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({"kept": kept, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 5}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_stay_mapped_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """With keep_freed_memory (every CPU engine sets it), memory a step frees is reused without page
    faults; with glibc's own thresholds (KVLM_MALLOC=default) the same rounds fault thousands of pages
    back in. A round touches 73 MiB, 18,688 pages; measured 2026-12-05: 51-1,843 faults a round kept,
    4,039-15,991 with the defaults."""
    kept = run_fresh(_FAULT_PROBE)
    assert kept["kept"] and kept["faults"] < 18_688 / 5, kept
    monkeypatch.setenv("KVLM_MALLOC", "default")
    default = run_fresh(_FAULT_PROBE)
    assert not default["kept"]
    assert default["faults"] > kept["faults"], (default, kept)


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (from /proc/self/smaps)."""
    target, rss, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                inside = len(parts) > 5 and parts[5] == target
            elif inside and parts[0] == "Rss:":
                rss += int(parts[1]) * 1024
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_release_unused_drops_only_unused_pages_of_the_file(tmp_path: Path) -> None:
    import numpy as np

    from kvlm.loader.mapped_pages import release_unused

    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    data.tofile(path)
    other = np.ones(1 << 20, dtype=np.uint8)  # anonymous memory: must never be touched
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    second = np.memmap(path, dtype=np.uint8, mode="r")  # another engine's mapping: left alone
    second_rss = int(second.sum(dtype=np.int64)) and _mapped_rss(path)  # all of it resident
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page read: resident
    assert _mapped_rss(path) >= 64 << 20
    base = mapped.ctypes.data
    keep = (base + (1 << 20) + 100, base + (3 << 20))  # an unaligned start: its page is kept whole
    released = release_unused(path, [keep])
    assert released >= (29 << 20)
    # A released page that shared a huge-page mapping with kept ones may drop them too: they fault
    # back in when read. After the kept range is read again, only its 2 MiB (rounded out to the 2 MiB
    # huge pages that file mappings may use) are resident, of 32.
    assert int(mapped[1 << 20 : 3 << 20].sum(dtype=np.int64)) == int(data[1 << 20 : 3 << 20].sum(dtype=np.int64))
    assert _mapped_rss(path) - second_rss <= (6 << 20)
    assert np.array_equal(mapped, data)  # released pages read back from the file
    assert int(other.sum()) == 1 << 20
    assert release_unused(tmp_path / "not-mapped.bin", [keep]) == 0


def test_a_killed_build_does_not_hang_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's cpp_extension waits forever while its `lock` file exists in the build folder, and a build killed
    midway leaves one. Under kvlm's own flock no other builder runs, so the next build removes it first."""
    from kvlm.kernels import native

    monkeypatch.setenv("KVLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(native, "_cached_key", lambda: None)
    monkeypatch.setattr(native, "_build_key", lambda: "k1")
    build_dir = native._ext_root() / "k1"
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")  # what a SIGKILLed build leaves
    seen: list[bool] = []

    def compile_(name: str, where: Path) -> None:  # stands in for the minute-long compiler run
        seen.append((where / "lock").exists())
        (where / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(native, "_compile", compile_)
    monkeypatch.setattr(native.torch.ops, "load_library", lambda path: None)
    native._build_and_load()
    assert seen == [False]
    assert native._library("k1").exists()

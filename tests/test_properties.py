"""Property-based tests (hypothesis) for the pieces with many edge cases.

* `SamplingParams` / `EngineConfig` validation: any value of any field either constructs a valid object
  or raises `ParameterError` naming that field; never another exception.
* The stop-string matcher and the incremental detokenizer: random byte-level token streams and random
  stop strings; stop text never leaks into a delta, deltas always add up to the final text, and the
  final text is the full decode cut at the first stop string.
* The block manager, through its public methods only: random allocate/append/free/preempt
  sequences keep every invariant of `check()`.
* The GGUF header reader: random byte patches and cuts of a valid tiny file give a clean
  `ModelLoadError` (or a model) within 1 s of CPU and without a large allocation.

Example counts are bounded so the module runs in well under a minute on two cores.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import byte_level_fields, write_tiny_gguf

from kvlm.config import EngineConfig, parse_bytes
from kvlm.engine.output_processor import OutputProcessor
from kvlm.errors import ModelLoadError, ParameterError
from kvlm.kv_cache.block_manager import BlockManager
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams
from kvlm.tokenizer.detokenizer import IncrementalDetokenizer
from kvlm.tokenizer.tokenizer import Tokenizer

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values a JSON body, a Python caller or a typo could put in any field.
WILD = st.one_of(
    st.none(), st.booleans(),
    st.integers(-5, 30), st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.sampled_from([0.0, 1.0, 1e-6, 1e-5, 2.0]),
    st.text(max_size=4), st.sampled_from(["0.7", "1", "", "stop"]),
    st.lists(st.one_of(st.integers(-3, 300), st.text(max_size=3), st.booleans(), st.none()), max_size=3),
)
SP_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
             "logprobs", "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output"]


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@FAST
@given(st.dictionaries(st.sampled_from(SP_FIELDS), WILD, max_size=4))
def test_sampling_params_valid_or_parameter_error(kwargs: dict[str, Any]) -> None:
    try:
        p = SamplingParams(**kwargs)
    except ParameterError as e:
        assert e.param in kwargs or (e.param == "min_tokens" and "max_tokens" in kwargs), (e.param, kwargs)
        assert str(e).startswith(e.param) and "\n" not in str(e) and len(str(e)) < 200
        return
    # Constructed: every value is in its documented range and of its type.
    assert p.n == 1
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert finite(getattr(p, name)), name
    assert p.temperature >= 0 and 0 < p.top_p <= 1 and 0 <= p.min_p <= 1 and p.repetition_penalty > 0
    assert isinstance(p.top_k, int) and not isinstance(p.top_k, bool) and p.top_k >= 0
    assert p.max_tokens is None or (type(p.max_tokens) is int and p.max_tokens >= 1)
    assert type(p.min_tokens) is int and 0 <= p.min_tokens <= (p.max_tokens or p.min_tokens)
    assert p.seed is None or (type(p.seed) is int and -(2**63) <= p.seed < 2**63)
    assert all(isinstance(s, str) and s for s in p.stop_strings)
    assert all(type(t) is int and t >= 0 for t in p.stop_token_ids or [])
    assert p.greedy == (p.temperature < 1e-5)


EC_FIELDS = ["dtype", "enable_kv_cache", "kv_cache_layout", "block_size", "max_model_len", "max_num_seqs",
             "max_num_batched_tokens", "kv_cache_memory", "num_threads"]


@FAST
@given(st.dictionaries(st.sampled_from(EC_FIELDS), WILD, max_size=3),
       st.sampled_from([None, "cpu", "gpu", "cuda:x", "", 0]))
def test_engine_config_valid_or_parameter_error(kwargs: dict[str, Any], device: Any) -> None:
    kwargs = {**kwargs, "device": device}
    try:
        EngineConfig(**kwargs)
    except ParameterError as e:
        assert e.param in kwargs, (e.param, kwargs)
        assert "\n" not in str(e) and len(str(e)) < 200


@FAST
@given(st.one_of(st.text(max_size=8), st.from_regex(r"\A[0-9]{0,12}(\.[0-9]{0,3})?(%|[KMGT]i?B|B|k)?\Z")))
def test_parse_bytes_one_meaning(text: str) -> None:
    """A KV budget spelling is bytes (whole, >= 1), a share in (0, 1], or a ParameterError; never a crash."""
    try:
        v = parse_bytes(text)
    except ParameterError as e:
        assert e.param == "kv_cache_memory"
        return
    assert (type(v) is int and v >= 1) or (type(v) is float and 0 < v <= 1 and text.strip().endswith("%"))


# ------------------------------------------------------------------- stop strings and detokenizer
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_fields(byte_level_fields())


# Byte tokens of ASCII letters, of multi-byte characters (split across tokens), merged tokens and a
# few stray continuation bytes (invalid UTF-8 that decodes to U+FFFD).
PIECES = st.one_of(
    st.sampled_from(list(b"abcehlo w!")).map(lambda b: [b]),
    st.sampled_from(["é", "😀", "日本", "ö"]).map(lambda s: list(s.encode())),
    st.sampled_from([256, 257, 258, 259, 260]).map(lambda t: [t]),
    st.sampled_from([0x80, 0xBF, 0xE6]).map(lambda b: [b]),
)
STOPS = st.lists(st.text(alphabet="abcehlo w!é😀日", min_size=1, max_size=4), max_size=3)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(PIECES, min_size=1, max_size=25).map(lambda ps: [t for p in ps for t in p]), STOPS, st.booleans())
def test_stop_strings_never_leak_and_deltas_add_up(tok: Tokenizer, ids: list[int], stops: list[str],
                                                    include: bool) -> None:
    prompt = tok.encode("Q: ")
    req = Request("r", list(prompt), len(prompt),
                  SamplingParams(max_tokens=None, stop=stops, include_stop_str_in_output=include, ignore_eos=True))
    req.detokenizer = IncrementalDetokenizer(tok, prompt)
    proc = OutputProcessor(tok.eos_token_ids, 10_000)
    streamed = ""
    fed: list[int] = []
    for t in ids:
        fed.append(t)
        d = proc.append_token(req, t, None)
        streamed += d.text
        if not include:
            assert not any(s in streamed for s in stops), (streamed, stops)  # never, not even for a moment
        if d.finished:
            break
    if req.finish_reason is None:
        req.finish_reason = "length"  # the caller ends it: what is held back is final now
        streamed += req.pending_text + req.detokenizer.flush()
    full = tok.decode(fed)  # this vocab decodes context-free: the text the generated ids add
    hits = [(full.find(s), s) for s in stops if s in full]
    if isinstance(req.stop_reason, str):
        i, s = min(hits)
        assert s == req.stop_reason or full.find(req.stop_reason) == i
        want = full[: i + len(req.stop_reason)] if include else full[:i]
        assert streamed == req.text == want
    else:
        assert not hits and streamed == full


# ----------------------------------------------------------------------------------- block manager
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "append", "free", "preempt"]),
                         st.integers(0, 5), st.integers(0, 40)), max_size=60)


@FAST
@given(st.integers(1, 24), st.sampled_from([1, 2, 4, 16]), OPS)
def test_block_manager_invariants_hold(num_blocks: int, block_size: int, ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks, block_size)
    reqs = [Request(f"r{i}", [1], 1, SamplingParams()) for i in range(6)]
    tokens = [0] * 6  # tokens each request holds slots for
    for op, i, n in ops:
        r = reqs[i]
        if op in ("alloc", "append"):
            want = tokens[i] + (n if op == "alloc" else 1)
            if bm.can_allocate(r, want):
                bm.allocate(r, want)
                tokens[i] = want
            else:
                before = list(r.block_table)
                with pytest.raises(RuntimeError):
                    bm.allocate(r, want)
                assert r.block_table == before  # a refused allocation takes nothing
        else:  # free (finished, aborted) and preempt (by recompute) both return every block
            bm.free(r)
            tokens[i] = 0
            assert r.block_table == []
        bm.check(reqs)
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
        for j, q in enumerate(reqs):
            assert len(q.block_table) == bm.blocks_for(tokens[j])
    for r in reqs:
        bm.free(r)
    bm.check(reqs)
    assert bm.num_free_blocks == num_blocks


# ------------------------------------------------------------------------------------ GGUF header
@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("prop") / "tiny.gguf").read_bytes()


HEADER_BYTES = 6000  # the tiny file's metadata and tensor table lie within its first ~5 KB


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, HEADER_BYTES), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(0, HEADER_BYTES)))
def test_damaged_gguf_is_a_clean_error(tiny_bytes: bytes, tmp_path: Path, patches: list[tuple[int, bytes]],
                                       cut: int | None) -> None:
    from kvlm.loader.gguf import load_gguf

    data = bytearray(tiny_bytes)
    for at, b in patches:
        data[at:at + len(b)] = b
    if cut is not None:
        del data[cut:]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    tracemalloc.start()
    t0 = time.process_time()
    try:
        load_gguf(path)
    except ModelLoadError as e:
        assert "\n" not in str(e) and "dtype" not in str(e)
    finally:
        cpu = time.process_time() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert cpu < 1.0, f"took {cpu:.2f} s of CPU"
    assert peak < 64 << 20, f"allocated {peak / 2**20:.0f} MiB"


def test_the_fuzzed_region_is_the_header(tiny_bytes: bytes, tmp_path: Path) -> None:
    """The patches above land in the metadata and tensor table (the weights start after them)."""
    from gguf import GGUFReader

    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_bytes)
    tensors_start = min(int(t.data_offset) for t in GGUFReader(path).tensors)
    assert HEADER_BYTES - 1500 < tensors_start <= HEADER_BYTES + 32, tensors_start

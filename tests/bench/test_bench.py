"""The KV-cache benchmarks (`kvlm bench waste|invariance|latency|compare`, `kvlm kv-size --plot`) on the
tiny GGUF: their JSON fields and invariants, their plots (valid PNGs under 200 KB), the shipped reference
configs, and that absent peers are skipped rather than failing. Timings are only checked for sign: this
file must not depend on the machine's speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from deps import in_ci

from kvlm.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIGS = Path(__file__).parents[2] / "kvlm" / "configs"


def quiet(_: str) -> None:
    pass


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) < 200_000, f"{path}: {len(data)} bytes"


def cli_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict[str, Any], str]:
    """Run `kvlm ARGV`; return (the JSON document on the last line, the text before it)."""
    assert main(argv) == 0
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    return json.loads(out[-1]), "\n".join(out[:-1])


def assert_header(d: dict[str, Any], bench: str) -> None:
    assert d["bench"] == bench and d["threads"] == 2
    assert isinstance(d["date"], str) and isinstance(d["cpu"], str) and d["cpu"]


# ------------------------------------------------------------------------------------------- waste


def test_waste(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "waste.png"
    d, table = cli_json(capsys, ["-q", "bench", "waste", str(tiny_gguf), "--prompt-len", "8", "--lengths", "4", "8",
                                 "--repeats", "1", "--plot", str(png)])
    assert_header(d, "waste")
    rows = d["rows"]
    assert [r["n"] for r in rows] == [1, 4, 8]  # n = 1, the break-even point, is always added
    P = 8
    for r in rows:
        n = r["n"]
        assert r["tokens_cache"] == P + n - 1
        assert r["tokens_no_cache"] == n * P + n * (n - 1) // 2
        assert r["identical"] is True
        assert r["seconds_cache"] > 0 and r["seconds_no_cache"] > 0 and r["speedup"] > 0
        assert r["kv_bytes"] == r["tokens_cache"] * d["kv_bytes_per_token"]
    for key in ("tokens_cache", "tokens_no_cache", "flops_cache", "flops_no_cache", "kv_bytes"):
        vals = [r[key] for r in rows]
        assert vals == sorted(vals) and len(set(vals)) == len(vals), key  # strictly increasing with n
    # n = 1 is one prefill either way: same work, so the cache cannot pay there
    assert rows[0]["tokens_cache"] == rows[0]["tokens_no_cache"] and rows[0]["flops_cache"] == rows[0]["flops_no_cache"]
    assert d["break_even_speedup"] == rows[0]["speedup"]
    assert d["all_identical"] is True and d["no_cache_tokens_measured"] == 8
    assert d["largest_measured_n"] == 8
    assert d["processed_tokens_per_s_no_cache"] > 0 and d["processed_tokens_per_s_cache"] > 0
    assert d["kv_outgrows_weights_at_tokens"] * d["kv_bytes_per_token"] >= d["weight_bytes"]
    assert "break-even" in table and "identical" in table
    assert d["plot"] == str(png)
    assert_png(png)


def test_waste_no_cache_budget_stops_early(tiny_gguf: Path) -> None:
    from kvlm.bench import waste

    d = waste.run(str(tiny_gguf), threads=2, prompt_len=8, lengths=(6,), repeats=1, no_cache_seconds=0.0, log=quiet)
    assert d["no_cache_tokens_measured"] == 1  # one step always runs, then the budget stops it
    first, last = d["rows"]
    assert first["identical"] is True and first["seconds_no_cache"] > 0
    assert last["seconds_no_cache"] is None and last["speedup"] is None and last["identical"] is None
    assert last["tokens_no_cache"] == 6 * 8 + 15  # counts stay exact when not measured


@pytest.mark.parametrize("cache", [True, False])
def test_tokens_processed_formula_matches_the_runner_count(tiny_gguf: Path, cache: bool) -> None:
    """The waste benchmark's closed forms equal what the model actually processed, as counted by the
    runner: tokens fed through the model and the sum of their context lengths."""
    from kvlm import LLM
    from kvlm.bench.waste import timed_generation, tokens_processed

    llm = LLM(str(tiny_gguf), enable_kv_cache=cache)
    runner = llm.llm_engine.runner
    P = 8
    for n in (1, 4, 9):
        before = (runner.num_tokens_processed, runner.num_context_tokens)
        toks, _ = timed_generation(llm, list(range(1, P + 1)), n)
        assert len(toks) == n
        counted = (runner.num_tokens_processed - before[0], runner.num_context_tokens - before[1])
        assert counted == tokens_processed(P, n, cache=cache), (n, counted)


def test_forward_flops_formula() -> None:
    from tiny_models import tiny_config

    from kvlm.bench.waste import forward_flops, tokens_processed
    from kvlm.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(tiny_config())
    T, ctx = tokens_processed(5, 3, cache=True)
    assert (T, ctx) == (7, 28)  # positions 0..6, contexts 1..7
    assert forward_flops(cfg, T, ctx) == 2 * cfg.num_parameters * 7 + 4 * 2 * (4 * 16) * 28
    assert tokens_processed(5, 3, cache=False) == (5 + 6 + 7, 15 + 21 + 28)


# -------------------------------------------------------------------------------------- invariance


def test_invariance(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "inv.png"
    d, table = cli_json(capsys, ["-q", "bench", "invariance", str(tiny_gguf), "--prompt-len", "12", "--extra-len", "8",
                                 "--plot", str(png)])
    assert_header(d, "invariance")
    layers = d["layers"]
    assert [r["layer"] for r in layers] == list(range(d["num_layers"])) and len(layers) >= 2
    for r in layers:  # causal: appending tokens never changes history K/V (engine cache and own forward)
        for key in ("cache_k_diff", "cache_v_diff", "causal_k_diff", "causal_v_diff"):
            assert isinstance(r[key], float) and r[key] < 1e-5, (r["layer"], key)
    assert layers[0]["noncausal_k_diff"] < 1e-5 and layers[0]["noncausal_v_diff"] < 1e-5  # token + position only
    for r in layers[1:]:  # without the mask later tokens leak into earlier positions from layer 1 on
        assert r["noncausal_k_diff"] > 1e-4 and r["noncausal_v_diff"] > 1e-4
    assert d["causal_max_diff"] < 1e-5 < 1e-4 < d["noncausal_min_diff_layers_1plus"]
    assert "layer" in table
    assert_png(png)


# ----------------------------------------------------------------------------------------- latency


def test_latency(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "roofline.png"
    d, table = cli_json(capsys, ["-q", "bench", "latency", str(tiny_gguf), "--prompt-lens", "8", "16",
                                 "--contexts", "8", "32", "--decode-steps", "3", "--repeats", "1",
                                 "--copy-mib", "8", "--matmul-n", "128", "--plot", str(png)])
    assert_header(d, "latency")
    assert d["memory_bandwidth_gb_per_s"] > 0 and d["peak_gflops_per_s"] > 0 and d["ridge_intensity"] > 0
    assert d["read_bandwidth_gb_per_s"] > 0
    assert [r["prompt_len"] for r in d["prefill"]] == [8, 16]
    for r in d["prefill"]:
        assert r["ttft_s"] > 0 and r["gflops_per_s"] > 0 and r["intensity"] > 0
    assert [r["context"] for r in d["decode"]] == [8, 32]
    for r in d["decode"]:
        assert r["time_per_token_s"] > 0 and r["gb_per_s"] > 0
        assert r["fraction_of_read_bandwidth"] == pytest.approx(r["gb_per_s"] / d["read_bandwidth_gb_per_s"])
        expected = d["weight_bytes_read"] + r["mean_context"] * d["kv_bytes_per_token"]
        assert r["bytes_per_token"] == pytest.approx(expected)
        b = r["breakdown_s"]  # weights, attention, KV write, other ops, sampling, host: all measured, >= 0
        assert set(b) == {"weights", "attention", "kv_write", "other_ops", "sampling", "host"}
        assert min(b.values()) >= 0 and b["weights"] > 0 and b["attention"] > 0 and b["kv_write"] > 0
    # decode reads every weight per token: ~0.5 FLOP/byte in float32, far below prefill's intensity
    assert max(r["intensity"] for r in d["decode"]) < 1 < min(r["intensity"] for r in d["prefill"])
    assert "prefill" in table and "decode" in table and "decode step breakdown" in table
    assert_png(png)


def test_machine_ceilings_positive() -> None:
    from kvlm.bench.latency import memory_bandwidth, peak_flops, read_bandwidth

    assert memory_bandwidth(mib=4, repeats=2) > 0
    assert read_bandwidth(mib=4, repeats=2) > 0
    assert peak_flops(n=64, repeats=2) > 0


def test_native_read_pass_reads_every_word_of_each_stream() -> None:
    """The 16-stream read pass behind read_bandwidth: the sum of every 64-bit word of a tensor that splits into
    whole turns (threads x streams x 16 words), as 16 streams a thread or one."""
    import torch
    from deps import need_native

    need_native("the read pass is a native op")
    from kvlm.kernels import native

    native.ops()
    turns = torch.get_num_threads() * 16 * 16
    src = torch.arange(3 * turns, dtype=torch.int64)
    assert torch.ops.kvlm_kernels.read_pass(src, 16) == int(src.sum())
    assert torch.ops.kvlm_kernels.read_pass(src, 1) == int(src.sum())


def test_compare_keeps_the_bandwidth_timed_next_to_the_best_decode() -> None:
    """Best of the rounds: the highest prefill and decode, and with the decode the read bandwidth of its
    own round (a ceiling is only a ceiling of the decode it was timed next to)."""
    from kvlm.bench.compare import _best

    def rnd(prefill: float, decode: float, bw: float) -> dict[str, Any]:
        return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "context_decode": [],
                "read_bandwidth_gb_per_s": bw}

    assert _best(rnd(10, 5, 80), rnd(12, 6, 48)) == rnd(12, 6, 48)
    assert _best(rnd(12, 6, 48), rnd(10, 5, 80)) == rnd(12, 6, 48)
    assert _best(rnd(14, 5, 80), rnd(12, 6, 48)) == rnd(14, 6, 48)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_compare_decode_ceiling_counts_what_a_step_reads(tied: bool, tmp_path: Path) -> None:
    """The decode ceiling's bytes per token, counted from the file (every tensor, less the embedding table
    unless the output matrix is tied to it), are exactly what the engine's linear layers hold plus the
    norms: two independent counts of one step's reads. The ceiling and each share follow from them."""
    from gguf import GGUFReader
    from tiny_models import tiny_config, write_tiny_gguf

    from kvlm.bench import compare

    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_config(tie_word_embeddings=tied), tensor_type="Q8_0")
    d = compare.run(str(path), threads=2, prompt_len=8, decode_prompt_len=4, gen_tokens=4, contexts=(), repeats=1,
                    llama_cpp=False, whole=False, reference=False, log=quiet)
    k, fb, bw = d["engines"]["kvlm"], d["file_decode_bytes"], d["engines"]["kvlm"]["read_bandwidth_gb_per_s"] * 1e9
    names = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    assert ("output.weight" in names) != tied
    norms = sum(n for name, n in names.items() if name.endswith("norm.weight"))
    assert fb == k["decode_weight_bytes"] + norms
    assert k["decode_gb_per_s"] == pytest.approx(k["decode_weight_bytes"] * k["decode_tokens_per_s"] / 1e9)
    assert k["decode_fraction_of_read_bandwidth"] == pytest.approx(k["decode_gb_per_s"] * 1e9 / bw)


# ----------------------------------------------------------------------------------------- kv-size


PUBLISHED_PARAMS = {"Llama-3-8B": 8_030_261_248, "Llama-3-70B": 70_553_706_496, "Qwen2.5-7B": 7_615_616_512,
                    "Mistral-7B-v0.1": 7_241_732_096, "SmolLM2-135M": 134_515_008}


def test_known_configs_are_the_published_shapes() -> None:
    from kvlm.kv_cache.sizing import known_configs

    known = known_configs()
    assert {name: c.num_parameters for name, c in known.items()} == PUBLISHED_PARAMS
    assert (known["Llama-3-70B"].num_hidden_layers, known["Llama-3-70B"].num_key_value_heads) == (80, 8)
    assert known["Qwen2.5-7B"].kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2


def test_kv_size_plot_and_crossover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = CONFIGS / "Llama-3-8B.json"
    png = tmp_path / "kv.png"
    d, text = cli_json(capsys, ["kv-size", "--config", str(cfg), "--dtype", "float16", "--compare-known",
                                "--plot", str(png)])
    per_tok_1b = 2 * 32 * 8 * 128
    assert d["crossover_context"] == PUBLISHED_PARAMS["Llama-3-8B"] // per_tok_1b + 1
    cross, per_tok = d["crossover_context"], d["bytes_per_token"]
    assert cross * per_tok > d["weight_bytes"] >= (cross - 1) * per_tok  # the first context past the weights
    assert d["weight_bytes"] == PUBLISHED_PARAMS["Llama-3-8B"] * 2
    assert {k["name"] for k in d["known"]} == set(PUBLISHED_PARAMS)
    assert "GQA saves 75%" in text and "outgrows the weights" in text  # the existing text is kept
    assert_png(png)
    # the crossover does not depend on the dtype (cache and weights scale together); --json is unchanged
    assert main(["kv-size", "--config", str(cfg), "--dtype", "int4", "--json"]) == 0
    d4 = json.loads(capsys.readouterr().out)
    assert d4["crossover_context"] == d["crossover_context"] and "known" not in d4


# ----------------------------------------------------------------------------------------- compare


FAKE_LLAMA_CPP = """
import json, os
__version__ = "fake"


def llama_print_system_info():
    return b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 0 | OPENMP = 1 |"


class Llama:
    # Stands in for llama_cpp.Llama in the worker process: logs how the bench drives it.
    def __init__(self, model_path, **kw):
        self.log = open(os.environ["FAKE_LLAMA_LOG"], "a")
        self.n_tokens = 0
        self._write({"init": model_path, "kw": kw, "lib": os.environ.get("LLAMA_CPP_LIB_PATH")})

    def _write(self, d):
        self.log.write(json.dumps(d) + "\\n")
        self.log.flush()

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        self._write({"eval": [self.n_tokens, len(tokens)]})
        self.n_tokens += len(tokens)

    def sample(self, **kw):
        assert kw.get("top_k") == 1 and kw.get("temp") == 0.0  # greedy, like kvlm
        return 7

    def tokenize(self, text, add_bos=True, special=False):
        assert special and not add_bos  # a rendered chat prompt: special tokens parsed, no extra BOS
        return list(text[:5])

    def detokenize(self, ids):
        return b"x" * len(ids)
"""


def test_compare_runs_llama_cpp_in_its_own_process(tiny_gguf: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The llama.cpp side runs as a child process of --llama-python (here with a stand-in llama_cpp
    package on its path), same threads, flash attention on; whole-process runs report time and RSS.
    HF transformers (`--hf`, a test dependency) reads the same GGUF and times prefill and decode in this
    process; where it is not installed (never in CI), its column is a skip that says so."""
    import importlib.util

    from kvlm.bench import compare

    has_hf = importlib.util.find_spec("transformers") is not None or in_ci()  # in CI: must be installed

    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "llama.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake'}:{Path(__file__).parents[2]}")
    d = compare.run(str(tiny_gguf), threads=2, prompt_len=16, decode_prompt_len=8, gen_tokens=4, contexts=(12, 24),
                    context_gen=3, repeats=1, llama_python=sys.executable, hf=True, log=quiet)
    assert_header(d, "compare")
    e = d["engines"]
    for key in ("kvlm", "kvlm_float32", "llama_cpp"):
        r = e[key]
        assert r["status"] == "ok", r
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert [c["context"] for c in r["context_decode"]] == [12, 24]
        assert r["whole_process_s"] > 0 and r["peak_rss_bytes"] > 1 << 20
    assert e["llama_cpp"]["version"] == "fake" and e["llama_cpp"]["isa"] == "avx2"
    assert e["llama_cpp"]["name"] == "llama.cpp (llama-cpp-python, avx2)"
    if has_hf:
        hf = e["hf"]
        assert hf["status"] == "ok", hf
        assert hf["prefill_tokens_per_s"] > 0 and hf["decode_tokens_per_s"] > 0 and hf["context_decode"] == []
        assert hf["kvlm_over_this"]["decode_tokens_per_s"] > 0 and "whole_process_s" not in hf
    else:
        assert e["hf"] == {"name": "HF transformers (float32)", "status": "skipped",
                           "reason": "ImportError: transformers is not installed"}
    assert e["llama_cpp"]["kvlm_over_this"]["decode_at_24"] > 0
    # the decode ceiling next to llama.cpp's decode (the read bandwidth timed by it over the file's bytes a
    # step reads) and how far over llama.cpp's decode it is
    p = e["llama_cpp"]
    ceiling = p["decode_ceiling_tokens_per_s"]
    assert ceiling == pytest.approx(p["read_bandwidth_gb_per_s"] * 1e9 / d["file_decode_bytes"])
    assert p["decode_weight_bytes"] == d["file_decode_bytes"]
    assert p["ceiling_over_this"] == pytest.approx(ceiling / p["decode_tokens_per_s"])
    assert all(e[key]["read_bandwidth_gb_per_s"] > 0 for key in ("kvlm", "kvlm_float32", "llama_cpp"))
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    inits = [c for c in calls if "init" in c]
    assert len(inits) == 2  # one measuring process, one whole-process run
    assert all(c["init"] == str(tiny_gguf) and c["kw"]["n_threads"] == 2 and c["kw"]["n_threads_batch"] == 2
               and c["kw"]["flash_attn"] and c["lib"] is None for c in inits)
    evals = [tuple(c["eval"]) for c in calls if "eval" in c]
    assert (0, 16) in evals and (0, 24) in evals  # prefill and a context: the whole prompt on a fresh context
    assert (8, 1) in evals and (24, 1) in evals  # decode: one token at a time after the prompt
    png = tmp_path / "ctx.png"
    compare.plot(d, str(png))
    assert_png(png)

    # llama-cpp-python absent: a skipped column, not an error; same through the CLI
    d, table = cli_json(capsys, ["-q", "bench", "compare", str(tiny_gguf), "--prompt-len", "16",
                                 "--decode-prompt-len", "8", "--gen-tokens", "4", "--repeats", "1", "--contexts", "12",
                                 "--context-gen", "3", "--no-whole-process", "--llama-python", "/bin/false"])
    assert d["engines"]["llama_cpp"]["status"] == "skipped" and "llama_cpp" in d["engines"]["llama_cpp"]["reason"]
    assert "skipped" in table and "kvlm / kvlm (--dtype float32" in table


def test_compare_loads_llama_cpp_libraries_from_llama_lib(tiny_gguf: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`--llama-lib DIR`: every llama.cpp process (the measuring one and the whole-process run) gets
    LLAMA_CPP_LIB_PATH=DIR, which makes llama-cpp-python load a llama.cpp built for another ISA; a folder
    without libllama.so is one readable error."""
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    lib = tmp_path / "avx2-lib"
    lib.mkdir()
    (lib / "libllama.so").write_bytes(b"")
    log = tmp_path / "llama.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake'}:{Path(__file__).parents[2]}")
    d, _ = cli_json(capsys, ["-q", "bench", "compare", str(tiny_gguf), "--prompt-len", "16", "--decode-prompt-len",
                             "8", "--gen-tokens", "4", "--repeats", "1", "--contexts", "12", "--context-gen", "3",
                             "--no-reference", "--llama-python", sys.executable, "--llama-lib", str(lib)])
    assert d["engines"]["llama_cpp"]["status"] == "ok" and d["engines"]["llama_cpp"]["isa"] == "avx2"
    inits = [json.loads(x) for x in log.read_text().splitlines() if '"init"' in x]
    assert len(inits) == 2 and all(c["lib"] == str(lib.resolve()) for c in inits)

    assert main(["-q", "bench", "compare", str(tiny_gguf), "--llama-lib", str(tmp_path)]) == 2
    assert "--llama-lib: no libllama.so in" in capsys.readouterr().err


def test_llama_isa_reads_the_build_s_system_info() -> None:
    from kvlm.bench.compare import llama_isa

    assert llama_isa("CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 |") == "avx512-vnni"
    assert llama_isa("CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 0 |") == "avx512"
    assert llama_isa("CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 |") == "avx512-amx"
    assert llama_isa("CPU : AVX = 1 | AVX2 = 1 | AVX512 = 0 |") == "avx2"
    assert llama_isa("CPU : AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | AVX512 = 0 |") == "avx2-vnni"
    assert llama_isa("CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 |") == "neon-dotprod"
    assert llama_isa("") == "unknown"


def test_compare_several_files_in_one_run(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--gguf A B`: a full run per file, then one summary line per file; a missing file is one readable error."""
    from tiny_models import write_tiny_gguf

    q8 = write_tiny_gguf(tmp_path / "tiny-q8.gguf", tensor_type="Q8_0")
    args = ["-q", "bench", "compare", "--gguf", str(tiny_gguf), str(q8), "--prompt-len", "16", "--decode-prompt-len",
            "8", "--gen-tokens", "4", "--repeats", "1", "--contexts", "12", "--context-gen", "3", "--no-whole-process",
            "--no-llama-cpp", "--no-reference"]
    d, table = cli_json(capsys, args)
    assert_header(d, "compare")
    assert [f["model_file"] for f in d["files"]] == ["tiny.gguf", "tiny-q8.gguf"]
    assert all("kvlm_float32" not in f["engines"] for f in d["files"])  # --no-reference
    assert all(f["engines"]["kvlm"]["decode_tokens_per_s"] > 0 for f in d["files"])
    summary = table.split("summary, 2 threads")[1].splitlines()
    assert summary[2].startswith("tiny.gguf") and summary[3].startswith("tiny-q8.gguf")
    assert main([*args[:4], str(tmp_path / "nope.gguf")]) == 2
    assert "--gguf: no such file" in capsys.readouterr().err


# ------------------------------------------------------------------------------ docs/benchmarks.md


def test_make_benchmarks_md_copies_only_numbers_from_results(tiny_gguf: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("make_benchmarks_md",
                                                  Path(__file__).parents[2] / "scripts" / "make_benchmarks_md.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)

    monkeypatch.chdir(tmp_path)  # bench_all.sh runs from the repository root with relative paths
    results = Path("docs/results")
    results.mkdir(parents=True)
    commands = {"invariance": ["-q", "bench", "invariance", str(tiny_gguf), "--prompt-len", "8", "--extra-len", "4",
                               "--plot", "docs/img/invariance.png"],
                "kv_size": ["kv-size", "--config", str(CONFIGS / "SmolLM2-135M.json"),
                            "--compare-known", "--plot", "docs/img/kv_size.png"]}
    for name, argv in commands.items():
        assert main(argv) == 0
        (results / f"{name}.txt").write_text("$ kvlm " + " ".join(argv) + "\n" + capsys.readouterr().out)
    assert mod.main([]) == 0
    md = Path("docs/benchmarks.md").read_text()
    inv = (results / "invariance.txt").read_text().splitlines()
    assert "$ kvlm -q bench invariance" in md and inv[1] in md and inv[-2] in md  # command and table verbatim
    doc = json.loads(inv[-1])
    assert f"date: {doc['date']}; CPU: {doc['cpu']}; threads: {doc['threads']}" in md
    assert "![" in md and "(img/invariance.png)" in md and "(img/kv_size.png)" in md
    assert "waste.txt` is missing" in md  # not run: said, not invented
    sources = "".join(f.read_text() for f in results.iterdir())
    for num in set(re.findall(r"\d+(?:\.\d+)?", md)):
        assert num in sources, f"{num} in benchmarks.md is not in the results"


# -------------------------------------------------------------------------------------- structured


def test_structured(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d, table = cli_json(capsys, ["-q", "bench", "structured", str(tiny_gguf), "--batches", "1", "3",
                                 "--gen-tokens", "8", "--repeats", "1", "--properties", "30"])
    assert_header(d, "structured")
    assert [r["batch"] for r in d["rows"]] == [1, 3] and d["compile_properties"] == 30
    for r in d["rows"]:
        assert r["free_tokens_per_s"] > 0 and r["constrained_tokens_per_s"] > 0 and r["ratio"] > 0
        assert r["mask_fill_us_per_step"] > 0 and r["mask_apply_us_per_step"] >= 0
    assert d["compile_ms"] > 0 and d["tokenizer_build_ms"] > 0 and "JSON tok/s" in table


def test_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_models import tiny_config, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny-1k.gguf", tiny_config(max_position_embeddings=1024))  # byte prompts
    png, draft = tmp_path / "spec.png", f"draft:{path}"  # the model itself as its draft
    d, table = cli_json(capsys, ["-q", "bench", "spec", str(path), "--max-tokens", "12", "--workloads", "extract",
                                 "chat", "--repeats", "1", "--methods", "ngram", "suffix", draft, "--plot", str(png)])
    assert_header(d, "spec")
    methods = ("off", "ngram", "suffix", draft)
    assert d["methods"] == list(methods)
    got = [(r["workload"], r["method"]) for r in d["results"]]
    assert got == [(w, m) for w in ("extract", "chat") for m in methods]
    assert d["identical"] and all(r["output_tokens"] == 12 for r in d["results"])
    assert sum(r.get("accepted_tokens", 0) for r in d["results"]) > 0 and "identical" in table
    greedy_self = [r for r in d["results"] if r["method"] == draft]  # greedy, its own draft: every draft kept
    assert all(r["draft_tokens"] > 0 and r["acceptance"] == 1.0 for r in greedy_self), greedy_self
    assert "draft:tiny-1k.gguf" in table and d["plot"] == str(png)
    assert_png(png)


def test_throughput_with_speculation(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvlm bench throughput --speculative ngram`: the batched run drafts (the tiny model repeats itself)
    and reports its drafts and acceptance; without the flag there is no such entry."""
    argv = ["-q", "bench", "throughput", str(tiny_gguf), "--num-prompts", "4", "--max-num-seqs", "4",
            "--input-len", "8", "16", "--output-len", "24", "32", "--no-sequential", "--no-hf"]
    d, table = cli_json(capsys, [*argv, "--speculative", "ngram", "--num-speculative-tokens", "3"])
    s = d["kvlm_batched"]["speculative"]
    assert s["method"] == "ngram" and s["num_speculative_tokens"] == 3
    assert 0 < s["num_accepted_tokens"] <= s["num_draft_tokens"] and "acceptance" in table
    off, _ = cli_json(capsys, argv)
    assert "speculative" not in off["kvlm_batched"]
    assert off["output_tokens"] == d["output_tokens"]

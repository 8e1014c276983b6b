"""Tests for the `kvlm` command line, run for real as `python -m kvlm` subprocesses on a tiny GGUF.

`KVLM_HOME` points to an empty temporary folder, so nothing is ever downloaded. Every command of this
module is started once, up front, on a small process pool (each pays ~2 s of imports); the tests then
read their finished results.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiny_models import VOCAB, random_state_dict, tiny_config

IM_START = VOCAB - 3  # <|im_start|> in the tiny byte-level vocab
EOS = VOCAB - 2  # <|im_end|>
LONG_PROMPT = "hello world, this prompt is far longer than eight tokens"
PLAIN_PROMPTS = ["hello", "world", "foo bar"]
NOTES = "First line of my notes.\n\nA second paragraph, with ü and a tab\t.\n"  # -f, stdin: one prompt
JSONL_PROMPTS: list[dict[str, Any]] = [{"prompt": "foo bar"}, {"prompt_token_ids": [1, 2, 3]}, {"prompt": "hello"}]

# Llama-3-8B shapes: 32 layers, 32 query heads, 8 KV heads, head_dim 4096 / 32 = 128.
LLAMA3_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0}


def commands(model: Path, files: dict[str, Path]) -> dict[str, list[str]]:
    """Every kvlm invocation of this module, by name (arguments after `python -m kvlm`)."""
    m = str(model)
    gen = ["-q", "generate", m]
    sample = ["--temperature", "1.5", "--ignore-eos", "--max-tokens", "16", "--json"]
    return {
        "json": gen + ["hello", "--max-tokens", "8", "--json"],
        "no_kv_cache": gen + ["hello", "--max-tokens", "8", "--json", "--no-kv-cache"],
        "seed3": gen + ["hello", *sample, "--seed", "3"],
        "seed3_again": gen + ["hello", *sample, "--seed", "3"],
        "seed4": gen + ["hello", *sample, "--seed", "4"],
        "chat": gen + ["hello", "--chat", "--max-tokens", "4", "--json"],
        "stream_stats": ["generate", m, "hello", "--max-tokens", "8", "--stats"],  # not -q: logs go to stderr
        "prompts_plain": gen + ["--prompts-file", str(files["plain"]), "--max-tokens", "4"],
        "prompts_jsonl": gen + ["--prompts-file", str(files["jsonl"]), "--max-tokens", "4", "--json"],
        "info": ["-q", "info", m, "--json"],
        "kv_json": ["kv-size", "--config", str(files["config"]), "--context", "1024", "--batch", "2",
                    "--dtype", "float16", "--json"],
        "kv_text": ["kv-size", "--config", str(files["config"]), "--context", "1024", "--batch", "2",
                    "--dtype", "float16"],
        "kv_default": ["kv-size", "--config", str(files["config"]), "--context", "1024", "--json"],
        "kv_default_text": ["kv-size", "--config", str(files["config"]), "--context", "1024"],
        "kv_tiny_default": ["-q", "kv-size", m, "--json"],
        "help": ["--help"],
        # user errors
        "err_missing": gen[:2] + [str(files["missing"]), "hi"],
        "err_truncated": gen[:2] + [str(files["truncated"]), "hi"],
        "err_alias": gen[:2] + ["nosuchalias", "hi"],
        "err_temperature": gen + ["hi", "--temperature", "-1"],
        "err_top_p": gen + ["hi", "--top-p", "0"],
        "err_too_long": gen + [LONG_PROMPT, "--max-model-len", "8"],
        "err_kv_memory": gen + ["hi", "--kv-cache-memory", "lots"],
        "err_unknown_flag": gen + ["hi", "--no-such-flag"],
        **{name: (["-q", *args[:1], m, *args[1:]] if args and args[0] == "generate" else args)
           for name, (args, _, _) in BAD_INPUT.items()},
        "options_between_model_and_prompt": ["-q", "generate", m, "--max-tokens", "3", "hello", "--json"],
        "options_everywhere": ["-q", "generate", "--max-tokens", "3", m, "--json", "hello", "--seed", "1"],
        "tiny_temperature": gen + ["hello", "--temperature", "1e-40", "--max-tokens", "3", "--json"],
        "err_truncated_header": gen[:2] + [str(files["truncated_header"]), "hi"],
        "choice": gen + ["hi", "--choice", "left", "--choice", "right", "--temperature", "1", "--json"],
        "regex": gen + ["hi", "--regex", "[0-9]{3}", "--json"],
        "json_schema": gen + ["hi", "--json-schema", '{"type":"object","properties":{"a":{"enum":[1,2]}},'
                              '"required":["a"],"additionalProperties":false}', "--json"],
        "grammar": gen + ["hi", "--grammar", str(files["grammar"]), "--json"],
        "json_schema_file_stream": ["-q", "generate", m, "hi", "--json-schema", str(files["schema"])],
        # one document as one prompt: piped, `-`, -f / --prompt-file (stdin from files["notes"]: STDIN)
        "inline_notes": gen + [NOTES, "--max-tokens", "2", "--json"],
        "stdin_pipe": gen + ["--max-tokens", "2", "--json"],
        "stdin_dash": gen + ["-", "--max-tokens", "2", "--json"],
        "prompt_file": gen + ["-f", str(files["notes"]), "--max-tokens", "2", "--json"],
        "prompt_file_long": ["-q", "generate", "--prompt-file", str(files["notes"]), m, "--max-tokens", "2", "--json"],
        "err_prompt_and_file": gen + ["hi", "-f", str(files["notes"])],
        # global flags after the subcommand; the KV-pool line only with -v
        "plain": ["generate", m, "hello", "--max-tokens", "3"],
        "quiet_after": ["generate", m, "hello", "--max-tokens", "3", "-q"],
        "verbose_after": ["generate", m, "hello", "--max-tokens", "3", "--verbose"],
        "bounded": gen + ["the quick brown fox " * 6, "--max-model-len", "64", "--block-size", "4", "--max-kv-tokens",
                          "32", "--max-tokens", "40", "--ignore-eos", "--json"],
    }


# The bad-input table: name -> (arguments, with "generate" put before the tiny model's path; exit code;
# words the one `kvlm: error:` line must hold). Every case once crashed with a traceback or misled.
BAD_INPUT: dict[str, tuple[list[str], int, list[str]]] = {
    "no_prompt_after_path": (["generate", "--max-tokens", "3"], 2, ["PROMPT", "tiny.gguf"]),
    "kv_memory_inf": (["generate", "hi", "--kv-cache-memory", "inf"], 2, ["--kv-cache-memory", "inf"]),
    "kv_memory_bare_fraction": (["generate", "hi", "--kv-cache-memory", "1.5"], 2, ["bytes", "whole"]),
    "kv_memory_one_byte": (["generate", "hi", "--kv-cache-memory", "1"], 2, ["--kv-cache-memory", "1 B"]),
    "kv_memory_most_of_ram": (["generate", "hi", "--kv-cache-memory", "95%"], 2, ["90%", "available"]),
    "threads_negative": (["generate", "hi", "--threads", "-1"], 2, ["--threads", "-1"]),
    "device_unknown": (["generate", "hi", "--device", "foo"], 2, ["device", "foo"]),
    "max_model_len_too_big": (["generate", "hi", "--max-model-len", "100000000"], 2,
                              ["--max-model-len", "100000000", "256"]),
    "seed_overflow": (["generate", "hi", "--seed", "99999999999999999999999"], 2, ["seed"]),
    "stop_token_outside_vocab": (["generate", "hi", "--stop-token-ids", "99999999"], 2,
                                 ["--stop-token-ids", "99999999", "264"]),
    "bad_regex": (["generate", "hi", "--regex", "[0-9"], 2, ["--regex", "invalid regex"]),
    "bad_schema_text": (["generate", "hi", "--json-schema", "{nope"], 2, ["--json-schema", "not a JSON schema"]),
    "bad_schema": (["generate", "hi", "--json-schema", '{"type": "nonsense"}'], 2, ["--json-schema", "invalid"]),
    "two_constraints": (["generate", "hi", "--regex", "a", "--choice", "b"], 2, ["--choice", "one of"]),
    "missing_grammar": (["generate", "hi", "--grammar", "no-such.lark"], 2, ["--grammar", "no-such.lark"]),
    "constraint_and_ignore_eos": (["generate", "hi", "--regex", "a", "--ignore-eos"], 2, ["--regex", "--ignore-eos"]),
    "temperature_inf": (["generate", "hi", "--temperature", "inf"], 2, ["--temperature", "inf"]),
    "too_many_words": (["generate", "hello", "world"], 2, ["PROMPT", "quote"]),
    "max_kv_tokens_not_a_block_multiple": (["generate", "hi", "--max-kv-tokens", "30"], 2,
                                           ["--max-kv-tokens", "multiple of the block size"]),
}


@pytest.fixture(scope="session")
def kvlm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty KVLM_HOME (no models: nothing can be downloaded into it unseen), whose ext/ is this
    machine's kernel build folder, so the commands do not each wait for a fresh build of the kernels
    (keyed by their sources, compiler and torch: never a stale one)."""
    from kvlm.paths import kvlm_home as real_home

    home = tmp_path_factory.mktemp("kvlm_home")
    (real_home() / "ext").mkdir(parents=True, exist_ok=True)
    (home / "ext").symlink_to(real_home() / "ext", target_is_directory=True)
    return home


@pytest.fixture(scope="session")
def cli_files(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    data = tiny_gguf.read_bytes()
    (d / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (d / "truncated_header.gguf").write_bytes(data[:700])  # cut inside the metadata (the token list)
    (d / "prompts.txt").write_text("\n".join(PLAIN_PROMPTS) + "\n\n")  # a blank line is skipped
    (d / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in JSONL_PROMPTS) + "\n")
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    (d / "notes.txt").write_bytes(NOTES.encode())
    (d / "query.lark").write_text('start: "SELECT " /[a-z]{1,5}/ " FROM t"\n')
    (d / "schema.json").write_text(json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "minItems": 2, "maxItems": 2}))
    return {"grammar": d / "query.lark", "schema": d / "schema.json",
            "truncated": d / "truncated.gguf", "truncated_header": d / "truncated_header.gguf",
            "plain": d / "prompts.txt", "jsonl": d / "prompts.jsonl",
            "config": d / "config.json", "missing": d / "missing.gguf", "notes": d / "notes.txt"}


STDIN = {"stdin_pipe", "stdin_dash"}  # commands whose stdin is the notes file (every other one: /dev/null)


def _run(args: list[str], home: Path, stdin: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVLM_HOME": str(home), "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    with open(stdin or os.devnull, "rb") as f:
        return subprocess.run([sys.executable, "-m", "kvlm", *args], capture_output=True, text=True, env=env,
                              cwd=home, timeout=300, stdin=f)


@pytest.fixture(scope="session")
def runs(tiny_gguf: Path, cli_files: dict[str, Path], kvlm_home: Path):
    """name -> finished CompletedProcess; all commands start at once on a small pool."""
    pool = ThreadPoolExecutor(max_workers=max(3, min(8, os.cpu_count() or 1)))  # imports wait on I/O too
    futures: dict[str, Future] = {name: pool.submit(_run, args, kvlm_home,
                                                    cli_files["notes"] if name in STDIN else None)
                                  for name, args in commands(tiny_gguf, cli_files).items()}

    def result(name: str) -> subprocess.CompletedProcess[str]:
        return futures[name].result()

    result.names = list(futures)  # type: ignore[attr-defined]
    yield result
    pool.shutdown(wait=True, cancel_futures=True)


def ok_json(p: subprocess.CompletedProcess[str]) -> Any:
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    return json.loads(p.stdout)  # exactly one JSON document


@pytest.fixture(scope="session")
def api_greedy(tiny_gguf: Path):
    """In-process greedy outputs of the same model, to check that the CLI only wraps the library."""
    from kvlm.llm import LLM
    from kvlm.sampling_params import SamplingParams

    llm = LLM(str(tiny_gguf), num_threads=2)

    def go(prompt: str | dict[str, Any], max_tokens: int) -> Any:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return out[0].outputs[0]

    return go


# ----------------------------------------------------------------------------------------- generate


def test_generate_json(runs, api_greedy) -> None:
    doc = ok_json(runs("json"))
    assert {"text", "token_ids", "finish_reason", "prompt_token_ids", "stats"} <= set(doc)
    ids = doc["token_ids"]
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in ids)
    if doc["finish_reason"] == "length":
        assert len(ids) == 8
    else:
        assert doc["finish_reason"] == "stop" and len(ids) <= 8 and ids[-1] == EOS
    assert isinstance(doc["text"], str)
    assert doc["stats"]["generated_tokens"] == len(ids)
    assert doc["stats"]["prompt_tokens"] == len(doc["prompt_token_ids"])
    assert ids == api_greedy("hello", 8).token_ids


def test_bounded_cache_runs_past_the_context(runs) -> None:
    """--max-kv-tokens: a 120-token prompt and 40 new tokens in a 64-token context, on 32 tokens of K/V."""
    doc = ok_json(runs("bounded"))
    assert len(doc["prompt_token_ids"]) > 64 and len(doc["token_ids"]) == 40 and doc["finish_reason"] == "length"
    assert doc["stats"]["kv_evicted_tokens"] > len(doc["prompt_token_ids"]) + 40 - 32 - 8


def test_no_kv_cache_gives_the_same_tokens(runs) -> None:
    assert ok_json(runs("no_kv_cache"))["token_ids"] == ok_json(runs("json"))["token_ids"]


def test_seeded_sampling_is_reproducible(runs) -> None:
    a, b, c = (ok_json(runs(n)) for n in ("seed3", "seed3_again", "seed4"))
    assert len(a["token_ids"]) == 16 and a["finish_reason"] == "length"  # --ignore-eos
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert len(set(a["token_ids"])) > 1  # really sampled (this tiny model's greedy output repeats one token)
    assert c["token_ids"] != a["token_ids"]


def test_chat_applies_the_template(runs) -> None:
    doc = ok_json(runs("chat"))
    prompt = doc["prompt_token_ids"]
    assert prompt[0] == IM_START
    assert prompt.count(IM_START) == 2  # the user turn and the assistant generation prompt
    assert EOS in prompt  # <|im_end|> closes the user turn


def test_streaming_prints_text_and_stats(runs) -> None:
    p = runs("stream_stats")
    assert p.returncode == 0, p.stderr
    assert p.stdout == ok_json(runs("json"))["text"] + "\n"  # only the generated text on stdout
    assert "Traceback" not in p.stderr
    stats = [ln for ln in p.stderr.splitlines() if ln.startswith("kvlm: prompt tokens")]
    assert len(stats) == 1, p.stderr
    assert "generated" in stats[0] and "TTFT" in stats[0] and "tok/s" in stats[0]


@pytest.mark.parametrize("name", ["stdin_pipe", "stdin_dash", "prompt_file", "prompt_file_long"])
def test_a_document_is_one_prompt(runs, name: str) -> None:
    """`cat notes | kvlm generate`, `kvlm generate - < notes`, `-f notes`: the whole file, newlines and all,
    is one prompt (the same as that text given as PROMPT), not one prompt a line."""
    doc, inline = ok_json(runs(name)), ok_json(runs("inline_notes"))
    assert doc["prompt_token_ids"] == inline["prompt_token_ids"] and doc["token_ids"] == inline["token_ids"]
    assert len(doc["prompt_token_ids"]) > len(NOTES) // 2  # byte-level vocab: the whole text, not a line


def test_prompt_and_prompt_file_is_one_error(runs) -> None:
    p = runs("err_prompt_and_file")
    assert p.returncode == 2 and "--prompt-file" in one_error_line(p)


def test_global_flags_after_the_subcommand_and_no_pool_line_by_default(runs) -> None:
    plain, quiet, verbose = runs("plain"), runs("quiet_after"), runs("verbose_after")
    for p in (plain, quiet, verbose):
        assert p.returncode == 0, p.stderr
        assert p.stdout == plain.stdout and p.stdout.strip()
    assert "KV cache" not in plain.stderr and "reserved" not in plain.stderr, plain.stderr
    assert quiet.stderr == ""
    assert "KV cache (paged):" in verbose.stderr and "MiB reserved" in verbose.stderr


def test_prompts_file_plain_lines(runs, api_greedy) -> None:
    p = runs("prompts_plain")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()  # plain mode: one line of text per prompt, in input order
    assert lines == [api_greedy(q, 4).text.replace("\n", "\\n") for q in PLAIN_PROMPTS]
    assert len(set(lines)) == 3  # distinct outputs, so the order check means something


def test_prompts_file_jsonl(runs, api_greedy) -> None:
    p = runs("prompts_jsonl")
    assert p.returncode == 0, p.stderr
    docs = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert len(docs) == 3
    expected = [api_greedy(q.get("prompt", q), 4).token_ids for q in JSONL_PROMPTS]
    assert [d["token_ids"] for d in docs] == expected
    assert len({tuple(e) for e in expected}) == 3  # distinct outputs, so the order check means something


# ------------------------------------------------------------------------------------ info, kv-size


def test_info_json(runs) -> None:
    doc = ok_json(runs("info"))
    cfg = tiny_config()
    assert doc["architecture"] == "LlamaForCausalLM"
    assert (doc["layers"], doc["hidden_size"], doc["attention_heads"], doc["kv_heads"], doc["head_dim"]) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["head_dim"])
    assert doc["vocab_size"] == VOCAB
    assert doc["context_length"] == cfg["max_position_embeddings"]
    assert doc["parameters"] == sum(t.numel() for t in random_state_dict(cfg).values())  # tied: embeddings once
    per_tok = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
    assert doc["kv_bytes_per_token_fp32"] == per_tok * 4
    assert doc["kv_bytes_per_token_fp16"] == per_tok * 2
    # The pool the default flags reserve (what `-v` logs when an engine starts): 16 sequences at full context.
    assert doc["kv_pool_bytes"] == 16 * cfg["max_position_embeddings"] * per_tok * 4
    assert doc["model"].endswith("tiny.gguf")


def test_kv_size_json(runs) -> None:
    doc = ok_json(runs("kv_json"))
    layers, kv, heads, hd = 32, 8, 32, 128
    per_tok = 2 * layers * kv * hd * 2
    assert (doc["layers"], doc["kv_heads"], doc["attention_heads"], doc["head_dim"]) == (layers, kv, heads, hd)
    assert doc["bytes_per_token"] == per_tok == 131072
    assert doc["total_bytes"] == per_tok * 1024 * 2
    assert doc["mha_bytes_per_token"] == 2 * layers * heads * hd * 2
    assert doc["mha_total_bytes"] == doc["mha_bytes_per_token"] * 1024 * 2
    assert doc["gqa_saving"] == pytest.approx(0.75)
    assert (doc["dtype"], doc["context"], doc["batch"]) == ("float16", 1024, 2)


def test_kv_size_text(runs) -> None:
    p = runs("kv_text")
    assert p.returncode == 0, p.stderr
    assert "GQA saves 75%" in p.stdout
    assert "131,072 B" in p.stdout  # per token
    assert f"{131072 * 1024 * 2:,} B" in p.stdout  # 2 x 1024 tokens


def test_kv_size_text_names_the_dtype(runs) -> None:
    p = runs("kv_text")
    want = "dtype:            float16, as --kv-cache-dtype float16 stores it (the engine's default is float32)"
    assert want in p.stdout


def test_kv_size_defaults_to_the_engines_kv_dtype(runs, tiny_gguf) -> None:
    doc = ok_json(runs("kv_default"))
    assert (doc["dtype"], doc["engine_default_dtype"]) == ("float32", "float32")
    assert doc["bytes_per_token"] == 2 * 32 * 8 * 128 * 4  # Llama-3-8B in float32
    p = runs("kv_default_text")
    assert p.returncode == 0, p.stderr
    assert "x 4 B" in p.stdout and "262,144 B" in p.stdout
    assert "float32, the engine's default KV cache dtype" in p.stdout
    # The default sizes the pool the engine really makes with its default config.
    from kvlm.engine.engine import Engine

    engine = Engine(tiny_gguf, quiet=True)
    assert ok_json(runs("kv_tiny_default"))["bytes_per_token"] == engine.kv_bytes_per_token
    assert str(engine.kv_cache_dtype) == "torch." + doc["engine_default_dtype"]


def test_help(runs) -> None:
    p = runs("help")
    assert p.returncode == 0
    for word in ("generate", "chat", "info", "kv-size", "pull"):
        assert word in p.stdout


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name, code, words", [
    ("err_missing", 1, ["missing.gguf", "no such file"]),
    ("err_truncated", 1, ["truncated.gguf", "truncated"]),
    ("err_alias", 1, ["nosuchalias", "smollm2-135m"]),
    ("err_temperature", 2, ["--temperature"]),
    ("err_top_p", 2, ["--top-p"]),
    ("err_too_long", 2, ["prompt", "8"]),
    ("err_kv_memory", 2, ["--kv-cache-memory", "lots"]),
])
def test_user_errors_print_one_line(runs, name: str, code: int, words: list[str]) -> None:
    p = runs(name)
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvlm: error:")
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert p.stdout == ""


def test_unknown_flag_is_a_usage_error(runs) -> None:
    p = runs("err_unknown_flag")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.splitlines() == [("kvlm: error: unrecognized arguments: --no-such-flag "
                                      "(see `kvlm generate --help`)")]
    assert p.stdout == ""


def one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlm: error: "), p.stderr
    assert p.stdout == ""
    return lines[0]


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_table(runs, name: str) -> None:
    """Each bad input gives exactly one `kvlm: error:` line naming what is wrong, and the right exit code."""
    _, code, words = BAD_INPUT[name]
    p = runs(name)
    assert p.returncode == code, (p.returncode, p.stderr)
    line = one_error_line(p)
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize(("args", "words"), [
    (["--temperature", "nan"], ["--temperature", "nan"]),
    (["--top-k", "-5"], ["--top-k", "-5"]),
    (["--min-p", "2"], ["--min-p"]),
    (["--max-tokens", "0"], ["--max-tokens must be a positive integer, got 0"]),
    (["--logprobs", "99"], ["--logprobs", "99"]),
    (["--block-size", "0"], ["--block-size"]),
    (["--threads", "two"], ["--threads", "two"]),
    (["--max-model-len", "0"], ["--max-model-len"]),
    (["--kv-cache-memory", "999999TiB"], ["90%", "available"]),
    (["--kv-cache-memory", "0.3"], ["bare number is bytes", "30%"]),
    (["--device", "cuda:x"], ["--device", "cuda:x"]),
    (["--speculative", "eagle"], ["--speculative", "eagle"]),
    (["--speculative", "draft:"], ["--speculative", "draft:PATH"]),
    (["--speculative", "draft:/no/such/model.gguf"], ["draft model", "/no/such/model.gguf"]),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], ["num_speculative_tokens"]),
])
def test_more_bad_values_in_process(tiny_gguf: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                    words: list[str]) -> None:
    """The same contract through `kvlm.cli.main.main` (cheaper than a process per case): exit 2, one line."""
    from kvlm.cli.main import main

    try:
        code = main(["-q", "generate", str(tiny_gguf), "hi", *args])
    except SystemExit as e:  # argparse's own errors exit from inside parse_known_args
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlm: error: ") and out == "", err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_speculative_decoding_same_text_and_acceptance_in_stats(tiny_gguf: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`--speculative suffix` and `draft:PATH` (the model itself as its draft) print the same text as without
    it, and the stats line counts the drafts."""
    from kvlm.cli.main import main

    args = ["generate", str(tiny_gguf), "ab ab ab ab", "--max-tokens", "12", "--ignore-eos", "--stats"]
    assert main(args) == 0
    plain_out, plain_err = capsys.readouterr()
    assert "drafts accepted" not in plain_err
    for method in ("suffix", f"draft:{tiny_gguf}"):
        assert main([*args, "--speculative", method, "--num-speculative-tokens", "3"]) == 0
        out, err = capsys.readouterr()
        assert out == plain_out, method
        assert re.search(r"drafts accepted [1-9]\d*/\d+", err), err
        # --check-exact with speculation: the speculating engine against a recompute that never speculates
        assert main([*args, "--speculative", method, "--num-speculative-tokens", "3", "--check-exact"]) == 0
        out, err = capsys.readouterr()  # (the same request as above, which accepted drafts)
        assert "kvlm: bit-identical on 12 tokens" in out, (out, err)


def test_truncated_metadata_names_no_numpy_internals(runs) -> None:
    """A file cut inside its metadata fails with a plain sentence, not the reader's numpy errors."""
    p = runs("err_truncated_header")
    assert p.returncode == 1
    line = one_error_line(p)
    assert "truncated_header.gguf" in line and "truncated" in line
    for internal in ("dtype", "numpy", "ValueError", "buffer"):
        assert internal not in line, line


def test_cuda_without_cuda_is_one_line(tiny_gguf: Path, kvlm_home: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    p = _run(["-q", "generate", str(tiny_gguf), "hi", "--device", "cuda"], kvlm_home)
    assert p.returncode == 2
    assert "CUDA is not available" in one_error_line(p)


def test_options_work_anywhere_on_the_line(runs) -> None:
    """Options between MODEL and PROMPT, or before MODEL, parse as in any other position."""
    a = ok_json(runs("options_between_model_and_prompt"))
    assert a["prompt_token_ids"] == ok_json(runs("json"))["prompt_token_ids"] and len(a["token_ids"]) <= 3
    b = ok_json(runs("options_everywhere"))
    assert b["prompt_token_ids"] == a["prompt_token_ids"] and len(b["token_ids"]) <= 3


def test_tiny_temperature_is_greedy(runs) -> None:
    """A temperature below 1e-5 decodes greedily (vLLM), instead of overflowing into NaN probabilities."""
    assert ok_json(runs("tiny_temperature"))["token_ids"] == ok_json(runs("json"))["token_ids"][:3]


def test_nothing_was_downloaded(runs, kvlm_home: Path) -> None:
    for name in runs.names:  # wait for every command, including the unknown alias
        runs(name)
    assert not (kvlm_home / "models").exists()


def test_structured_output_flags(runs) -> None:
    assert ok_json(runs("choice"))["text"] in ("left", "right")
    assert re.fullmatch("[0-9]{3}", ok_json(runs("regex"))["text"])
    assert json.loads(ok_json(runs("json_schema"))["text"])["a"] in (1, 2)
    assert re.fullmatch("SELECT [a-z]{1,5} FROM t", ok_json(runs("grammar"))["text"])
    p = runs("json_schema_file_stream")
    assert p.returncode == 0, p.stderr
    pair = json.loads(p.stdout)
    assert len(pair) == 2 and all(0 <= x <= 9 for x in pair)

"""`kvlm bench structured`: what a JSON-schema constraint costs. Decode tokens/s of a batch with and without
the constraint (batch 1 and 16 by default) on two engines that step in turn, so each pair of steps sees the
same machine load. Two ratios, each the median over rounds: of each round's median paired step ratio (free
step time / constrained step time), and of its throughput ratio (free decode time / constrained decode
time, which counts cheap and dear steps alike, as tokens/s does). Also grammar compile time for a
30-property schema, and the mask's time per step replayed. Greedy by default, so the mask is the only
difference; `--temperature 0.7` measures sampling, whose per-token noise costs both sides alike.

The schema asks for a long array of records, so every constrained request runs to `--gen-tokens` like the
unconstrained ones (whose EOS is ignored): both decode the same number of tokens. Usage:
`kvlm bench structured [MODEL]` or `python -m kvlm.bench.structured`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, log, run_header, standalone, step_in_turn

RECORDS = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}}
PROMPT = "List people as JSON records with their name, age, city and tags:\n"


def wide_schema(n: int, salt: int) -> dict[str, Any]:
    """An object of n properties of mixed types (`salt` renames them, so no compile is a cache hit)."""
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "string"}}, {"enum": ["a", "b", "c"]},
             {"anyOf": [{"type": "string"}, {"type": "null"}]}]
    props = {f"field_{salt}_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _paired(free_llm: Any, con_llm: Any, ids: list[int], batch: int, gen_tokens: int,
            temperature: float = 0.0) -> tuple[list[float], list[float], list[str]]:
    """`batch` requests without a constraint on one engine and `batch` with it on another, decoding side by
    side: one engine's step, then the other's, so each pair of steps sees the same machine (the machines
    here are shared: load moves a step by more than the mask costs, from one second to the next). Returns
    each engine's decode step times (once every request has its first token) and the constrained texts."""
    from kvlm.sampling_params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=RECORDS)
    runs = []
    for llm, constrained in ((free_llm, False), (con_llm, True)):
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=gen_tokens,
                                 ignore_eos=not constrained, structured_outputs=so if constrained else None)
                  for i in range(batch)]
        eng = llm.llm_engine
        runs.append((eng, [eng.add_request(list(ids), p) for p in params]))
    free, cons = step_in_turn(runs)
    assert all(r.num_output_tokens == gen_tokens for _, reqs in runs for r in reqs), \
        "every request must decode gen_tokens tokens"
    return free, cons, [r.text for r in runs[1][1]]


def _mask_times(llm: Any, texts: list[str], batch: int) -> dict[str, float]:
    """Per step, microseconds: filling the bitmask rows of `batch` matchers (on one thread, as the
    engine fills them), and applying them to (batch, V) logits in place; replayed over the
    constrained outputs' own tokens."""
    from kvlm.sampling_params import StructuredOutputsParams
    from kvlm.structured.mask import apply_token_bitmask, grammar_bitmask
    from kvlm.structured.matcher import RequestGrammar

    eng = llm.llm_engine
    so = StructuredOutputsParams(json=RECORDS)
    grammars = [RequestGrammar(eng.grammars.submit(so), eng.grammars.mask_words) for _ in range(batch)]
    token_rows = [eng.tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(batch)]
    steps = min(len(t) for t in token_rows)
    V = eng.model_config.vocab_size
    logits = torch.zeros(batch, V)
    rows = torch.arange(batch)
    fill = apply = 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        bitmask = grammar_bitmask(grammars)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask, rows)
        t2 = time.perf_counter()
        fill += t1 - t0
        apply += t2 - t1
        for g, row in zip(grammars, token_rows):
            g.accept(row[s])
    return {"fill_us": fill / steps * 1e6, "apply_us": apply / steps * 1e6, "steps": steps}


def run(model: str = DEFAULT_MODEL, threads: int = 2, batches: tuple[int, ...] = (1, 16), gen_tokens: int = 64,
        repeats: int = 3, properties: int = 30, temperature: float = 0.0,
        log: Callable[[str], None] = log) -> dict[str, Any]:
    from kvlm.llm import LLM
    from kvlm.sampling_params import StructuredOutputsParams

    torch.set_num_threads(threads)
    llm = LLM(model, num_threads=threads, max_num_seqs=max(batches))  # the constrained side
    free_llm = LLM(model, num_threads=threads, max_num_seqs=max(batches))
    eng = llm.llm_engine
    t0 = time.perf_counter()
    eng.grammars.lltokenizer  # built once per engine (the tokenizer's view for llguidance)
    tokenizer_s = time.perf_counter() - t0
    compiles = []
    for r in range(repeats):
        t0 = time.perf_counter()
        eng.grammars.compile(StructuredOutputsParams(json=wide_schema(properties, r)))
        compiles.append(time.perf_counter() - t0)
    eng.grammars.compile(StructuredOutputsParams(json=RECORDS))
    ids = eng.tokenizer.encode(PROMPT)
    _paired(free_llm, llm, ids, 1, 4, temperature)  # warm-up
    rows = []
    for b in batches:
        free: list[float] = []
        cons: list[float] = []
        ratios, throughput, texts = [], [], []
        for r in range(repeats):
            f, c, texts = _paired(free_llm, llm, ids, b, gen_tokens, temperature)
            free += f
            cons += c
            ratios.append(statistics.median(x / y for x, y in zip(f, c)))
            throughput.append(sum(f) / sum(c))
            log(f"  batch {b} round {r + 1}/{repeats}: free {b / statistics.median(f):.1f} tok/s, "
                f"constrained {b / statistics.median(c):.1f} tok/s (median steps), paired step ratio "
                f"{ratios[-1]:.3f}, throughput ratio {throughput[-1]:.3f}")
        masks = _mask_times(llm, texts, b)
        rows.append({"batch": b, "free_tokens_per_s": b / statistics.median(free),
                     "constrained_tokens_per_s": b / statistics.median(cons),
                     "ratio": statistics.median(ratios), "round_ratios": [round(x, 4) for x in ratios],
                     "throughput_ratio": statistics.median(throughput),
                     "round_throughput_ratios": [round(x, 4) for x in throughput],
                     "mask_fill_us_per_step": round(masks["fill_us"], 1),
                     "mask_apply_us_per_step": round(masks["apply_us"], 1)})
    doc = run_header("structured", model, threads)
    doc.update({"dtype": eng.config.dtype, "temperature": temperature, "gen_tokens": gen_tokens,
                "repeats": repeats, "schema": "RECORDS",
                "compile_properties": properties, "compile_ms": round(min(compiles) * 1e3, 2),
                "compile_ms_max": round(max(compiles) * 1e3, 2), "tokenizer_build_ms": round(tokenizer_s * 1e3, 1),
                "rows": rows})
    return doc


def print_table(d: dict[str, Any]) -> None:
    print(f"{'batch':>5s} {'free tok/s':>11s} {'JSON tok/s':>11s} {'ratio':>6s} {'throughput':>10s} "
          f"{'mask fill us':>13s} {'mask apply us':>14s}")
    for r in d["rows"]:
        print(f"{r['batch']:5d} {r['free_tokens_per_s']:11.1f} {r['constrained_tokens_per_s']:11.1f} "
              f"{r['ratio']:6.3f} {r['throughput_ratio']:10.3f} {r['mask_fill_us_per_step']:13.1f} "
              f"{r['mask_apply_us_per_step']:14.1f}")
    print(f"compile, {d['compile_properties']}-property schema: {d['compile_ms']:.2f} ms "
          f"(tokenizer for llguidance, once per engine: {d['tokenizer_build_ms']:.0f} ms)")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes (default: 1 16)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--properties", type=int, default=30, help="properties of the compile-time schema")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, so the mask is the only difference between the two sides")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    if min(a.batches) < 1 or a.gen_tokens < 2 or a.repeats < 1 or a.properties < 1:
        raise ValueError("--batches, --gen-tokens (>= 2), --repeats and --properties must be positive")
    return run(a.model, threads=a.threads, batches=tuple(a.batches), gen_tokens=a.gen_tokens, repeats=a.repeats,
               properties=a.properties, temperature=a.temperature)


BENCH = Bench("structured", "decode tokens/s with and without a JSON-schema constraint; compile and mask time",
              add_args, run_args, print_table)

if __name__ == "__main__":
    standalone(BENCH)

"""`kvlm bench moe`: a mixture-of-experts model's decode speed against what it computes and reads, per routing
batch, and the expert-load histogram of the run.

For each `--batches` B: B greedy requests (seeded random prompts of `--prompt-len` tokens, distinct so they
route differently) are prefilled, then their decode steps timed together: tok/s = B x steps / time. The
routed layers count, per step, the rows each expert got and how many experts the step touched (the
engine's own counters, `model.moe.count_expert_load`): a step reads the dense weights (attention, routers,
lm_head) once and each touched expert once, so the weight bytes per token are (dense + touched experts'
bytes) / B; at B = 1 that is `kvlm info`'s figure, and it falls as tokens share experts. GB/s is bytes per
token x tok/s, and its fraction of the machine's memory bandwidth is `kvlm bench latency`'s ceiling (a 256
MiB copy). Active and total parameters come from the config. The histogram is every routed row of the run
(all batches, prefill too) by expert, summed over layers. `--plot` draws tok/s and bytes per token by
batch, and the histogram. The last line is the JSON document.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvlm.bench.common import Bench, add_model_args, log, run_header, standalone


def run(model: str, threads: int = 2, batches: tuple[int, ...] = (1, 4, 16), max_tokens: int = 32,
        prompt_len: int = 16) -> dict[str, Any]:
    import torch

    from kvlm import LLM, SamplingParams
    from kvlm.bench.common import prompt_ids
    from kvlm.bench.latency import engine_weight_bytes, memory_bandwidth
    from kvlm.errors import ParameterError
    from kvlm.model.moe import count_expert_load

    if max_tokens < 2 or prompt_len < 1 or not batches or min(batches) < 1:
        raise ParameterError("max_tokens", "--max-tokens must be >= 2, --prompt-len and every batch >= 1")
    doc = run_header("moe", model, threads)
    llm = LLM(model, num_threads=threads, enable_prefix_caching=False, adaptive_threads=False,
              max_num_seqs=max(batches))
    eng, c = llm.llm_engine, llm.llm_engine.model_config
    if not c.num_experts:
        raise ParameterError("model", f"{model} is not a mixture-of-experts model (no routed layers)")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt_ids(c.vocab_size, prompt_len, 99)}],
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    layers = count_expert_load(eng.model)
    dense = engine_weight_bytes(eng.model)
    expert_bytes = [m.experts.nbytes_per_expert for m in layers]
    total_load = torch.zeros(c.num_experts, dtype=torch.int64)
    rows = []
    for b in batches:
        reqs = [eng.add_request(prompt_ids(c.vocab_size, prompt_len, seed=i), params) for i in range(b)]
        while any(not r.output_token_ids for r in reqs):  # prefill (its rows count in the histogram)
            eng.step()
        for m in layers:
            total_load += m.load
        count_expert_load(eng.model)
        steps, t0 = 0, time.perf_counter()
        while eng.has_unfinished:
            eng.step()
            steps += 1
        dt = time.perf_counter() - t0
        tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
        touched = [m.touched / max(1, m.calls) for m in layers]  # experts a step reads, per layer
        step_bytes = dense + sum(t * e for t, e in zip(touched, expert_bytes))
        for m in layers:
            total_load += m.load
        count_expert_load(eng.model)
        rows.append({"batch": b, "steps": steps, "tokens": tokens, "tokens_per_s": tokens / dt,
                     "experts_touched_per_layer": sum(touched) / len(touched),
                     "bytes_per_token": step_bytes / b, "gb_per_s": step_bytes * steps / dt / 1e9})
        log(f"batch {b:3d}: {rows[-1]['tokens_per_s']:8.1f} tok/s, {rows[-1]['experts_touched_per_layer']:.1f} "
            f"experts touched per layer and step")
    bw = memory_bandwidth()
    for r in rows:
        r["fraction_of_bandwidth"] = r["gb_per_s"] * 1e9 / bw
    doc.update(total_parameters=c.num_parameters, active_parameters=c.num_active_parameters,
               experts=c.num_experts, experts_per_token=c.num_experts_per_tok, routed_layers=len(layers),
               dense_weight_bytes=dense, expert_bytes=expert_bytes[0] if expert_bytes else 0,
               prompt_len=prompt_len, max_tokens=max_tokens, memory_bandwidth_gb_per_s=bw / 1e9, rows=rows,
               expert_load=total_load.tolist())
    return doc


def print_table(d: dict[str, Any]) -> None:
    from kvlm.bench.plotting import fmt_bytes

    print(f"{d['model']}: {d['active_parameters'] / 1e6:,.1f}M active of {d['total_parameters'] / 1e6:,.1f}M "
          f"parameters; top {d['experts_per_token']} of {d['experts']} experts in {d['routed_layers']} layers "
          f"({fmt_bytes(d['expert_bytes'])} an expert); {d['threads']} threads, {d['cpu']}, {d['date']}")
    print(f"{'batch':>5} {'tok/s':>9} {'experts/layer':>13} {'bytes/token':>12} {'GB/s':>7} {'of bw':>6}")
    for r in d["rows"]:
        print(f"{r['batch']:5d} {r['tokens_per_s']:9.1f} {r['experts_touched_per_layer']:13.1f} "
              f"{fmt_bytes(r['bytes_per_token']):>12} {r['gb_per_s']:7.2f} {100 * r['fraction_of_bandwidth']:5.0f}%")
    load = d["expert_load"]
    total = sum(load) or 1
    top = sorted(range(len(load)), key=lambda e: -load[e])[:4]
    print(f"expert load (rows, all layers): busiest {', '.join(f'#{e} {100 * load[e] / total:.1f}%' for e in top)}; "
          f"idlest #{min(range(len(load)), key=lambda e: load[e])} {100 * min(load) / total:.1f}% "
          f"(uniform {100 / len(load):.1f}%)")


def plot(d: dict[str, Any], path: str) -> str:
    from kvlm.bench.plotting import new_figure, save_figure

    fig, (ax1, ax2) = new_figure(ncols=2, width=10.0)
    bs = [r["batch"] for r in d["rows"]]
    ax1.plot(bs, [r["tokens_per_s"] for r in d["rows"]], "o-", label="tok/s")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("routing batch (decode rows per step)")
    ax1.set_ylabel("tok/s")
    ax1b = ax1.twinx()
    ax1b.plot(bs, [r["bytes_per_token"] / 2**20 for r in d["rows"]], "s--", color="tab:orange")
    ax1b.set_ylabel("weight MiB read per token", color="tab:orange")
    ax1.set_title(f"{d['active_parameters'] / 1e6:.4g}M active of {d['total_parameters'] / 1e6:.4g}M parameters, "
                  f"{d['threads']} threads", fontsize=9)
    load = d["expert_load"]
    ax2.bar(range(len(load)), load)
    ax2.axhline(sum(load) / len(load), color="k", lw=0.8, ls=":")
    ax2.set_xlabel("expert id")
    ax2.set_ylabel("rows routed (all layers)")
    ax2.set_title("expert load of the run", fontsize=9)
    return save_figure(fig, path)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="routing batches (concurrent requests)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--plot", metavar="FILE.png", help="draw tok/s and bytes per token by batch, and the histogram")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, threads=a.threads, batches=tuple(a.batches), max_tokens=a.max_tokens,
               prompt_len=a.prompt_len)


BENCH = Bench("moe", "a mixture-of-experts model: tok/s against active parameters and bytes read per token, per "
              "routing batch, and the expert-load histogram", add_args, run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)

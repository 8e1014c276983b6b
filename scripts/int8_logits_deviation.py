#!/usr/bin/env python3
"""Logits deviation of the default path (int8 activations) from the float32 reference path.

On the README's and the tests' prompts (tests/model/test_quantized.py) plus a chat turn: teacher-forced along
the reference's greedy tokens (steps 0, 8, 16, 24, 31; all 32 with --every-step), the max and rms |logit
difference| and the max relative to the logit range; where 32 greedy tokens part, the reference's top-2
margin at that step.
Usage: PYTHONPATH=. python scripts/int8_logits_deviation.py [--every-step] [MODEL.gguf ...]  (default: the
default model's file; several files, e.g. scripts/make_quant_fixtures.py's, are measured one after the other)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "model"))
from test_quantized import EXACTNESS_PROMPTS, README_PROMPTS

from kvlm import LLM, SamplingParams
from kvlm.kernels import kernel_path
from kvlm.loader import registry


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    eng = llm.llm_engine
    r = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    eng.step(keep_logits=True)
    assert r.is_finished
    return eng.last_result.logits[0].double()


def tensor_paths(path: str) -> str:
    """'Q4_1 avx512-vnni+int8, ...': each quantized tensor type of the file and the kernel path it takes."""
    from gguf import GGMLQuantizationType, GGUFReader

    types = sorted({t.tensor_type for t in GGUFReader(path).tensors} - {GGMLQuantizationType.F32})
    return ", ".join(f"{t.name} {kernel_path(t)}" for t in types)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", metavar="MODEL.gguf", help="default: the default model's file")
    p.add_argument("--every-step", action="store_true", help="teacher-force all 32 steps, not 5 of them")
    args = p.parse_args()
    for path in args.models or [str(registry.pull("smollm2-135m"))]:
        print(f"# {Path(path).name}")
        deviation(path, range(32) if args.every_step else (0, 8, 16, 24, 31))


def deviation(path: str, steps) -> None:
    ref, q = LLM(path, num_threads=2, dtype="float32"), LLM(path, num_threads=2, dtype="auto")
    print(f"# quantized path: {tensor_paths(path)}; reference: --dtype float32")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    inputs = [q.tokenizer.encode(p) for p in README_PROMPTS + EXACTNESS_PROMPTS]
    inputs += [q.render_chat([{"role": "user", "content": "What is a KV cache?"}])]
    batch = [{"prompt_token_ids": ids} for ids in inputs]
    outs_q = [o.outputs[0].token_ids for o in q.generate(batch, params, use_tqdm=False)]
    outs_r = [o.outputs[0].token_ids for o in ref.generate(batch, params, use_tqdm=False)]
    worst, worst_rel = 0.0, 0.0
    for ids, a, b in zip(inputs, outs_q, outs_r):
        mx = rel = rms = 0.0
        for j in steps:
            lr, lq = last_logits(ref, ids + b[:j]), last_logits(q, ids + b[:j])
            d = (lq - lr).abs()
            mx, rms = max(mx, float(d.max())), max(rms, float(d.pow(2).mean().sqrt()))
            rel = max(rel, float(d.max() / (lr.max() - lr.min())))
        line = f"{q.tokenizer.decode(ids)[:28]!r:32s} max|dlogit| {mx:.3f}  max rel(range) {rel:.4f}  rms {rms:.3f}"
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            line += "  agree 32/32"
        else:
            lr, lq = last_logits(ref, ids + b[:k]), last_logits(q, ids + b[:k])
            top = lr.topk(2).values
            line += (f"  part at {k}: ref margin {float(top[0] - top[1]):.3f}, "
                     f"max|dlogit| there {float((lq - lr).abs().max()):.3f}")
        worst, worst_rel = max(worst, mx), max(worst_rel, rel)
        print(line)
    print(f"overall max|dlogit| {worst:.3f}, max relative to the logit range {worst_rel:.4f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Int8 activations per 32-element block (q8_0's scheme, what kvlm's int8 kernels use for every format)
against per 256 (llama.cpp's q8_K) for the K-quant tensors: logits deviation from float32 activations.

Every matmul of the model is replaced by its definition: x fake-quantized (d = amax / 127, round half to
even) per 32 elements, or for K-quant weights per BLOCK (32 or 256), then x_fq @ dequantize(W).T in
float32; the reference is float32 activations everywhere. On the README's and the tests' prompts,
teacher-forced along the reference's 32 greedy tokens (steps 0, 8, 16, 24, 31): max and rms |logit
difference| from the reference. The Q6_K file has the most K-quant weight bytes.
Usage: PYTHONPATH=. python scripts/experiments/act_block_ab.py MODEL.gguf  (e.g. a Q4_K_M fixture from
scripts/make_quant_fixtures.py)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("KVLM_FUSED_DECODE", "0")  # decode steps too through the patched module path
sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "model"))
sys.path.insert(0, str(Path(__file__).parents[1]))
from int8_logits_deviation import last_logits
from test_quantized import EXACTNESS_PROMPTS, README_PROMPTS

import kvlm.model.quant_layers as quant_layers
from kvlm import LLM, SamplingParams
from kvlm.kernels.reference import dequantize_ref

BLOCK = [0]  # the activation block of the patched matmul (0: float32 activations)
_DENSE: dict[int, torch.Tensor] = {}


def fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    b = x.reshape(x.shape[0], -1, block)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


def matmul(x: torch.Tensor, w) -> torch.Tensor:
    dense = _DENSE.get(id(w))
    if dense is None:
        dense = _DENSE[id(w)] = dequantize_ref(w)
    block = BLOCK[0] if w.qtype.name.endswith("_K") else 32 if BLOCK[0] else 0  # other types: q8_0's 32
    return (fake_quant(x.float(), block) if block else x.float()) @ dense.T


def main() -> None:
    path = sys.argv[1]
    quant_layers.qmatmul = matmul  # every QuantLinear of the model now runs `matmul`
    llm = LLM(path, num_threads=2, dtype="auto", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    inputs = [llm.tokenizer.encode(p) for p in README_PROMPTS + EXACTNESS_PROMPTS]
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in inputs], params,
                                                         use_tqdm=False)]
    seqs = [ids + out[:j] for ids, out in zip(inputs, outs) for j in (0, 8, 16, 24, 31)]
    ref = [last_logits(llm, s) for s in seqs]
    print(f"# {Path(path).name}: {len(seqs)} teacher-forced steps; |logits - float32 activations|")
    for block in (32, 256):
        BLOCK[0] = block
        diffs = [(last_logits(llm, s) - r).abs() for s, r in zip(seqs, ref)]
        mx = max(float(d.max()) for d in diffs)
        rms = max(float(d.pow(2).mean().sqrt()) for d in diffs)
        mean_max = sum(float(d.max()) for d in diffs) / len(diffs)
        print(f"per-{block} blocks: max {mx:.3f}, mean of per-step max {mean_max:.3f}, max rms {rms:.4f}")
    BLOCK[0] = 0


if __name__ == "__main__":
    main()

"""Gemma 3 270M: how far kvlm's float32 path is from transformers, next to how far transformers is from itself.

For each prompt of tests/model/test_gemma3_real.py, 8 greedy steps: the largest |logit difference| between
kvlm (`--dtype float32`) and transformers' cached `generate`, and between transformers' own SDPA and eager
attention, and its cached decode and a full recompute, on the same tokens. The numbers README's Gemma
section quotes come from this. Needs transformers and the model (`kvlm pull gemma3-270m`).

    python scripts/experiments/gemma3_vs_hf.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "model"))

from engine_runs import run_engine  # noqa: E402
from test_gemma3_real import PROMPTS, STEPS  # noqa: E402

from kvlm import EngineConfig, SamplingParams  # noqa: E402
from kvlm.engine.engine import Engine  # noqa: E402
from kvlm.loader.registry import pull  # noqa: E402


def main() -> None:
    import transformers

    path = pull("gemma3-270m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    # The same dequantized weights computed in float64 (eager attention): the float32 paths' common reference.
    hf64 = copy.deepcopy(hf).double()
    hf64.config._attn_implementation = "eager"
    engine = Engine(path, EngineConfig(dtype="float32", num_threads=2, adaptive_threads=False), quiet=True)
    print(f"{'tokens':>6} {'kvlm-hf':>9} {'hf sdpa-eager':>14} {'hf cached-full':>15} {'kvlm-f64':>9} "
          f"{'hf cached-f64':>14} {'hf sdpa-f64':>12} {'hf eager-f64':>13}  (max |logit difference|)")
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text)
        tokens, logits = run_engine(engine, [ids], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            seq, n = out.sequences, len(ids) - 1
            hf.config._attn_implementation = "sdpa"
            sdpa = hf(seq).logits[0, n:n + STEPS]
            hf.config._attn_implementation = "eager"
            eager = hf(seq).logits[0, n:n + STEPS]
            exact = hf64(seq).logits[0, n:n + STEPS]
        gen = torch.stack([step[0] for step in out.logits])
        ours = torch.stack(logits[0])
        print(f"{len(ids):>6} {(ours - gen).abs().max().item():>9.2e} {(sdpa - eager).abs().max().item():>14.2e} "
              f"{(gen - eager).abs().max().item():>15.2e} {(ours.double() - exact).abs().max().item():>9.2e} "
              f"{(gen.double() - exact).abs().max().item():>14.2e} {(sdpa.double() - exact).abs().max().item():>12.2e} "
              f"{(eager.double() - exact).abs().max().item():>13.2e}")


if __name__ == "__main__":
    main()

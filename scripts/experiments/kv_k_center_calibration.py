#!/usr/bin/env python3
"""Which calibration input the engine's K center needs: built-in text, seeded random ids, the scored text
(docs/kv_quant.md records the runs).

An int4 (or int8) engine stores k - mu, mu the mean post-RoPE key per layer and kv head from one prefill
at load (`kvlm/kv_cache/k_center.py`: 1,024 seeded random token ids). This scores, on `kvlm
bench quality`'s windows and scoring, engines whose mu came from other inputs, set on their cache after load:

* `none`: mu = 0 (k - 0 = k: the uncentered cache, bit for bit);
* `seeded-N`: N ids of `calibration_ids` (uniform over the vocabulary, `random.Random(0)`; the engine's
  own is seeded-1024);
* `zipf-N`: N seeded ids drawn with weight 1 / rank of the id past the special tokens (BPE ids follow
  merge order, roughly text's token frequencies; no text);
* `builtin-N`: `CALIBRATION_TEXT` (a page of prose written for this, below) tokenized, repeated to N
  tokens;
* `text-N`: the first N tokens of the King James text from character 2,000,000 (not among the scored
  windows, which start at its beginning), tokenized by the model's tokenizer.

    python scripts/experiments/kv_k_center_calibration.py [--chunks 6] [--dtype float32] [--kv int4]

The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from kvlm.bench import quality
from kvlm.engine.engine import Engine
from kvlm.kernels import native
from kvlm.kv_cache.k_center import calibration_ids, mean_keys

p = argparse.ArgumentParser()
p.add_argument("--chunks", type=int, default=6)
p.add_argument("--dtype", default="float32", choices=["auto", "float32"])
p.add_argument("--kv", default="int4", choices=["int8", "int4"])
p.add_argument("--variants", nargs="+", default=["none", "seeded-512", "seeded-1024", "zipf-1024", "builtin-715",
                                                "builtin-1024", "text-1024"])
a = p.parse_args()

# Written for this purpose (a mix of registers: narrative, instructions, dialogue, numbers, a little code),
# tokenized by the model's own tokenizer and repeated to N tokens.
CALIBRATION_TEXT = """\
The rain had stopped by the time Mara reached the harbour, and the fishing boats rocked gently against
the stone wall. She counted them twice, as her grandfather had taught her: eleven boats, three with
blue hulls, one with a broken mast that nobody had bothered to repair since the storm in March. The
market behind her was opening. Someone was arguing about the price of onions, someone else was singing.

"You are late," said Tomas, without looking up from the net he was mending.
"The bus was late. I am exactly as late as the bus."
"Then the bus owes me an hour of work." He handed her a needle and a ball of green thread.

How to repot a small plant: water it the day before, so the roots hold together. Choose a pot about two
centimetres wider than the old one, with a hole in the bottom. Turn the plant upside down, support the
soil with your hand, and tap the rim until it slides out. Loosen the outer roots with your fingers, set
the plant at the same depth as before, fill the gaps with fresh soil and press lightly. Water again and
keep it out of direct sunlight for a week.

The committee met on Thursday, 14 October, at 9:30 in room 204. Present: six members and two guests.
The treasurer reported a balance of 12,480 euros, up from 9,915 at the previous meeting, mainly because
the spring concert sold 412 tickets at 15 euros each. Costs for the new roof were estimated between
18,000 and 22,500 euros; a decision was postponed until three written quotes are available.

Light from the Sun takes a little over eight minutes to reach the Earth. The Moon is about 384,000
kilometres away, and its light, which is only reflected sunlight, arrives in just over a second. Most of
the stars visible at night are within a few hundred light years, a short distance on the scale of the
galaxy, which is roughly a hundred thousand light years across.

def average(values):
    # the arithmetic mean of a non-empty list of numbers
    if not values:
        raise ValueError("average() needs at least one value")
    return sum(values) / len(values)

Question: If a train leaves at 7:45 and the journey takes two hours and forty minutes, when does it
arrive? Answer: at 10:25. Question: What is the capital of Canada? Answer: Ottawa.

Dear Mr. Alvarez, thank you for your letter of last week. We are sorry that the parcel arrived damaged.
A replacement has been sent today by express delivery, and you do not need to return the broken item.
Please let us know if there is anything else we can do. With kind regards, the customer service team.

In the evening the wind turned and came from the north, cold and steady. The boats were pulled higher,
the nets were hung to dry, and the lamps in the houses along the quay were lit one by one. Mara walked
home slowly, her fingers smelling of salt and tar, thinking about the broken mast and about March.
"""

torch.set_num_threads(2)
context, first = 1024, 512

engines = quality._engines(quality.DEFAULT_MODEL, 2, [a.dtype], [a.kv], context, 256)
base = engines[(a.dtype, "float32")]
tok, vocab = base.tokenizer, base.model_config.vocab_size
text_path, _ = quality.text_file(None)  # the bench's text (the King James Bible)
raw_bytes = text_path.read_bytes()
raw = raw_bytes.decode("utf-8", "ignore")
text_ids = tok.encode(raw[2_000_000 : 2_000_000 + 40_000], add_special_tokens=False)
builtin = tok.encode(CALIBRATION_TEXT, add_special_tokens=False)
in_place = native.active_isa() != "reference"


def zipf_ids(vocab_size: int, n: int, first: int = 17) -> list[int]:
    """n seeded ids >= first (SmolLM2: past its special tokens) drawn with weight 1 / rank, rank = id - first
    + 1: BPE ids follow merge order, so this mimics text's unigram frequencies without any text."""
    rng = random.Random(0)
    return rng.choices(range(first, vocab_size), weights=[1 / (i + 1) for i in range(vocab_size - first)], k=n)


load_s: dict[str, float] = {}
variants: dict[tuple[str, str], object] = {(a.dtype, "float32"): base}
for name in a.variants:
    kind, _, n = name.partition("-")
    eng = engines[(a.dtype, a.kv)] if name == "seeded-1024" else Engine(quality.DEFAULT_MODEL, dataclasses.replace(
        engines[(a.dtype, a.kv)].config), quiet=True)
    t0 = time.perf_counter()
    if kind == "none":
        mu = torch.zeros_like(eng.k_center)
    else:
        ids = (calibration_ids(vocab, int(n)) if kind == "seeded" else text_ids[: int(n)] if kind == "text"
               else zipf_ids(vocab, int(n)) if kind == "zipf" else (builtin * (int(n) // len(builtin) + 1))[: int(n)])
        mu = mean_keys(eng.model, ids, in_place).contiguous()
    load_s[name] = time.perf_counter() - t0
    if name == "seeded-1024":
        assert torch.equal(mu, eng.k_center), "the engine's own center is seeded-1024"
    eng.kv_cache.k_center = mu
    variants[(a.dtype, name)] = eng

text_ids_all = tok.encode(raw_bytes[: a.chunks * context * 8].decode("utf-8", "ignore"), add_special_tokens=False)
wins = quality.windows(text_ids_all, context, a.chunks)
pairs = [((a.dtype, "float32"), None)] + [((a.dtype, n), (a.dtype, "float32")) for n in a.variants]
scores = {pair: quality._Score() for pair in pairs}
for w, win in enumerate(wins):
    quality.log(f"window {w + 1}/{len(wins)}")
    quality._score_window(variants, win, first, scores, pairs)
results = {key[1]: s.result() for (key, _), s in scores.items()}
b = results.pop("float32")
for name, r in results.items():
    r["ppl_delta"] = r["ppl"] / b["ppl"] - 1
    r["calibration_s"] = load_s[name]
    print(f"{name:12} ppl {r['ppl']:.4f} ({r['ppl_delta']:+.3%} ± {r['ppl_delta_se']:.3%})  mean KLD "
          f"{r['mean_kld']:.2e}  p99 KLD {r['p99_kld']:.2e}  top-1 {r['top1_agreement']:.2%}  "
          f"mu in {load_s[name]:.2f} s")
print(json.dumps({"dtype": a.dtype, "kv": a.kv, "chunks": a.chunks, "baseline_ppl": b["ppl"], **results}))

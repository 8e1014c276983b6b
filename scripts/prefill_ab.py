"""Prefill 512 tokens: int8 row kernel vs int8 fake-quant + tile BLAS vs float32 activations vs the float32 path, interleaved.

    PYTHONPATH=. python scripts/prefill_ab.py
"""
import time, torch, random
from kvlm import LLM, SamplingParams
import kvlm.kernels.quant as q
torch.set_num_threads(2)
rng = random.Random(0)
ids = [rng.randrange(100, 20000) for _ in range(512)]
p = SamplingParams(temperature=0, max_tokens=1)
auto = LLM("smollm2-135m", num_threads=2, max_num_seqs=1, enable_prefix_caching=False, quiet=True)
f32 = LLM("smollm2-135m", num_threads=2, max_num_seqs=1, enable_prefix_caching=False, dtype="float32", quiet=True)
def run(llm):
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False); return time.perf_counter() - t
res = {}
from kvlm.kernels import native
import os
for r in range(5):
    for name in ("int8-row", "int8-blas64", "f32act-blas", "float32"):
        os.environ["KVLM_KERNEL_ACT"] = "f32" if name == "f32act-blas" else "int8"; native.refresh()
        if name == "int8-row": q.INT8_ROW_MAX_ROWS = 1 << 20
        if name == "int8-blas64": q.INT8_ROW_MAX_ROWS = 64
        res.setdefault(name, []).append(512 / run(f32 if name == "float32" else auto))
for k, v in res.items(): print(k, " ".join(f"{x:.0f}" for x in v), "best", f"{max(v):.0f} tok/s")

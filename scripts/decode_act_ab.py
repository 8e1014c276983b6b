"""Decode tok/s at batch 1 with int8 vs float32 activations (KVLM_KERNEL_ACT), fused step, interleaved in one process.

    PYTHONPATH=. python scripts/decode_act_ab.py
"""
import os, time, statistics, torch
from kvlm import LLM, SamplingParams
from kvlm.kernels import native
torch.set_num_threads(2)
ids = list(range(1000, 1032))
p = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
llms = {}
for act in ("int8", "f32"):
    os.environ["KVLM_KERNEL_ACT"] = act; native.refresh()
    llms[act] = LLM("smollm2-135m", num_threads=2, max_num_seqs=1, quiet=True)
    assert llms[act].llm_engine.runner.fused is not None
res = {a: [] for a in llms}
for r in range(3):
    for act, llm in llms.items():
        os.environ["KVLM_KERNEL_ACT"] = act; native.refresh()
        eng = llm.llm_engine
        req = eng.add_request(ids, p); eng.step()
        t = time.perf_counter(); n = 0
        while not req.is_finished:
            eng.step(); n += 1
        res[act].append(n / (time.perf_counter() - t))
for a, v in res.items(): print(a, " ".join(f"{x:.1f}" for x in v), "best", f"{max(v):.1f}")
print("int8/f32", f"{max(res['int8'])/max(res['f32']):.2f}x")

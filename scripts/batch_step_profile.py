"""Time and native profile (matmul, attention, ...) of decode steps at batch 1, 8 and 32 (300-token prompts).

    PYTHONPATH=. python scripts/batch_step_profile.py
"""
import time, torch, random
from kvlm import LLM, SamplingParams
from kvlm.fused_decode import PROFILE_PARTS
torch.set_num_threads(2)
llm = LLM("smollm2-135m", num_threads=2, max_num_seqs=32, quiet=True, enable_prefix_caching=False)
eng = llm.llm_engine
rng = random.Random(0)
for B in (1, 8, 32):
    reqs = [eng.add_request([rng.randrange(100, 20000) for _ in range(300)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for _ in range(B)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs): eng.step()
    f = eng.runner.fused
    f.profile = torch.zeros(5, dtype=torch.float64)
    t = time.perf_counter(); n = 0
    while n < 20: eng.step(); n += 1
    dt = (time.perf_counter() - t) / n
    print(f"B={B}: {dt*1e3:.1f} ms/step, {B/dt:.0f} tok/s;", ", ".join(f"{k} {v/n*1e3:.1f}" for k, v in zip(PROFILE_PARTS, f.profile.tolist())))
    f.profile = None
    for r in reqs: eng.abort(r.request_id) if hasattr(eng, "abort") else None
    while eng.has_unfinished: eng.step()

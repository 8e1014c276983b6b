#!/usr/bin/env python3
"""Does the default model call a tool under tool_choice="auto", and what does a yes/no choice pick? The
numbers behind docs/structured.md ("Tool calls"):

    python scripts/experiments/structured_tool_auto.py [--seeds 60]

Prints the model's first-token log-probabilities under the tool prompt (where `<`, the first token of
`<tool_call>`, ranks), how many seeded tries at temperature 1.0 wrote a call, and for README's yes/no
question the log-probabilities of every first token the choice allows next to the unconstrained answer.
"""

from __future__ import annotations

import argparse

from kvlm import LLM, SamplingParams, StructuredOutputsParams

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--seeds", type=int, default=60)
a = ap.parse_args()
llm = LLM("smollm2-135m", num_threads=2)
tok = llm.llm_engine.tokenizer
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
first = llm.chat(ask, SamplingParams(temperature=0, max_tokens=1, logprobs=20), tools=[WEATHER], tool_choice="auto")
top = sorted(((v, tok.decode([k])) for k, v in first[0].outputs[0].logprobs[0].items()), reverse=True)
print("first token, top 20 (log-prob):", [(t, round(v, 2)) for v, t in top])
calls = 0
for seed in range(a.seeds):
    out = llm.chat(ask, SamplingParams(temperature=1.0, seed=seed, max_tokens=60), tools=[WEATHER],
                   tool_choice="auto")[0].outputs[0]
    calls += bool(out.tool_calls)
print(f"tool_choice=auto, temperature 1.0: {calls} calls in {a.seeds} seeds")

yes_no = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
free = llm.chat(yes_no, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
so = StructuredOutputsParams(choice=["yes", "no"])
out = llm.chat(yes_no, SamplingParams(temperature=0, max_tokens=5, structured_outputs=so))[0]
eng = llm.llm_engine  # the raw first-position logits: one greedy step with keep_logits
req = eng.add_request(list(out.prompt_token_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
while not req.is_finished:
    eng.step(keep_logits=True)
lp = eng.last_result.logits[0].log_softmax(-1)
starts = {i: t for i in range(tok.vocab_size) if (t := tok.decode([i])) and ("yes".startswith(t) or "no".startswith(t))}
print(f"unconstrained: {free!r}; choice yes/no: {out.outputs[0].text!r}; allowed first tokens:",
      sorted(((t, round(float(lp[i]), 2)) for i, t in starts.items()), key=lambda x: -x[1]))

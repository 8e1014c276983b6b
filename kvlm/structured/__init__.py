"""Structured outputs: grammars that constrain what a request may generate, OpenAI tool calls, and reasoning.

A request's `SamplingParams.structured_outputs` (a JSON schema, any JSON object, a regex, a choice or a
Lark/GBNF grammar) is compiled by llguidance (`grammar`, `compiler`: off the step loop, in a worker
thread, cached per grammar), becomes one matcher per request (`matcher`), and each step masks the
request's logits row to the tokens the matcher allows (`mask`). Tool calling (`tools`) builds the prompt
and the grammar for a list of OpenAI tools and parses calls out of the generated text. Reasoning
models' `<think>...</think>` span is split from the answer (`reasoning`), and a reasoning budget forces
`</think>` once a request has spent it (`reasoning_budget`).

It knows tokenizers and sampling parameters, nothing about the model, the KV cache or the scheduler;
the engine calls it.
"""

from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.matcher import RequestGrammar

__all__ = ["GrammarCompiler", "RequestGrammar"]

"""Structured outputs in the engine, on a tiny random model: whatever the weights, the grammar alone decides
what is valid. Exact outputs for const/enum/choice/regex, schema-valid JSON (nested objects, arrays, anyOf,
$ref), unconstrained neighbours bit-identical, seeds reproducible, preemption mid-object harmless, streamed
text == generated text, and a request whose grammar is still compiling never holds up the others."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
from engine_runs import assert_same_logits, random_prompts, run_engine, small_bytes
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import LLM, EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams as SO
from kvlm.structured.matcher import RequestGrammar

SCHEMA = {  # every string and number bounded, so even random weights finish well inside max_tokens
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "owner": {"$ref": "#/$defs/Person"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]}, "maxItems": 3},
        "extra": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"$ref": "#/$defs/Person"}]},
    },
    "required": ["id", "name", "owner", "tags", "extra"],
    "additionalProperties": False,
    "$defs": {"Person": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                                          "nick": {"type": "string", "maxLength": 4}},
                         "required": ["age", "nick"], "additionalProperties": False}},
}


def sampled(spec: SO, seed: int = 0, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec)


def compiled(engine: Engine, params: list[SamplingParams]) -> Engine:
    """Compile the grammars first: `run_engine` reads every step's batch, and a step that only waits for a
    compile runs none."""
    for p in params:
        if p.structured_outputs is not None:
            engine.grammars.compile(p.structured_outputs)
    return engine


@pytest.fixture(scope="module")
def llm(tiny_gguf: Path) -> LLM:
    return LLM(str(tiny_gguf))


def texts(llm: LLM, spec: SO, seeds: range, greedy: bool = False, max_tokens: int = 160) -> list[str]:
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec) if greedy
              else sampled(spec, s, max_tokens) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": [5, 17, 99, 3 + s]} for s in seeds], params)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0].finish_reason for o in outs]
    return [o.outputs[0].text for o in outs]


def test_exact_outputs(llm: LLM) -> None:
    assert texts(llm, SO(json={"const": "42"}), range(3)) == ['"42"'] * 3
    assert set(texts(llm, SO(json={"enum": ["red", "green", 7]}), range(6))) <= {'"red"', '"green"', "7"}
    assert set(texts(llm, SO(choice=["yes", "no", "maybe"]), range(6))) <= {"yes", "no", "maybe"}
    for t in texts(llm, SO(regex="[0-9]{3}"), range(6)) + texts(llm, SO(regex="[0-9]{3}"), range(1), greedy=True):
        assert re.fullmatch("[0-9]{3}", t), t


def test_json_schema_outputs_validate(llm: LLM) -> None:
    outs = texts(llm, SO(json=SCHEMA), range(8))
    for t in outs:
        jsonschema.validate(json.loads(t), SCHEMA)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', t)), t  # compact: no whitespace outside strings
    assert len(set(outs)) > 1  # really sampled


def test_json_object_outputs_parse(llm: LLM) -> None:
    """Any JSON object is unbounded, so random weights may run to max_tokens; those that end must parse."""
    outs = llm.generate([{"prompt_token_ids": [4, 4, s]} for s in range(8)],
                        [sampled(SO(json_object=True), s, 200) for s in range(8)])
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done
    for t in done:
        assert isinstance(json.loads(t), dict)


def test_unconstrained_rows_bit_identical(tiny_gguf: Path) -> None:
    """A batch with constrained neighbours leaves the other rows' logits and tokens exactly as a batch
    without any grammar (and as each alone)."""
    prompts = random_prompts(4, 3)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    mixed = [free, sampled(SO(json=SCHEMA), 1, 40), free, sampled(SO(regex="[a-z]+"), 2, 40)]
    base_tokens, base_logits = run_engine(Engine(tiny_gguf, quiet=True), prompts, free)
    e = Engine(tiny_gguf, quiet=True)
    compiled(e, mixed)
    tokens, logits = run_engine(e, prompts, mixed)
    for i in (0, 2):
        assert tokens[i] == base_tokens[i]
        assert_same_logits(logits[i], base_logits[i])


def test_seeded_sampling_reproducible(llm: LLM, tiny_gguf: Path) -> None:
    spec = SO(json=SCHEMA)
    a = texts(llm, spec, range(4))
    assert texts(llm, spec, range(4)) == a
    alone = LLM(str(tiny_gguf)).generate([{"prompt_token_ids": [5, 17, 99, 5]}], sampled(spec, 2))
    assert alone[0].outputs[0].text == a[2]  # alone == inside a batch of four


def test_preemption_mid_object_still_valid(tiny_gguf: Path) -> None:
    prompts = random_prompts(6, 11, lo=10, hi=30)
    params = [sampled(SO(json=SCHEMA), s, 120) for s in range(6)]
    e = Engine(tiny_gguf, EngineConfig(block_size=4), quiet=True)
    free, _ = run_engine(compiled(e, params), prompts, params)
    small = Engine(tiny_gguf, EngineConfig(block_size=4, kv_cache_memory=40 * 4 * small_bytes(tiny_gguf)), quiet=True)
    reqs = [small.add_request(p, sp) for p, sp in zip(prompts, params)]
    mid_object = 0  # preemptions of a request that had begun its JSON (it resumes with its matcher as it was)
    while small.has_unfinished:
        small.step()
        if small.last_batch is not None:
            mid_object += sum(1 for r in small.last_batch.preempted if 0 < r.num_output_tokens and not r.is_finished)
            small.last_batch = None
    assert mid_object > 0
    for i, r in enumerate(reqs):
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.output_token_ids == free[i]


def test_streamed_equals_generated(llm: LLM) -> None:
    spec = SO(json=SCHEMA)
    prompt = {"prompt_token_ids": [9, 8, 7]}
    streamed = "".join(d.text for d in llm.stream(prompt, sampled(spec, 5)))
    assert streamed == llm.generate([prompt], sampled(spec, 5))[0].outputs[0].text
    json.loads(streamed)


def test_compiling_request_does_not_stall_others(tiny_gguf: Path) -> None:
    e = Engine(tiny_gguf, quiet=True)
    slow = e.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=5))
    pending: Future = Future()
    slow.grammar = RequestGrammar(pending, e.grammars.mask_words)  # a compile that has not finished yet
    fast = e.add_request([6, 7, 8], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert fast.num_output_tokens == 3 and slow.num_output_tokens == 0 and slow in e.scheduler.waiting
    pending.set_result(e.grammars.compile(SO(choice=["ok"])))
    while e.has_unfinished:
        e.step()
    assert slow.text == "ok" and fast.num_output_tokens == 5


def test_bad_grammar_refused_before_queueing(llm: LLM, tiny_gguf: Path) -> None:
    with pytest.raises(ParameterError) as err:
        llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="(unclosed")))
    assert err.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished
    e = Engine(tiny_gguf, quiet=True)  # the engine alone: the request ends ("abort") once the compile fails
    gate, compile_now = threading.Event(), e.grammars._compile

    def held(*args: object) -> object:  # the compile may not finish before add_request looks at it
        gate.wait(30)
        return compile_now(*args)

    e.grammars._compile = held  # type: ignore[method-assign]
    req = e.add_request([1, 2], SamplingParams(structured_outputs=SO(json={"type": "nonsense"})))
    gate.set()
    while e.has_unfinished:
        e.step()
    assert req.finish_reason == "abort" and "structured_outputs" in str(req.stop_reason)


def test_llm_chat_with_tools_returns_parsed_calls(tmp_path: Path) -> None:
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    llm = LLM(str(write_tiny_gguf(tmp_path / "t.gguf", tiny_config(max_position_embeddings=2048))))
    history = [{"role": "user", "content": "pick"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0", "type": "function", "function": {"name": "pick", "arguments": '{"n":1}'}}]},
               {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        out = llm.chat(history, SamplingParams(temperature=1.0, seed=3, max_tokens=60), tools=tools,
                       tool_choice=choice, parallel_tool_calls=False)[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.tool_calls) == 1 and out.tool_calls[0].name == "pick"
        jsonschema.validate(json.loads(out.tool_calls[0].arguments), params)
    plain = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5), tools=tools, tool_choice="none")
    assert plain[0].outputs[0].tool_calls is None

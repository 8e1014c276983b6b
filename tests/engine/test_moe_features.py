"""Everything else works on mixture-of-experts models (issue 31, item 4), on tiny random Qwen3-MoE and OLMoE
GGUF files (Q8_0, 32-wide heads: the smallest the int8 / int4 K/V formats take):

* int4 K/V on Qwen3-MoE and int8 on OLMoE, and a bounded cache (4 sinks + a 16-token window; int8 K/V on
  Qwen3-MoE, float on OLMoE): the engine
  equivalences bit for bit (cache vs none, chunked vs whole, alone vs batch, prefix hit vs miss, preempted
  vs not, 1 vs 2 threads), `torch.equal` logits;
* structured outputs: JSON-schema outputs validate, and unconstrained neighbours keep their bits;
* speculative decoding (ngram, suffix): token ids and top-5 logprobs equal to decoding without it, greedy
  and seeded, in a batch of 16 and under a JSON schema, with drafts accepted;
* `kvlm generate --check-exact` (with and without speculation) reports the recompute bit-identical.
The server with the real `openai` client is tests/server/test_server_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from deps import need_native
from engine_runs import assert_engine_equivalences, assert_identical, random_prompts, run_engine
from tiny_moe import moe_config, moe_state_dict, write_moe_gguf

from kvlm import LLM, EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.sampling_params import StructuredOutputsParams as SO

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SPEC_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
SPEC_SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=5)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
          "required": ["id", "name", "tags"], "additionalProperties": False}
# copy-heavy prompts (repeated spans the proposers find) of 16 kinds
PROMPTS = [[(7 * i + j) % 200 + 20 for j in range(5 + i % 4)] * (3 + i % 3) for i in range(16)]


def write(root: Path, kind: str, tied: bool = False) -> Path:
    cfg = moe_config(kind, head_dim=32, tie_word_embeddings=tied)
    return write_moe_gguf(root / f"{kind}-Q8_0.gguf", cfg, moe_state_dict(cfg), tensor_type="Q8_0")


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_native()
    return write(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings: a random model that tends to repeat itself, so n-gram drafts get accepted."""
    need_native()
    return write(tmp_path_factory.mktemp("moe-tied"), "qwen3_moe", tied=True)


# Each family with a quantized cache and a bounded one, each K/V dtype on a MoE family, without the whole cross
# product (the K/V paths are the attention's, which test_exact_kv_quant.py and test_bounded.py check on a dense
# model at every dtype; every family's plain equivalences are test_exact_moe.py's).
@pytest.mark.parametrize(("moe", "kv"), [("qwen3_moe", "int4"), ("olmoe", "int8")], indirect=["moe"])
def test_equivalences_with_quantized_kv(moe: Path, kv: str) -> None:
    main, _, _ = assert_engine_equivalences(moe, f"{moe.stem} {kv} K/V", GREEDY, kv_cache_dtype=kv)
    assert main.model_config.num_experts > 0 and main.config.kv_cache_dtype == kv


@pytest.mark.parametrize(("moe", "kv"), [("qwen3_moe", "int8"), ("olmoe", "auto")], indirect=["moe"])
def test_bounded_cache_bit_for_bit_past_the_window(moe: Path, kv: str) -> None:
    """120 tokens through 4 sinks + a 16-token window in a 64-token context: chunked == whole, alone ==
    in a batch, prefix hit == miss, 1 == 2 threads, bit for bit; no request holds more than its window."""
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    cfg = dict(block_size=4, max_kv_tokens=16, sink_tokens=4, max_model_len=64, kv_cache_dtype=kv)

    def run(prompts: list[list[int]], **more: object) -> tuple[dict, dict]:
        return run_engine(Engine(moe, EngineConfig(**{**cfg, **more}), quiet=True), prompts, long)

    shared = random_prompts(1, 23, lo=24, hi=24)[0]
    prompts = [shared + p for p in random_prompts(3, 24, lo=2, hi=16)]
    ref = run(prompts, enable_prefix_caching=False)
    assert all(len(t) == 120 for t in ref[0].values())
    assert_identical(ref, run(prompts, max_num_batched_tokens=7, enable_prefix_caching=False), "chunked vs whole")
    t, lg = run([prompts[1]], enable_prefix_caching=False)
    assert_identical(({1: ref[0][1]}, {1: ref[1][1]}), ({1: t[0]}, {1: lg[0]}), "alone vs batch")
    eng = Engine(moe, EngineConfig(**cfg), quiet=True)
    run_engine(eng, [shared + [1]], SamplingParams(temperature=0, max_tokens=1))  # warm the prefix cache
    assert_identical(ref, run_engine(eng, prompts, long), "prefix hit vs miss")
    assert eng.scheduler.prefix_cache_hits > 0
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        assert_identical(ref, run(prompts, enable_prefix_caching=False), "1 vs 2 threads")
    finally:
        torch.set_num_threads(before)


def test_json_schema_outputs_validate_and_neighbours_keep_their_bits(moe: Path) -> None:
    llm = LLM(str(moe))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=SO(json=SCHEMA))
              for s in range(6)]
    outs = llm.generate([{"prompt_token_ids": [5, 17, 99, 3 + s]} for s in range(6)], params)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    # unconstrained rows batched with constrained ones: the same tokens and logits as a batch without them
    prompts = random_prompts(4, 5, lo=3, hi=20)
    free = run_engine(Engine(moe, EngineConfig(block_size=4), quiet=True), prompts[:2], GREEDY)
    eng = Engine(moe, EngineConfig(block_size=4), quiet=True)
    mixed = [GREEDY, GREEDY] + [SamplingParams(temperature=0, max_tokens=10, structured_outputs=SO(json=SCHEMA))] * 2
    for p in mixed[2:]:
        eng.grammars.compile(p.structured_outputs)
    got = run_engine(eng, prompts, mixed)
    assert_identical(free, ({i: got[0][i] for i in (0, 1)}, {i: got[1][i] for i in (0, 1)}),
                     "unconstrained rows beside constrained ones")


def _spec_run(path: Path, method: str | None, params: SamplingParams | list[SamplingParams],
              prompts: list[list[int]]) -> tuple[list[tuple], int]:
    spec = None if method is None else {"method": method, "num_speculative_tokens": 4, "draft_rows": 64}
    eng = Engine(path, EngineConfig(block_size=4, speculative_config=spec), quiet=True)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for p in plist:
        if p.structured_outputs is not None:
            eng.grammars.compile(p.structured_outputs)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    while eng.has_unfinished:
        eng.step()
        eng.scheduler.check()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    acc = 0 if eng.speculator is None else eng.speculator.stats.num_accepted_tokens
    return [(r.output_token_ids, r.logprobs, r.text, r.finish_reason) for r in reqs], acc


@pytest.mark.parametrize("params", [SPEC_GREEDY, SPEC_SEEDED], ids=["greedy", "seeded"])
def test_speculative_decoding_identical_in_a_batch_of_16(repeating: Path, params: SamplingParams) -> None:
    ref, _ = _spec_run(repeating, None, params, PROMPTS)
    accepted = 0
    for method in ("ngram", "suffix"):
        got, acc = _spec_run(repeating, method, params, PROMPTS)
        assert got == ref, method
        accepted += acc
    assert accepted > 0, "no draft accepted"


def test_speculative_decoding_identical_under_a_json_schema(repeating: Path) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16, logprobs=5,
                             structured_outputs=SO(json=SCHEMA)) for s in range(8)]
    ref, _ = _spec_run(repeating, None, params, PROMPTS[:8])
    got, _ = _spec_run(repeating, "ngram", params, PROMPTS[:8])
    assert got == ref


@pytest.mark.parametrize("spec", [[], ["--speculative", "ngram", "--num-speculative-tokens", "3"]],
                         ids=["plain", "ngram"])
def test_generate_check_exact(repeating: Path, spec: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kvlm.cli.main import main

    args = ["generate", str(repeating), "ab ab ab ab", "--max-tokens", "12", "--ignore-eos", "--check-exact", *spec]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "kvlm: bit-identical on 12 tokens" in out, (out, err)

"""Tests for kvlm.engine.input_processor without a model: a real byte-level tokenizer, a real block manager and
grammar compiler. Each refusal names its field (`.param`) in one line; what passes becomes a `Request` with
its detokenizer, its seeded generator and its grammar; request ids are handed out only to requests that pass
the prompt's checks."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from tiny_models import VOCAB, byte_level_fields

from kvlm.config import EngineConfig
from kvlm.engine.input_processor import InputProcessor
from kvlm.errors import ParameterError, PromptTooLongError
from kvlm.kv_cache.block_manager import BlockManager
from kvlm.sampling_params import SamplingParams
from kvlm.sampling_params import StructuredOutputsParams as SO
from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.matcher import RequestGrammar
from kvlm.tokenizer.tokenizer import Tokenizer

CONTEXT = 64


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_fields(byte_level_fields())


@pytest.fixture(scope="module")
def grammars(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB)


def processor(tok: Tokenizer, grammars: GrammarCompiler, num_blocks: int = 8, windows: tuple[int, ...] = (),
              **cfg: Any) -> InputProcessor:
    """A processor for a model of VOCAB ids and a context of 64 tokens, over a pool of `num_blocks` x 16."""
    config = EngineConfig(**cfg)
    bm = BlockManager(num_blocks, config.block_size, enable_prefix_caching=True)
    return InputProcessor(config, tok, VOCAB, CONTEXT, bm, windows, grammars, torch.device("cpu"))


def refused(proc: InputProcessor, prompt: Any, params: SamplingParams | None = None) -> ParameterError:
    with pytest.raises(ParameterError) as err:
        proc.process(prompt, params)
    return err.value


def test_token_ids_outside_the_vocabulary(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    p = processor(tok, grammars)
    e = refused(p, [])
    assert (e.param, str(e)) == ("prompt", "prompt is empty")
    for bad in ([1, VOCAB], [1, -1], [1, True], [1, 2.0]):
        e = refused(p, bad)
        assert (e.param, str(e)) == ("prompt_token_ids", f"prompt_token_ids must be integers in [0, {VOCAB})")
    e = refused(p, [1, 2], SamplingParams(stop_token_ids=[3, VOCAB + 5]))
    assert (e.param, str(e)) == ("stop_token_ids",
                                 f"stop_token_ids must be in [0, {VOCAB}) (the vocabulary), got {VOCAB + 5}")
    e = refused(p, [1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert (e.param, str(e)) == ("logit_bias",
                                 f"logit_bias token ids must be in [0, {VOCAB}) (the vocabulary), got {VOCAB}")
    assert p.process([0, VOCAB - 1], SamplingParams(stop_token_ids=[VOCAB - 1])).prompt_token_ids == [0, VOCAB - 1]


def test_prompt_against_the_context_and_the_pool(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    p = processor(tok, grammars, num_blocks=2)  # 32 slots, a context of 64
    with pytest.raises(PromptTooLongError, match="prompt has 64 tokens; the context holds 64 "
                                                 r"\(room for at least one output token is needed\)"):
        p.process([1] * CONTEXT)
    # prompt + max_tokens (None: up to the context) must fit the whole pool, or the request could never run
    with pytest.raises(PromptTooLongError, match="request needs 64 tokens of KV cache but the whole pool holds 32"):
        p.process([1] * 10, SamplingParams(max_tokens=None))
    with pytest.raises(PromptTooLongError, match="request needs 33 tokens"):
        p.process([1] * 10, SamplingParams(max_tokens=23))
    assert p.process([1] * 10, SamplingParams(max_tokens=22)).num_prompt_tokens == 10
    assert issubclass(PromptTooLongError, ValueError)


def test_request_ids(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    p = processor(tok, grammars)
    refused(p, [])  # refused before it gets an id: the next request is still req-0
    assert p.process([1], SamplingParams(max_tokens=2)).request_id == "req-0"
    assert p.process([1], SamplingParams(max_tokens=2), request_id="mine").request_id == "mine"
    with pytest.raises(ValueError, match="request id 'mine' is already in use"):
        p.process([1], SamplingParams(max_tokens=2), request_id="mine", in_use={"mine"})
    with pytest.raises(ValueError, match="request id 'req-1' is already in use"):
        p.process([1], SamplingParams(max_tokens=2), in_use={"req-1"})
    assert p.process([1], SamplingParams(max_tokens=2)).request_id == "req-2"


def test_translation(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    p = processor(tok, grammars)
    req = p.process("hello", SamplingParams(max_tokens=4, seed=7))
    assert req.prompt == "hello" and req.prompt_token_ids == tok.encode("hello")
    assert req.num_prompt_tokens == req.metrics.num_prompt_tokens == len(req.prompt_token_ids)
    assert req.detokenizer is not None and req.grammar is None and req.kv_policy is None
    again = p.process("hello", SamplingParams(max_tokens=4, seed=7))
    assert req.seed == again.seed == 7
    unseeded = [p.process("hello", SamplingParams(max_tokens=4)).seed for _ in range(2)]
    assert None not in unseeded and unseeded[0] != unseeded[1]  # drawn at admission
    ids = p.process([104, 105])
    assert ids.prompt is None and ids.prompt_token_ids == [104, 105]


def test_bounded_cache_policy(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    p = processor(tok, grammars)
    bounded = SamplingParams(max_kv_tokens=48, sink_tokens=4, max_tokens=200)
    req = p.process([1] * 100, bounded)  # past the context: a bounded cache is not held to it
    assert req.kv_policy is not None and req.kv_policy.max_tokens == 48 and req.kv_policy.num_sinks == 16
    e = refused(p, [1], SamplingParams(max_kv_tokens=40))
    assert e.param == "max_kv_tokens" and "multiple of the block size 16" in str(e)
    e = refused(processor(tok, grammars, kv_cache_layout="contiguous"), [1], bounded)
    assert (e.param, str(e)) == ("max_kv_tokens", "max_kv_tokens (a bounded KV cache) needs the paged KV cache; "
                                 "drop --no-kv-cache / --kv-cache-layout contiguous")
    # Sliding layers keep their own window and never see the sinks: the kept tokens must cover it.
    e = refused(processor(tok, grammars, windows=(32,)), [1], SamplingParams(max_kv_tokens=48, sink_tokens=4))
    assert str(e) == ("max_kv_tokens must be at least 64 on this model (its sliding layers' window of 32 tokens, "
                      "the 16 sinks and a block), got 48")
    # an engine-wide bad setting is refused at start, not per request
    with pytest.raises(ParameterError) as err:
        processor(tok, grammars, max_kv_tokens=40)
    assert err.value.param == "max_kv_tokens"


def test_grammar_known_bad_refused_now(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    bad = SO(regex="(unclosed")
    with pytest.raises(ParameterError):
        grammars.compile(bad)  # compiled (and its failure cached) before the request comes
    e = refused(processor(tok, grammars), [1, 2], SamplingParams(max_tokens=4, structured_outputs=bad))
    assert e.param == "structured_outputs" and str(e).startswith("structured_outputs: invalid regex")
    good = processor(tok, grammars).process([1, 2], SamplingParams(max_tokens=4, structured_outputs=SO(choice=["a"])))
    assert good.grammar is not None


def test_grammar_failing_after_queueing(tok: Tokenizer, grammars: GrammarCompiler) -> None:
    """A request queued while its grammar compiled is found once the compile fails; while it compiles, a
    step with nothing else to run waits for it (briefly)."""
    p = processor(tok, grammars)
    plain, compiling = p.process([1]), p.process([2])
    pending: Future = Future()
    compiling.grammar = RequestGrammar(pending, grammars.mask_words)
    assert p.failed_grammars([plain, compiling]) == []
    t0 = time.perf_counter()
    assert p.wait_for_grammars([plain, compiling], timeout=0.05)
    assert time.perf_counter() - t0 >= 0.04
    assert not p.wait_for_grammars([plain])
    pending.set_exception(ParameterError("structured_outputs", "structured_outputs: invalid regex: x"))
    assert p.failed_grammars([plain, compiling]) == [compiling]

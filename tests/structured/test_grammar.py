"""The grammar machinery without a model: llguidance behind kvlm's tokenizers accepts exactly the strings a
schema or regex allows, the applied mask is -inf exactly where the grammar forbids a token (padded ids
included), EOS only where the grammar accepts, and the token bytes llguidance sees are kvlm's decode."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from tiny_models import byte_level_fields

from kvlm.errors import ParameterError
from kvlm.sampling_params import SamplingParams
from kvlm.sampling_params import StructuredOutputsParams as SO
from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.mask import apply_grammar_masks, grammar_bitmask
from kvlm.tokenizer.tokenizer import Tokenizer

PERSON = {  # what openai's parse() sends for a nested Pydantic model: $defs/$ref, anyOf (Optional), enum
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False,
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string", "enum": ["cat", "dog"]}},
                      "required": ["kind"], "additionalProperties": False}},
}
CASES = [  # (spec, strings the grammar must accept, strings it must refuse)
    (SO(json=PERSON), ['{"name":"Al","age":3,"pet":{"kind":"cat"},"tags":[]}',
                       '{"name":"","age":-1,"pet":null,"tags":["a","b"]}'],
     ['{"name":"Al","age":3,"pet":{"kind":"cow"},"tags":[]}', '{"name":"Al","age":3}',
      '{"name": "Al","age":3,"pet":null,"tags":[]}', '{"name":"Al","age":"3","pet":null,"tags":[]}']),
    (SO(json={"const": "42"}), ['"42"'], ['"43"', '42']),
    (SO(json={"type": "array", "items": {"type": "integer"}, "minItems": 1}), ["[1]", "[1,-20]"], ["[]", "[1.5]"]),
    (SO(json_object=True), ['{}', '{"a":[1,{"b":null}]}'], ['[]', '"x"', '{"a":}']),
    (SO(regex="[0-9]{3}"), ["123", "000"], ["12", "1234", "abc"]),
    (SO(choice=["yes", "no", "maybe so"]), ["yes", "maybe so"], ["ye", "yes!", "Yes"]),
    (SO(grammar='start: "SELECT " COL " FROM t"\nCOL: /[a-z]+/'), ["SELECT a FROM t"], ["SELECT 1 FROM t"]),
    (SO(grammar='root ::= "a" [0-9]+'), ["a1", "a42"], ["a", "b1"]),  # GBNF
]


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_fields(byte_level_fields())


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    from kvlm.loader.gguf import read_gguf
    from kvlm.tokenizer.cache import gguf_tokenizer

    return gguf_tokenizer(smollm2_gguf, read_gguf(smollm2_gguf)[1])


def accepts(comp: GrammarCompiler, spec: SO, tok: Tokenizer, text: str) -> bool:
    """True when the grammar takes `text`, tokenized as the model would see it, and may end there."""
    m = comp.compile(spec).deep_copy()
    ids = tok.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def check_cases(tok: Tokenizer) -> None:
    comp = GrammarCompiler(tok, tok.vocab_size)
    for spec, good, bad in CASES:
        for s in good:
            if spec.kind == "json":
                jsonschema.validate(json.loads(s), spec.json)  # the cases themselves are right
            assert accepts(comp, spec, tok, s), (spec.kind, s)
        for s in bad:
            assert not accepts(comp, spec, tok, s), (spec.kind, s)


def test_accepts_and_refuses_tiny_gguf_tokenizer() -> None:
    check_cases(tiny_tokenizer())


@pytest.mark.slow
def test_accepts_and_refuses_smollm2_tokenizer(smollm2_tokenizer: Tokenizer) -> None:
    check_cases(smollm2_tokenizer)


def check_mask(tok: Tokenizer, padding: int, ids_to_check: list[int]) -> None:
    """The mask of a half-written object is -inf exactly where one more token would be refused."""
    V = tok.vocab_size + padding
    comp = GrammarCompiler(tok, V)
    spec = SO(json=PERSON)
    g = comp.request_grammar(spec)
    for t in tok.encode('{"name":"A', add_special_tokens=False):
        assert g.accept(t)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    out = apply_grammar_masks(logits, [1], [g])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # other rows: same bits
    masked = torch.isinf(out[1])
    assert masked[tok.vocab_size:].all()  # padded ids are never allowed
    kept = ~masked
    assert torch.equal(out[1][kept], logits[1][kept])
    probe = g.matcher
    for t in ids_to_check:
        assert bool(kept[t]) == (probe.validate_tokens([t]) == 1), t
    assert kept.sum() > 100  # a string may go on with almost anything


def test_mask_exact_tiny_gguf_tokenizer() -> None:
    tok = tiny_tokenizer()
    check_mask(tok, 13, list(range(tok.vocab_size)))


@pytest.mark.slow
def test_mask_exact_smollm2_tokenizer(smollm2_tokenizer: Tokenizer) -> None:
    ids = random.Random(0).sample(range(smollm2_tokenizer.vocab_size), 4000) + [0, 1, 2]
    check_mask(smollm2_tokenizer, 64, ids)  # 49152 + 64: a model whose vocabulary is padded


def test_eos_only_where_accepting_and_forced_when_stopped() -> None:
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    comp = GrammarCompiler(tok, tok.vocab_size)
    g = comp.request_grammar(SO(regex="[0-9]{1,3}"))

    def allowed() -> set[int]:
        bits = np.unpackbits(grammar_bitmask([g]).numpy().view(np.uint8), bitorder="little")[: tok.vocab_size]
        return set(np.nonzero(bits)[0].tolist())

    assert eos not in allowed()  # nothing written yet: the regex needs a digit
    g.accept(tok.encode("1", add_special_tokens=False)[0])
    assert eos in allowed() and len(allowed()) > 1  # may stop or go on
    for d in "23":
        g.accept(tok.encode(d, add_special_tokens=False)[0])
    assert g.is_stopped and allowed() == {eos}  # three digits: nothing else can follow, EOS is forced
    g.matcher.rollback(1)
    assert not g.is_stopped and allowed() > {eos}


def test_token_bytes_are_decode_bytes_every_id() -> None:
    check_token_bytes(tiny_tokenizer())


@pytest.mark.slow
def test_token_bytes_are_decode_bytes_smollm2(smollm2_tokenizer: Tokenizer) -> None:
    check_token_bytes(smollm2_tokenizer)


def check_token_bytes(tok: Tokenizer) -> None:
    """For every id, llguidance's bytes are the id's decode; where one id is only part of a UTF-8 character
    (decode shows U+FFFD), they are that part, and sequences decode the same."""
    lt = GrammarCompiler(tok, tok.vocab_size).lltokenizer
    for i in range(tok.vocab_size):
        text, raw = tok.decode([i], skip_special_tokens=False), lt.decode_bytes([i])
        if text == "\ufffd" and not raw and lt.is_special_token(i):
            # The lone byte 0xFF: llguidance spells special tokens with a leading 0xFF, so it takes this one
            # for a special token, which no text grammar allows. 0xFF never occurs in UTF-8: nothing is lost.
            continue
        if "\ufffd" not in text:
            assert raw == text.encode(), i
        else:
            assert raw.decode("utf-8", "replace") == text, i
    rng = random.Random(1)
    lone_ff = {i for i in range(tok.vocab_size) if lt.is_special_token(i) and not lt.decode_bytes([i])}
    assert len(lone_ff) <= 1
    for _ in range(200):
        ids = [t for t in (rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))) if t not in lone_ff]
        assert lt.decode_bytes(ids).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("spec", [SO(regex="[0-9"), SO(json={"type": "nonsense"}), SO(json="{not json"),
                                  SO(grammar="start: undefined_rule"), SO(json={"$ref": "#/$defs/Missing"})])
def test_bad_grammar_is_parameter_error(spec: SO) -> None:
    tok = tiny_tokenizer()
    with pytest.raises(ParameterError) as e:
        GrammarCompiler(tok, tok.vocab_size).compile(spec)
    assert e.value.param == "structured_outputs" and "\n" not in str(e.value)


@pytest.mark.parametrize("kw, needle", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"choice": []}, "choice must be"),
    ({"choice": ["a", 3]}, "choice"), ({"json": 5}, "json"), ({"regex": ""}, "regex must be a non-empty")])
def test_structured_outputs_params_checked(kw: dict, needle: str) -> None:
    with pytest.raises(ParameterError, match=needle) as e:
        SO(**kw)
    assert e.value.param == "structured_outputs"


def test_conflicts_with_min_tokens_and_ignore_eos_refused() -> None:
    for kw in ({"min_tokens": 3}, {"ignore_eos": True}):
        with pytest.raises(ParameterError, match="structured_outputs cannot be combined"):
            SamplingParams(structured_outputs=SO(regex="a"), **kw)


def test_compiles_once_per_grammar() -> None:
    tok = tiny_tokenizer()
    comp = GrammarCompiler(tok, tok.vocab_size)
    a = comp.submit(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = comp.submit(SO(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))  # same schema, as text
    assert a is b and len(comp.compile_seconds) == 1 or a.result() is b.result()
    c = comp.request_grammar(SO(regex="x+"))
    d = comp.request_grammar(SO(regex="x+"))
    c.accept(tok.encode("x", add_special_tokens=False)[0])
    assert c.matcher is not d.matcher and d.num_consumed == 0 and not d.matcher.is_accepting()  # own state


def test_compact_json_by_default() -> None:
    tok = tiny_tokenizer()
    comp = GrammarCompiler(tok, tok.vocab_size)
    spaced = '{"a": 1}'
    assert not accepts(comp, SO(json={"type": "object"}), tok, spaced)
    assert accepts(comp, SO(json={"type": "object"}, whitespace_pattern=" ?"), tok, spaced)
    assert re.fullmatch(r"\{.*\}", spaced)


@pytest.mark.slow
def test_choice_mask_is_every_prefix_token_smollm2(smollm2_tokenizer: Tokenizer) -> None:
    """choice=["yes", "no"] on SmolLM2's whole vocabulary: the first mask allows exactly the ids whose text is
    a non-empty prefix of a choice, and after "n" exactly those finishing "no". (README's
    `--choice yes --choice no` answering "no" is the model's own pick among these: SmolLM2-135M puts "no"
    at log-probability -4.71 and "yes" at -5.22 there, and answers "No." unconstrained.)"""
    tok = smollm2_tokenizer
    g = GrammarCompiler(tok, tok.vocab_size).request_grammar(SO(choice=["yes", "no"]))
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]

    def allowed() -> set[int]:
        bits = np.unpackbits(grammar_bitmask([g]).numpy().view(np.uint8), bitorder="little")[: tok.vocab_size]
        return set(np.nonzero(bits)[0].tolist())

    assert allowed() == {i for i, t in enumerate(texts) if t and ("yes".startswith(t) or "no".startswith(t))}
    assert g.accept(tok.encode("n", add_special_tokens=False)[0])
    assert allowed() == {i for i, t in enumerate(texts) if t and "o".startswith(t)}

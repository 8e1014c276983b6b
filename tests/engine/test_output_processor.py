"""Tests for kvlm.engine.output_processor: streaming text with stop strings held back, EOS / stop ids / min_tokens,
length limits, and UTF-8-safe streaming, with a real byte-level tokenizer (no model)."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_models import byte_level_fields

from kvlm.engine.output_processor import OutputProcessor
from kvlm.outputs import StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams
from kvlm.tokenizer.detokenizer import IncrementalDetokenizer
from kvlm.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_fields(byte_level_fields())


def make_req(tok: Tokenizer, prompt: str = "Q: ", **kw: Any) -> Request:
    kw.setdefault("max_tokens", None)
    ids = tok.encode(prompt)
    req = Request("r", list(ids), len(ids), SamplingParams(**kw), prompt=prompt)
    req.detokenizer = IncrementalDetokenizer(tok, ids)
    return req


def feed(proc: OutputProcessor, req: Request, ids: list[int]) -> list[StreamDelta]:
    """Append ids one at a time until the request finishes; check every delta on the way."""
    deltas: list[StreamDelta] = []
    for t in ids:
        d = proc.append_token(req, t, None)
        deltas.append(d)
        assert d.token_ids == [t] and d.request_id == "r"
        assert "\ufffd" not in d.text, f"partial character streamed: {d.text!r}"
        assert "".join(x.text for x in deltas) == req.text, "deltas must add up to req.text"
        assert d.finished == (req.finish_reason is not None) and d.finish_reason == req.finish_reason
        if d.finished:
            break
    return deltas


def by_bytes(text: str) -> list[int]:
    """One token per UTF-8 byte (ids 0..255 are the byte tokens of this vocab)."""
    return list(text.encode())


def proc_for(tok: Tokenizer, max_model_len: int = 10_000) -> OutputProcessor:
    return OutputProcessor(tok.eos_token_ids, max_model_len)


def test_plain_text_streams_completely(tok: Tokenizer) -> None:
    """Without stop conditions every token's text is streamed at once and req.text is the decoded output."""
    text = "hello world, hello again"
    req = make_req(tok)
    deltas = feed(proc_for(tok), req, tok.encode(text))
    assert all(d.text for d in deltas) and not deltas[-1].finished
    assert req.text == text == tok.decode(req.output_token_ids)
    assert req.metrics.num_generated_tokens == len(deltas) and req.pending_text == ""


@pytest.mark.parametrize(("text", "stop", "before", "merged"), [
    ("abc STOP tail", "STOP", "abc ", False),
    ("hello world and more", "llo w", "he", True),  # spans the merged tokens "hello" and " w"
    ("say hello there", "ell", "say h", True),  # inside the one token "hello"
    ("xaaab rest", "aab", "xa", False),  # the stop's prefix overlaps itself
    ("price: 日本円 ok", "日本", "price: ", False),  # multi-byte stop split over byte tokens
])
def test_stop_string_never_streamed(tok: Tokenizer, text: str, stop: str, before: str, merged: bool) -> None:
    """A stop string split across tokens never appears in any delta or in req.text; the text before it is
    complete; nothing streamed is ever retracted."""
    req = make_req(tok, stop=[stop])
    ids = tok.encode(text) if merged else by_bytes(text)
    assert (len(ids) < len(text)) == merged
    deltas = feed(proc_for(tok), req, ids)
    assert req.finish_reason == "stop" and req.stop_reason == stop
    assert req.text == before
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finished and len(deltas) < len(ids)


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    """include_stop_str_in_output keeps the stop string (and nothing after it) in the text."""
    req = make_req(tok, stop="STOP", include_stop_str_in_output=True)
    feed(proc_for(tok), req, by_bytes("abc STOP tail"))
    assert req.text == "abc STOP" and req.stop_reason == "STOP"


def test_held_back_text_released_when_not_a_stop(tok: Tokenizer) -> None:
    """A possible stop prefix is held back, then streamed as soon as the next text rules the stop out."""
    req = make_req(tok, stop=["STOP"])
    deltas = feed(proc_for(tok), req, by_bytes("a STx"))
    assert [d.text for d in deltas] == ["a", " ", "", "", "STx"]
    assert req.text == "a STx" and req.finish_reason is None and req.pending_text == ""


def test_held_back_text_released_at_length_finish(tok: Tokenizer) -> None:
    """If generation ends while a stop prefix is held back, that text is final and released."""
    req = make_req(tok, stop=["STOP"], max_tokens=4)
    deltas = feed(proc_for(tok), req, by_bytes("a STO and on"))
    assert req.finish_reason == "length" and req.text == "a ST" and deltas[-1].text == "ST"


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    """With several stop strings the text is cut at the first one to occur."""
    req = make_req(tok, stop=["world", "lo w"])
    feed(proc_for(tok), req, by_bytes("hello world"))
    assert req.text == "hel" and req.stop_reason == "lo w"


def test_eos_finishes_with_stop_and_no_text(tok: Tokenizer) -> None:
    """EOS ends the request with finish_reason 'stop', no stop_reason, and adds no text."""
    eos = tok.eos_token_id
    assert eos is not None
    req = make_req(tok)
    deltas = feed(proc_for(tok), req, tok.encode("hi") + [eos, 65, 66])
    assert len(deltas) == 3 and deltas[-1].text == "" and deltas[-1].finished
    assert req.finish_reason == "stop" and req.stop_reason is None and req.text == "hi"
    assert req.output_token_ids[-1] == eos


def test_ignore_eos_keeps_going(tok: Tokenizer) -> None:
    """ignore_eos: EOS does not finish the request (and, being special, adds no text); max_tokens does."""
    eos = tok.eos_token_id
    assert eos is not None
    req = make_req(tok, ignore_eos=True, max_tokens=5)
    feed(proc_for(tok), req, [104, eos, 105, eos, 33, 34])
    assert req.finish_reason == "length" and req.num_output_tokens == 5 and req.text == "hi!"


def test_min_tokens_delays_eos(tok: Tokenizer) -> None:
    """EOS before min_tokens outputs is ignored; after that it finishes the request."""
    eos = tok.eos_token_id
    assert eos is not None
    req = make_req(tok, min_tokens=4)
    deltas = feed(proc_for(tok), req, [eos, 97, eos, 98, 99, eos, 100])
    assert len(deltas) == 6 and req.finish_reason == "stop" and req.text == "abc"


def test_min_tokens_delays_stop_strings(tok: Tokenizer) -> None:
    """A stop string completed before min_tokens is ordinary text; a later occurrence stops."""
    req = make_req(tok, stop=["ab"], min_tokens=5)
    feed(proc_for(tok), req, by_bytes("ab-xyz-ab-tail"))
    assert req.text == "ab-xyz-" and req.stop_reason == "ab"


def test_min_tokens_ignores_stop_completed_earlier_with_several_stops(tok: Tokenizer) -> None:
    """Adding a second stop string must not change whether an early (pre-min_tokens) "\n" counts."""
    texts = []
    for stops in (["\n"], ["\n", "\n\n"]):
        req = make_req(tok, stop=stops, min_tokens=3)
        feed(proc_for(tok), req, by_bytes("x\nyz\nw"))
        texts.append((req.text, req.num_output_tokens))
    assert texts[0] == ("x\nyz", 5)
    assert texts[1] == texts[0]


def test_stop_token_id(tok: Tokenizer) -> None:
    """A token in stop_token_ids finishes with 'stop', stop_reason = that id, and its text is not included."""
    req = make_req(tok, stop_token_ids=[ord("!")])
    feed(proc_for(tok), req, by_bytes("hi! more"))
    assert req.finish_reason == "stop" and req.stop_reason == ord("!") and req.text == "hi"


def test_max_tokens_length(tok: Tokenizer) -> None:
    """max_tokens outputs end the request with 'length'."""
    req = make_req(tok, max_tokens=3)
    deltas = feed(proc_for(tok), req, by_bytes("abcdef"))
    assert len(deltas) == 3 and req.finish_reason == "length" and req.text == "abc"


def test_max_model_len_length(tok: Tokenizer) -> None:
    """Reaching max_model_len total tokens (prompt + output) ends the request with 'length'."""
    req = make_req(tok, prompt="Q: ")
    proc = proc_for(tok, max_model_len=req.num_prompt_tokens + 4)
    deltas = feed(proc, req, by_bytes("abcdefgh"))
    assert len(deltas) == 4 and req.finish_reason == "length" and req.text == "abcd"
    assert req.num_tokens == proc.max_model_len


@pytest.mark.parametrize("text", ["Hi 😀 there", "日本語のテキスト", "a👨‍👩‍👧b 🇺🇸 ü é 中文", "😀😀"])
def test_multibyte_characters_never_stream_partially(tok: Tokenizer, text: str) -> None:
    """Byte tokens of multi-byte characters never stream a partial character (no U+FFFD, checked in feed);
    deltas add up to req.text == tokenizer.decode(output ids) == the text."""
    req = make_req(tok, max_tokens=len(text.encode()))
    deltas = feed(proc_for(tok), req, by_bytes(text))
    assert req.finish_reason == "length"
    assert "".join(d.text for d in deltas) == req.text == tok.decode(req.output_token_ids) == text
    assert any(d.text == "" for d in deltas), "continuation bytes must be held back"


def test_length_finish_inside_a_character_flushes(tok: Tokenizer) -> None:
    """Cut off inside a character: the complete text is streamed, and the final text equals the tokenizer's
    decode of the output ids (ending in U+FFFD for the dangling bytes), never silently dropped."""
    req = make_req(tok, max_tokens=4)
    proc = proc_for(tok)
    deltas = [proc.append_token(req, t, None) for t in by_bytes("ab😀")[:4]]
    assert [d.text for d in deltas[:3]] == ["a", "b", ""]
    assert req.finish_reason == "length" and deltas[-1].finished
    assert req.text == tok.decode(req.output_token_ids) == "ab\ufffd" and deltas[-1].text == "\ufffd"


def test_multibyte_streaming_without_finish(tok: Tokenizer) -> None:
    """Mid-stream, req.text is always a prefix of the full text made of whole characters."""
    text = "x😀y日本z"
    req = make_req(tok)
    proc = proc_for(tok)
    for t in by_bytes(text):
        proc.append_token(req, t, None)
        assert text.startswith(req.text)
    assert req.text == text


def test_logprobs_recorded(tok: Tokenizer) -> None:
    """Logprob dicts passed with each token are appended to req.logprobs in order."""
    req = make_req(tok)
    proc = proc_for(tok)
    proc.append_token(req, 97, {97: -0.1, 98: -2.0})
    proc.append_token(req, 98, {98: -0.5})
    assert req.logprobs == [{97: -0.1, 98: -2.0}, {98: -0.5}]

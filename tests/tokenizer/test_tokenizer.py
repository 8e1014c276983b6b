"""Tests for kvlm.tokenizer.tokenizer: parity with transformers on the real SmolLM2 GGUF, chat templates,
streaming detokenization, and small handmade vocabularies that need no model file."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy
import pytest
from deps import need
from jinja2.exceptions import SecurityError
from tiny_models import BYTE, byte_level_fields
from tokenizer_cases import (
    PRE_CORPUS,
    PRE_NO_HF_SPLIT,
    PRE_TOKENIZERS,
    SPM_TEXTS,
    SPM_TRANSFORMERS_DIFFERS,
    bpe_fields,
    llama_cpp_ids,
    read_gguf_fields,
    spm_fields,
    write_spm_gguf,
)
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFBackend

from kvlm.tokenizer.detokenizer import IncrementalDetokenizer
from kvlm.tokenizer.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # tabs too\n",
    "日本語のテキストと中文字符，한국어도 있어요。",
    "emoji 😀👍🏽🇺🇸 family 👨‍👩‍👧 done",
    "  lots   of\t\tspace \n\n\n x  \r\n\t",
    "numbers 1234567, 3.14159 and -42",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure he's fine; they'll see WE'RE right",
    "a<|endoftext|>b<repo_name>c",
    "",
    " ",
    "\n",
]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? 😀"},
]


# ------------------------------------------------------------------------------------ real model
@pytest.fixture(scope="session")
def smollm_fields(smollm2_gguf: Path) -> dict[str, Any]:
    return read_gguf_fields(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm(smollm_fields: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_fields(smollm_fields)


@pytest.fixture(scope="session")
def hf_smollm(smollm2_gguf: Path) -> Any:
    transformers = need("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_smollm_metadata(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id) == (1, 2)
    assert smollm.eos_token_ids == frozenset({2})
    assert smollm.chat_template and "<|im_start|>" in smollm.chat_template
    # The file says add_bos_token=False, so no BOS even with add_special_tokens=True.
    assert smollm.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert smollm.decode([1, 4093, 198, 6004, 2]) == "user\nhi"
    assert smollm.decode([1, 4093, 198, 6004, 2], skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(smollm: Tokenizer, hf_smollm: Any, text: str) -> None:
    ids = smollm.encode(text)
    assert ids == hf_smollm.encode(text)
    assert smollm.encode(text, add_special_tokens=False) == hf_smollm.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert smollm.decode(ids, skip_special_tokens=skip) == hf_smollm.decode(ids, skip_special_tokens=skip)
    assert smollm.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


@pytest.mark.slow
@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["with-system", "without-system"])
def test_chat_template_matches_transformers(smollm: Tokenizer, hf_smollm: Any, messages: list) -> None:
    ours = smollm.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", ["日本語のテキストと中文字符", "emoji 😀👍🏽🇺🇸 family 👨‍👩‍👧 done, ok 🎉"])
def test_incremental_detokenizer_multibyte(smollm: Tokenizer, text: str) -> None:
    ids = smollm.encode(text)
    # The premise: some characters really are split across tokens in this vocab.
    assert any("\ufffd" in smollm.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(smollm)
    chunks = _stream(detok, ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == detok.text == smollm.decode(ids) == text


def test_incremental_detokenizer_with_prompt(smollm: Tokenizer) -> None:
    prompt = smollm.encode(smollm.apply_chat_template([{"role": "user", "content": "hi"}]))
    ids = smollm.encode("Sure 😀 — 中文 ok") + [smollm.eos_token_id]
    chunks = _stream(IncrementalDetokenizer(smollm, prompt), ids)
    assert "".join(chunks) == "Sure 😀 — 中文 ok"
    chunks = _stream(IncrementalDetokenizer(smollm, prompt, skip_special_tokens=False), ids)
    assert "".join(chunks) == "Sure 😀 — 中文 ok<|im_end|>"


def test_incremental_detokenizer_random_ids(smollm: Tokenizer) -> None:
    # Random ids produce invalid UTF-8 everywhere; U+FFFD may only appear where the full decode has it.
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(smollm.vocab_size) for _ in range(rng.randrange(1, 60))]
        full = smollm.decode(ids)
        detok = IncrementalDetokenizer(smollm)
        for i in ids:
            detok.push(i)
            assert full.startswith(detok.text)
        detok.flush()
        assert detok.text == full


# -------------------------------------------------------------------------- handmade vocabularies
def test_byte_level_handmade() -> None:
    tok = Tokenizer.from_gguf_fields(byte_level_fields())
    n = tok.vocab_size
    assert tok.add_bos_token is False  # smollm pre-tokenizer: llama.cpp adds no BOS unless told
    assert tok.encode("hello world") == [259, 260, ord("o"), ord("r"), ord("l"), ord("d")]
    assert tok.encode("<|im_start|>hello<|im_end|><think>") == [n - 3, 259, n - 2, n - 1]
    assert tok.decode(tok.encode("<|im_start|>hi<think>")) == "hi<think>"  # user-defined is text, not special
    assert tok.decode(numpy.array(tok.encode("hello"))) == "hello"  # numpy ids are fine
    assert tok.eos_token_ids == frozenset({n - 2})
    with_bos = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hi") == [n - 3, ord("h"), ord("i")]
    assert with_bos.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    eot = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.eot_token_id": n - 1}))
    assert eot.eos_token_ids == frozenset({n - 2, n - 1})


def test_byte_level_incremental_splits_every_character() -> None:
    tok = Tokenizer.from_gguf_fields(byte_level_fields())
    text = "héllo 😀 中文 👨‍👩‍👧!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    chunks = _stream(detok, ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == text
    # A multi-byte character is emitted exactly when its last byte arrives, not later.
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in "中".encode()] == ["", "", "中"]
    # A genuinely truncated character comes out as U+FFFD only at flush, as the full decode has it.
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in "a中".encode()[:3]] == ["a", "", ""]
    assert detok.flush() == "\ufffd" and tok.decode(list("a中".encode()[:3])) == "a\ufffd"


def test_sentencepiece_handmade() -> None:
    tok = Tokenizer.from_gguf_fields(spm_fields())
    piece = {t: i for i, t in enumerate(spm_fields()["tokenizer.ggml.tokens"])}
    assert tok.add_bos_token is True  # sentencepiece default when the file does not say
    ids = tok.encode("hello world")
    assert ids == [1, piece["▁hello"], piece["▁world"]]
    assert tok.decode(ids) == "hello world"
    # Characters outside the vocab fall back to byte pieces and decode back exactly.
    ids = tok.encode("hé😀", add_special_tokens=False)
    assert ids[0] == piece["▁h"] and all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids) == "hé😀"
    # Like llama.cpp: the text after a special token gets the dummy-prefix space too.
    assert tok.encode("<s>[INST] hello", add_special_tokens=False) == [1, piece["▁[INST]"], piece["▁hello"]]
    no_prefix = Tokenizer.from_gguf_fields(spm_fields(**{"tokenizer.ggml.add_space_prefix": False,
                                                          "tokenizer.ggml.add_bos_token": False}))
    assert no_prefix.encode("hello") == [piece["he"], piece["llo"]]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"


def test_sentencepiece_incremental_byte_fallback() -> None:
    tok = Tokenizer.from_gguf_fields(spm_fields())
    text = "hello 😀 world 中文"
    ids = tok.encode(text, add_special_tokens=False)
    chunks = _stream(IncrementalDetokenizer(tok), ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == text
    # Context from the prompt keeps the space that sentencepiece strips at the start of a decode.
    prompt = tok.encode("hello")
    assert "".join(_stream(IncrementalDetokenizer(tok, prompt), tok.encode(" world", False)[1:])) == " world"
    rng = random.Random(1)
    for _ in range(30):  # random byte pieces: invalid groups must match the full decode exactly
        ids = [rng.choice([rng.randrange(3, 259), rng.randrange(259, tok.vocab_size)]) for _ in range(30)]
        detok = IncrementalDetokenizer(tok)
        for i in ids:
            detok.push(i)
            assert tok.decode(ids).startswith(detok.text)
        detok.flush()
        assert detok.text == tok.decode(ids)


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """The same sentencepiece GGUF vocab in kvlm and in transformers."""
    need("gguf")
    transformers = need("transformers")
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return Tokenizer.from_gguf_fields(spm_fields()), transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", [t for t in SPM_TEXTS if t not in SPM_TRANSFORMERS_DIFFERS])
def test_sentencepiece_matches_transformers(spm_pair: tuple[Tokenizer, Any], text: str) -> None:
    tok, hf = spm_pair
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_ids_are_llama_cpps(text: str) -> None:
    """kvlm's ids are llama.cpp's (llama-cpp-python 0.3.36 on the same GGUF file, recorded by
    scripts/record_llama_cpp_ids.py), the four texts where transformers' GGUF tokenizer differs included.
    There llama.cpp and kvlm are right: with a leading space (" hello": '▁', '▁hello') they do what
    sentencepiece itself does with Llama's settings (add_dummy_prefix on, extra whitespace kept: the
    dummy '▁' and the text's own space are two), where transformers' Metaspace merges them; after a special
    token ("</s>hello": '</s>', '▁hello') they give each text span between special tokens its own dummy
    prefix, as Meta's Llama code encodes each span with sentencepiece, where transformers adds it only at
    the start of the input."""
    rec = llama_cpp_ids()["spm"]
    tok = Tokenizer.from_gguf_fields(spm_fields())
    assert tok.encode(text) == rec["ids"][rec["texts"].index(text)]


# ------------------------------------------------------------------------------ templates, errors
def test_template_sandbox_blocks_internals() -> None:
    for source in ["{{ ''.__class__.__mro__ }}", "{{ ''.__class__ }}", "{{ messages.__class__.__base__ }}"]:
        tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.chat_template": source}))
        with pytest.raises((SecurityError, TokenizerError), match="unsafe"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception() -> None:
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.chat_template": source}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_helpers_and_kwargs() -> None:
    source = ("{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}|{{ eos_token }}|"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
              "{{ tools is none }}|{{ enable_thinking | default('unset') }}|{{ 'name' in messages[0] }}")
    tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.chat_template": source}))
    messages = [{"role": "user", "content": "<a & 'b'> é", "name": None}, {"role": "x", "content": ""}]
    out = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert out == '{"role": "user", "content": "<a & \'b\'> é"}|4|<|im_start|>|<|im_end|>|user|True|unset|False'
    assert tok.apply_chat_template(messages, enable_thinking=False).split("|")[-2] == "False"


def test_template_errors_are_tokenizer_errors() -> None:
    tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.chat_template": None}))
    with pytest.raises(TokenizerError, match="model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_tokenizer_data() -> None:
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(TokenizerError, match="None"):
        Tokenizer.from_gguf_fields({})
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.pre": "no-such-pre"}))
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.token_type": [1, 1]}))
    with pytest.raises(TokenizerError, match="malformed merge 'abc'"):
        Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.merges": ["abc"]}))
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_gguf_fields(spm_fields(**{"tokenizer.ggml.scores": None}))
    tok = Tokenizer.from_gguf_fields(byte_level_fields())
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).push(-1)


@pytest.mark.parametrize("pre", PRE_TOKENIZERS)
def test_pre_tokenizer_splits_match_transformers(pre: str, tmp_path: Path) -> None:
    """kvlm's pre-token splits equal those of transformers' tokenizer for the same GGUF file, on text with
    digits, contractions, whitespace runs, CJK and emoji (and round-trip through encode/decode)."""
    transformers = need("transformers")
    from tiny_models import write_tiny_gguf

    write_tiny_gguf(tmp_path / "t.gguf", fields={"tokenizer.ggml.pre": pre})
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.ggml.pre": pre}))
    for text in PRE_CORPUS:
        assert tok.decode(tok.encode(text)) == text
        ours = [piece for piece, _ in tok._backend.pre_tokenizer.pre_tokenize_str(text)]
        theirs = [piece for piece, _ in hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == theirs, text


@pytest.mark.parametrize("pre", PRE_TOKENIZERS + PRE_NO_HF_SPLIT)
def test_pre_tokenizer_ids_are_llama_cpps(smollm_fields: dict[str, Any], pre: str) -> None:
    """kvlm's ids equal llama.cpp's (llama-cpp-python 0.3.36, recorded by scripts/record_llama_cpp_ids.py) for
    every pre-tokenizer, under SmolLM2's vocab and merges, which cross the places where the regexes differ:
    the twelve give seven different id lists on these texts, so a wrong split shows. For the six of
    PRE_NO_HF_SPLIT transformers has no split regex and falls back to GPT-2's, so llama.cpp's ids are the
    only reference: kvlm uses llama.cpp's regex for each, and agrees with it on every text here."""
    rec = llama_cpp_ids()["pre"]
    assert rec["texts"] == PRE_CORPUS
    tok = Tokenizer.from_gguf_fields(bpe_fields(smollm_fields, pre))
    for text, ids in zip(PRE_CORPUS, rec["ids"][pre], strict=True):
        assert tok.encode(text, add_special_tokens=False) == ids, text


# ------------------------------------------------------------------------------------- HF folders
def _write_hf_dir(path: Path, config: dict[str, Any], generation: dict[str, Any] | None = None,
                  bos_post_processor: bool = False) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2, **{BYTE[b]: 3 + b for b in range(256)}}
    vocab["he"], vocab["ll"] = 259, 260
    backend = HFBackend(models.BPE(vocab, [("h", "e"), ("l", "l")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<|eot|>")])
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))


def test_from_hf_dir(tmp_path: Path) -> None:
    config = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"}, "add_bos_token": True,
              "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}<|eot|>{% endfor %}"}
    _write_hf_dir(tmp_path / "a", config, generation={"eos_token_id": [1, 2]})
    tok = Tokenizer.from_hf_dir(tmp_path / "a")
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (261, 0, 1)
    assert tok.eos_token_ids == frozenset({1, 2})
    ids = tok.encode("hello<|eot|>")
    assert ids == [0, 259, 260, 3 + ord("o"), 2]
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special_tokens=False) == "<s>hello<|eot|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi<|eot|>"

    # No add_bos_token flag: the tokenizer.json post-processor decides; generation eos may be a bare int.
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    _write_hf_dir(tmp_path / "b", config, generation={"eos_token_id": 2}, bos_post_processor=True)
    tok = Tokenizer.from_hf_dir(tmp_path / "b")
    assert tok.encode("hello") == [0, 259, 260, 3 + ord("o")] and tok.eos_token_ids == frozenset({1, 2})
    assert tok.chat_template is None
    _write_hf_dir(tmp_path / "c", config)
    assert Tokenizer.from_hf_dir(tmp_path / "c").encode("he") == [259]

    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")

"""Text <-> token ids for kvlm.

This module owns three things: turning text into token ids and back (built on the
`tokenizers` library, from GGUF metadata or a Hugging Face tokenizer folder), rendering a
model's Jinja chat template in a sandbox, and streaming detokenization that never splits a
UTF-8 character. It knows nothing about models, weights, devices or the engine: callers hand
it plain metadata values and token ids.
"""

from __future__ import annotations

import json
import operator
import os
from datetime import datetime
from numbers import Integral
from pathlib import Path
from typing import Any, Sequence

import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """Bad or unsupported tokenizer data, or a chat template that failed; one readable line."""


# GGUF token types (llama.cpp's llama_token_type) that matter here.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Pre-tokenizer split regexes, as llama.cpp applies them per 'tokenizer.ggml.pre': each regex in
# turn splits every piece the previous one produced, keeping matches and gaps alike ("isolated").
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UP, _LO, _APOS = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
def _cased(apos: str) -> str:  # tekken / gpt-4o: split words at case changes
    return rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{apos}|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{apos}"


_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "qwen2": (_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}"),),
    "qwen35": (_QWEN35,),
    "tekken": (_cased("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "gpt4o": (_cased(_APOS) + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "bloom": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
}
# 'tokenizer.ggml.pre' names that share a regex set (llama.cpp's grouping).
_PRE_GROUPS = {name: group for group, names in {
    "gpt2": "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de mpt olmo jais trillion granite-docling "
            "exaone4 a.x-4.0 mellum roberta-bpe jina-v1-en jina-v2-code",
    "starcoder": "starcoder refact command-r smollm codeshell exaone minerva-7b",
    "llama3": "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 dbrx smaug-bpe chatglm-bpe glm4",
    "qwen2": "qwen2 deepseek-r1-qwen stablelm2 megrez hunyuan grok-2",
    "gpt4o": "gpt-4o llama4 minimax-m2",
    "bloom": "bloom poro-chat gpt3-finnish",
}.items() for name in names.split()} | {g: g for g in ("qwen35", "tekken", "falcon", "default", "deepseek-coder",
                                                          "deepseek-v3")}
# llama.cpp looks a whole pre-token up in the vocab before merging for these (BPE ignore_merges).
_IGNORE_MERGES = {"llama3", "tekken"}
# Pre-tokenizers for which llama.cpp adds BOS when the file does not say.
_BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]  # the rest move to U+0100.. in byte order
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + i) for i, b in enumerate(shifted)}}


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocab: a pair merges with the priority of the piece
    it forms (higher score first), which is the order llama.cpp's SPM tokenizer merges in."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, str, str]] = []
    for tok, score in dict(zip(tokens, scores)).items():
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, left, right) for left, right in pairs)
    ranked.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))  # stable: ties keep vocab order
    return [(left, right) for _, left, right in ranked]


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    split = [merge.split(" ") for merge in merges]
    if bad := next((m for m, parts in zip(merges, split) if len(parts) != 2 or not all(parts)), None):
        raise TokenizerError(f"malformed merge {bad!r} in 'tokenizer.ggml.merges'")
    return [(left, right) for left, right in split]


def _token_id(fields: dict[str, Any], key: str, n_vocab: int) -> int | None:
    value = fields.get(key)
    # Some converters write -1 (or junk) for "none"; treat anything outside the vocab as absent.
    return int(value) if isinstance(value, Integral) and 0 <= value < n_vocab else None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; chat templates want plain JSON (as transformers does).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TokenizerError(message)


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Plain Jinja hands back a silent Undefined here; a template probing internals is hostile, so fail loudly.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class Tokenizer:
    """Encode/decode text for one model; build with `from_gguf_fields` or `from_hf_dir`."""

    def __init__(self, backend: _Backend, *, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None,
                 bos_token: str | None = None, eos_token: str | None = None, extra_eos_ids: Sequence[int | None] = (),
                 add_bos_token: bool = False, add_eos_token: bool = False, chat_template: str | None = None) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.bos_token, self.eos_token = bos_token, eos_token  # as the template sees them
        self.eos_token_ids: frozenset[int] = frozenset(
            i for i in (eos_token_id, *extra_eos_ids) if i is not None and 0 <= i < self.vocab_size)
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and eos_token_id is not None
        self.chat_template = chat_template
        self._template: Any = None
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # Byte-fallback pieces (<0xE4>...) decode as one group, so a later byte can change earlier text.
        fallback = isinstance(backend.model, models.BPE) and backend.model.byte_fallback
        self._byte_ids = frozenset(i for tok, i in backend.get_vocab().items()
                                   if fallback and len(tok) == 6 and tok.startswith("<0x") and tok[-1] == ">")

    # ----------------------------------------------------------------------------------------- build
    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """From GGUF metadata as plain Python values keyed by GGUF key name ('tokenizer.ggml.model',
        '.pre', '.tokens', '.token_type', '.merges', '.scores', '.{bos,eos,unknown,padding,eot,eom}_token_id',
        '.add_bos_token', '.add_eos_token', '.add_space_prefix', 'tokenizer.chat_template'); any may be missing.
        Supports 'gpt2' (byte-level BPE) and 'llama' (sentencepiece-style BPE with scores and byte fallback)."""
        kind, tokens = fields.get("tokenizer.ggml.model"), list(fields.get("tokenizer.ggml.tokens") or [])
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
        if not (n := len(tokens)):
            raise TokenizerError("GGUF has no 'tokenizer.ggml.tokens'")
        types = list(fields.get("tokenizer.ggml.token_type") or [1] * n)
        if len(types) != n:
            raise TokenizerError(f"'tokenizer.ggml.token_type' has {len(types)} entries for {n} tokens")
        bos, eos, unk, pad = (_token_id(fields, f"tokenizer.ggml.{k}_token_id", n)
                              for k in ("bos", "eos", "unknown", "padding"))
        pre = fields.get("tokenizer.ggml.pre") or "default"
        if kind == "gpt2":
            backend, spelled = cls._byte_level_backend(fields, tokens, pre)
            usable = lambda tok: set(tok) <= spelled  # noqa: E731 - others were respelled; cannot be matched raw
            add_bos_default = pre in _BOS_BY_DEFAULT
        else:
            backend, usable = cls._sentencepiece_backend(fields, tokens, unk), (lambda tok: True)
            add_bos_default = True  # llama.cpp and transformers both add BOS to sentencepiece vocabs by default
        # Control/unknown tokens (and the named ones) are special: matched whole in text, skippable on decode.
        # User-defined ones are matched whole too but are ordinary text when decoding.
        named = {i for i in (bos, eos, unk, pad) if i is not None}
        special = {i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL)} | named
        user = {i for i, t in enumerate(types) if t == _USER_DEFINED} - special
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in sorted(special) if tokens[i] and usable(tokens[i])])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i in sorted(user) if tokens[i] and usable(tokens[i])])
        # An added token that is not in the vocab would get a fresh id past the model's embedding table.
        if backend.get_vocab_size(with_added_tokens=True) > n:
            raise TokenizerError(f"special tokens grew the vocab past the {n} GGUF tokens")
        extra = [_token_id(fields, f"tokenizer.ggml.{k}_token_id", n) for k in ("eot", "eom")]
        return cls(backend, vocab_size=n, bos_token_id=bos, eos_token_id=eos, extra_eos_ids=extra,
                   bos_token=None if bos is None else tokens[bos], eos_token=None if eos is None else tokens[eos],
                   add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=fields.get("tokenizer.chat_template") or None)

    @staticmethod
    def _byte_level_backend(fields: dict[str, Any], tokens: list[str], pre: str) -> tuple[_Backend, set[str]]:
        group = _PRE_GROUPS.get(pre)
        if group is None:
            raise TokenizerError(f"unsupported pre-tokenizer 'tokenizer.ggml.pre'={pre!r}")
        table = _byte_alphabet()
        spelled = set(table.values())
        # Tokens are stored in the byte alphabet; a few converters store raw text, so respell those.
        vocab = {tok if set(tok) <= spelled else "".join(table[b] for b in tok.encode()): i
                 for i, tok in enumerate(tokens)}
        merges = _merge_pairs(fields.get("tokenizer.ggml.merges") or [])
        backend = _Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                      ignore_merges=group in _IGNORE_MERGES))
        if group == "gpt2":
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[group]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        return backend, spelled

    @staticmethod
    def _sentencepiece_backend(fields: dict[str, Any], tokens: list[str], unk: int | None) -> _Backend:
        if fields.get("tokenizer.ggml.merges"):
            merges = _merge_pairs(fields["tokenizer.ggml.merges"])
        elif fields.get("tokenizer.ggml.scores") is not None:
            scores = [float(s) for s in fields["tokenizer.ggml.scores"]]
            if len(scores) != len(tokens):
                raise TokenizerError(f"'tokenizer.ggml.scores' has {len(scores)} entries for {len(tokens)} tokens")
            merges = _spm_merges(tokens, scores)
        else:
            raise TokenizerError("sentencepiece vocab has neither 'tokenizer.ggml.scores' nor merges")
        backend = _Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=True, byte_fallback=True,
                                      unk_token=tokens[unk] if unk is not None else None))
        prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
        # A normalizer (not Metaspace) so every text run, including one right after a special token,
        # gets the dummy-prefix "▁": what llama.cpp and the original Llama/Mistral tokenizer.json do.
        spaces = normalizers.Replace(" ", "▁")
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        return backend

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From tokenizer.json, plus tokenizer_config.json (chat_template, bos/eos tokens, add_bos_token),
        chat_template.jinja and generation_config.json (eos_token_id: int or list) when present."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {root}")
        try:
            backend = _Backend.from_file(str(root / "tokenizer.json"))
            config, generation = ({} if not (root / name).is_file() else json.loads((root / name).read_text("utf-8"))
                                  for name in ("tokenizer_config.json", "generation_config.json"))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise TokenizerError(f"cannot load tokenizer from {root}: {e}") from e
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")

        def lookup(token: Any) -> int | None:  # a plain string or a serialized AddedToken
            text = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(text) if isinstance(text, str) else None

        bos, eos = lookup(config.get("bos_token")), lookup(config.get("eos_token"))
        gen_eos = generation.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or () if isinstance(i, int)]
        if eos is None and gen_eos:
            eos = gen_eos[0]
        text_of = lambda i: backend.id_to_token(i) if i is not None else None  # noqa: E731
        # Without explicit flags, the tokenizer.json post-processor is what decided BOS/EOS; ask it.
        plain, full = backend.encode("a", add_special_tokens=False).ids, backend.encode("a").ids
        grew = len(full) > len(plain)
        add_bos = config.get("add_bos_token", grew and full[0] == bos)
        add_eos = config.get("add_eos_token", grew and full[-1] == eos)
        return cls(backend, vocab_size=max(backend.get_vocab(with_added_tokens=True).values()) + 1, bos_token_id=bos,
                   eos_token_id=eos, bos_token=text_of(bos), eos_token=text_of(eos), extra_eos_ids=gen_eos,
                   add_bos_token=bool(add_bos), add_eos_token=bool(add_eos),
                   chat_template=template if isinstance(template, str) else None)

    # ------------------------------------------------------------------------------------------- use
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (e.g. "<|im_start|>") always become
        single ids; `add_special_tokens` only controls the BOS/EOS the model's config asks for."""
        # add_special_tokens=False: we add BOS/EOS ourselves so any post-processor cannot double them.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(map(operator.index, ids))  # accepts numpy/torch integers; tokenizers wants plain ints
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the model's chat template in a sandbox, with the variables transformers passes."""
        if self.chat_template is None:
            raise TokenizerError("model has no chat template")
        try:
            if self._template is None:
                env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
                env.filters["tojson"] = _tojson
                env.globals.update(raise_exception=_raise_exception,
                                   strftime_now=lambda fmt: datetime.now().strftime(fmt))
                self._template = env.from_string(self.chat_template)
            specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}
            context = {**{k: v for k, v in specials.items() if v is not None}, "tools": None, "documents": None,
                       **kwargs}
            # Like transformers: a key set to None counts as absent (many templates test `is defined`).
            chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
        except TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e

    def incremental_detokenizer(self, prompt_ids: Sequence[int] = (),
                                skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Streaming, UTF-8-safe detokenizer for one generated sequence.

    Contract:
    * `push(token_id)` returns only newly *finalized* text (possibly ""): text that no later token
      can change. It never returns part of a multi-byte character, and never returns U+FFFD unless
      the full decode has U+FFFD at that same place (a genuinely invalid byte the model produced).
    * `"".join(pushes) + flush() == tokenizer.decode(generated_ids, skip_special_tokens)` when
      `prompt_ids` is empty. With `prompt_ids`, the result is the text the generated ids add after
      the prompt, i.e. `decode(prompt + generated)[len(decode(prompt)):]`; it differs from
      `decode(generated)` only where decoding depends on context (sentencepiece's leading space).
    * `text` is everything emitted so far. `flush()` emits whatever is still held back (including
      a trailing U+FFFD if the sequence really ends in an incomplete character).

    How: each push decodes a small window (the last emitted chunk plus pending ids) and emits what
    it adds beyond the chunk; the window moves on once the decoded text ends cleanly, so the cost
    per token stays small (it grows only while a character is incomplete).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        prompt = list(prompt_ids)
        # Keep a few prompt ids as left context; walk back until they decode to something, because
        # a window that starts on empty text would let sentencepiece strip a real leading space.
        start = max(len(prompt) - 6, 0)
        while start > 0 and not self._decode(prompt[start:]):
            start = max(start - 6, 0)
        self._ids = prompt[start:]
        self._prefix = 0  # window start: first id of the last emitted chunk (or of the context)
        self._read = len(self._ids)  # ids before this have been emitted
        self._prefix_text: str | None = None
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if not final and (len(window) <= len(self._prefix_text) or window.endswith("\ufffd")
                          or not window.startswith(self._prefix_text)):
            return ""  # nothing new, or the text may still change (incomplete character)
        delta = window[len(self._prefix_text):]
        self._prefix, self._read, self._prefix_text = self._read, len(self._ids), None
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        token_id = operator.index(token_id)
        if not 0 <= token_id < self._tok.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self._tok.vocab_size})")
        self._ids.append(token_id)
        if token_id in self._tok._byte_ids or (self._skip and token_id in self._tok._special_ids):
            # A byte piece may join the next one (a skipped special token is invisible between them),
            # and a bad group turns wholly into U+FFFD, so neither can finalize anything yet.
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True) if self._read < len(self._ids) else ""

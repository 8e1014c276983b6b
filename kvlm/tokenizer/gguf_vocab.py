"""GGUF vocabulary -> a `tokenizers` tokenizer.

GGUF files carry their tokenizer as metadata arrays (tokens, token types, merges or sentencepiece scores)
plus the name of llama.cpp's pre-tokenizer. This module rebuilds the same tokenizer with the `tokenizers`
library: byte-level BPE ('gpt2') with llama.cpp's pre-tokenizer regexes, or sentencepiece-style BPE
('llama') with byte fallback. It knows nothing about models or the engine.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from kvlm.errors import TokenizerError

__all__ = ["tokenizer_args_from_gguf"]

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


def tokenizer_args_from_gguf(fields: dict[str, Any]) -> tuple[_Backend, dict[str, Any]]:
    """The `tokenizers` backend and `Tokenizer` keyword arguments for GGUF metadata as plain Python values keyed by
    GGUF key name ('tokenizer.ggml.model',
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
        backend, spelled = _byte_level_backend(fields, tokens, pre)
        usable = lambda tok: set(tok) <= spelled  # noqa: E731 - others were respelled; cannot be matched raw
        add_bos_default = pre in _BOS_BY_DEFAULT
    else:
        backend, usable = _sentencepiece_backend(fields, tokens, unk), (lambda tok: True)
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
    return backend, dict(vocab_size=n, bos_token_id=bos, eos_token_id=eos, extra_eos_ids=extra,
                         bos_token=None if bos is None else tokens[bos], eos_token=None if eos is None else tokens[eos],
                         add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                         add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
                         chat_template=fields.get("tokenizer.chat_template") or None)

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

"""Text <-> token ids for kvlm.

`Tokenizer` turns text into token ids and back (built on the `tokenizers` library, from GGUF metadata
via `gguf_vocab` or from a Hugging Face tokenizer folder) and renders the chat template
(`chat_template`). It knows nothing about models, weights, devices or the engine: callers hand it plain
metadata values and token ids. Streaming detokenizers (`detokenizer`) are built on a `Tokenizer`; this
module does not know them.
"""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenizers import Tokenizer as _Backend
from tokenizers import models

from kvlm.errors import TokenizerError
from kvlm.tokenizer.gguf_vocab import tokenizer_args_from_gguf

if TYPE_CHECKING:  # jinja2 is imported by the first chat, not at start
    from kvlm.tokenizer.chat_template import ChatTemplate

__all__ = ["Tokenizer", "TokenizerError"]


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
        self.builtin_template = False  # True: the file had none, kvlm's own (tokenizer/templates.py) is used
        self._template: ChatTemplate | None = None  # compiled on first use
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # Byte-fallback pieces (<0xE4>...) decode as one group, so a later byte can change earlier text.
        # Without byte fallback there are none: skip get_vocab(), a dict of the whole vocabulary (~20 ms).
        fallback = isinstance(backend.model, models.BPE) and backend.model.byte_fallback
        self.byte_ids = frozenset(i for tok, i in (backend.get_vocab().items() if fallback else ())
                                   if len(tok) == 6 and tok.startswith("<0x") and tok[-1] == ">")

    # ----------------------------------------------------------------------------------------- build
    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """From GGUF metadata as plain Python values keyed by GGUF key name (see `gguf_vocab`)."""
        backend, kwargs = tokenizer_args_from_gguf(fields)
        return cls(backend, **kwargs)

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

    def use_builtin_template(self, template: str, end_of_turn: str) -> None:
        """Take a template kvlm ships (for a file without one); generation also stops at `end_of_turn`."""
        self.chat_template, self._template, self.builtin_template = template, None, True
        eot = self._backend.token_to_id(end_of_turn)
        if eot is not None:
            self.eos_token_ids = self.eos_token_ids | {eot}

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

    def vocab(self) -> dict[str, int]:
        """Every token of the vocabulary (added ones included) and its id."""
        return self._backend.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The `tokenizers` serialization (what grammar libraries such as llguidance read)."""
        return self._backend.to_str()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the model's chat template in a sandbox, with the variables transformers passes."""
        if self.chat_template is None:
            raise TokenizerError("model has no chat template")
        if self._template is None:
            from kvlm.tokenizer.chat_template import ChatTemplate

            self._template = ChatTemplate(self.chat_template, self.bos_token, self.eos_token)
        return self._template.render(messages, add_generation_prompt, **kwargs)

"""Chat templates: a model's Jinja template rendered in jinja2's immutable sandbox.

The template comes from the model file (GGUF 'tokenizer.chat_template' or tokenizer_config.json), so it
is untrusted code: it runs in `ImmutableSandboxedEnvironment`, and probing an unsafe attribute raises
instead of yielding a silent Undefined. The variables are the ones transformers passes.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlm.errors import TokenizerError

__all__ = ["ChatTemplate"]


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


class ChatTemplate:
    """One compiled chat template; `render(messages, ...)` gives the prompt text."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.specials = {k: v for k, v in {"bos_token": bos_token, "eos_token": eos_token}.items() if v is not None}
        try:
            env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            self._template = env.from_string(source)
        except TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        context = {**self.specials, "tools": None, "documents": None, **kwargs}
        # Like transformers: a key set to None counts as absent (many templates test `is defined`).
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
        except TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e

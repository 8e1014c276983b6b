"""From a `StructuredOutputsParams` to llguidance's grammar text, and a kvlm tokenizer to llguidance's.

llguidance (MIT, no dependencies) was chosen over xgrammar and outlines-core: it reads the `tokenizers`
JSON kvlm already builds for GGUF and Hugging Face models alike, covers JSON Schema (with `$ref`, `anyOf`,
enums), regex, Lark and GBNF, compiles in milliseconds and fills a mask in tens of microseconds
(docs/structured.md has the measurements). xgrammar would bring transformers and triton; outlines-core has
no context-free grammars.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from kvlm.tokenizer.tokenizer import Tokenizer


def json_options(whitespace_pattern: str | None) -> dict[str, Any]:
    """llguidance's JSON options. Compact by default (',' and ':' with no whitespace): unbounded whitespace
    lets a small model pad until max_tokens (vLLM issue #38696)."""
    if whitespace_pattern is None:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec` (not yet checked: `GrammarCompiler` does that)."""
    import llguidance

    kind = spec.kind
    opts = json_options(spec.whitespace_pattern)
    try:
        if kind == "json" or kind == "json_object":
            schema = {"type": "object"} if kind == "json_object" else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice or ())))
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except ValueError as e:  # malformed JSON text, or a GBNF the converter cannot read
        raise ParameterError("structured_outputs", f"structured_outputs: invalid {kind}: {e}") from None


def cache_key(spec: StructuredOutputsParams) -> str:
    """Two specs with the same key compile to the same grammar (JSON schemas compared as parsed JSON)."""
    value: Any = getattr(spec, spec.kind)
    if spec.kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps([spec.kind, value, spec.whitespace_pattern], sort_keys=True, default=str)


def build_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, sized to the model's vocabulary (ids past the tokenizer's are
    padding: llguidance never allows them). EOS is every id the engine stops on. Costs ~0.2 s (SmolLM2),
    so the compiler builds it once, in its worker thread."""
    import llguidance

    eos = sorted(tokenizer.eos_token_ids) or None
    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=max(vocab_size, tokenizer.vocab_size),
                                  eos_token=eos)

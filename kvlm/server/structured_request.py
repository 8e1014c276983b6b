"""A request's output constraint, from whichever field the client used, as one `StructuredOutputsParams`.

Accepted (docs/server.md): OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `schema`
and `strict`; llama.cpp's `json_object` + `schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`, `whitespace_pattern`, `disable_any_whitespace`), and the older aliases
vLLM removed in 0.12 (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
`guided_whitespace_pattern`) and llama.cpp's `json_schema` and `grammar`. None is ever ignored: a value we
cannot honour is a 400 naming its field, and two constraints in one request are a 400 too.
"""

from __future__ import annotations

import json
from typing import Any

from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams
from kvlm.server.protocol import ChatCompletionRequest, CompletionRequest, bad_request

_SO_KEYS = {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "disable_any_whitespace",
            "disable_additional_properties", "disable_fallback"}
_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
            "json_schema": "json", "grammar": "grammar"}


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama.cpp's extension
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise bad_request("response_format.schema must be a JSON schema object", "response_format")
        return {"json": schema}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format of type json_schema needs a json_schema object", "response_format")
        schema = js.get("schema")
        if schema is None:
            raise bad_request("response_format.json_schema needs a schema", "response_format")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
        if "strict" in js and not isinstance(js["strict"], (bool, type(None))):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
        return {"json": schema}  # strict or not, the grammar enforces the schema exactly
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def constraint_fields(r: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """Every constraint the request sets, as (field name, StructuredOutputsParams keyword arguments)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if r.response_format is not None:
        kw = _response_format(r.response_format)
        if kw is not None:
            found.append(("response_format", kw))
    if r.structured_outputs is not None:
        so = dict(r.structured_outputs)
        unknown = sorted(set(so) - _SO_KEYS)
        if unknown:
            raise bad_request(f"structured_outputs: unsupported key(s) {unknown} (supported: json, regex, choice, "
                              "grammar, json_object, whitespace_pattern)", "structured_outputs")
        for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            so.pop(flag, None)  # compact whitespace is the default; one backend, no fallback to disable
        if isinstance(so.get("json"), str):
            try:
                so["json"] = json.loads(so["json"])
            except ValueError as e:
                raise bad_request(f"structured_outputs.json is not valid JSON: {e}", "structured_outputs") from None
        so = {k: v for k, v in so.items() if v is not None and v is not False}
        if so:
            found.append(("structured_outputs", so))
    for name, key in _ALIASES.items():
        v = getattr(r, name)
        if v is not None:
            if key == "json" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as e:
                    raise bad_request(f"{name} is not valid JSON: {e}", name) from None
            kw = {key: v}
            if r.guided_whitespace_pattern is not None:
                kw["whitespace_pattern"] = r.guided_whitespace_pattern
            found.append((name, kw))
    if r.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
        raise bad_request(f"guided_decoding_backend {r.guided_decoding_backend!r} is not available; kvlm uses "
                          "llguidance", "guided_decoding_backend")
    return found


def structured_outputs(r: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint and the field it came from (for a 400's `param`), or (None, "")."""
    found = constraint_fields(r)
    if not found:
        return None, ""
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"only one output constraint per request; got {names}", found[1][0])
    name, kw = found[0]
    try:
        return StructuredOutputsParams(**kw), name
    except ParameterError as e:
        raise bad_request(str(e).replace("structured_outputs", name, 1), name) from None
    except TypeError as e:
        raise bad_request(f"{name}: {e}", name) from None

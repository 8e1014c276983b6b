"""OpenAI tool calling for models whose templates may know nothing about tools: the prompt and the grammar.

A model either has a chat template that reads `tools` (it is passed the tools and the history as
transformers passes them), or it gets a system prompt describing the tools in a known format, with the
history rewritten into that format (`render_messages`). Formats (`ToolFormat`): SmolLM2's trained one
(`<tools>[...]</tools>` in the system prompt, calls as `<tool_call>[{"name": ..., "arguments": {...}}]
</tool_call>`, results as `<tool_response>` user turns) and Hermes-style (`<tool_call>{...}</tool_call>`
per call) for the others. The grammar for each `tool_choice` (`call_grammar`): `required` and a named
function are constrained from the first token; `auto` is free text until the model writes the call tag,
then constrained (a lazy Lark rule); `none` has no grammar. Parsing the output is `tool_parser`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams
from kvlm.structured.grammar import json_options

ToolMode = Literal["none", "auto", "required", "named"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model writes calls: `as_list` (SmolLM2: one tag holding a JSON list of calls) or one tag per
    call holding one object (Hermes)."""

    name: str
    as_list: bool


SMOLLM2 = ToolFormat("smollm2", as_list=True)
HERMES = ToolFormat("hermes", as_list=False)


def tool_format_for(chat_template: str | None) -> ToolFormat:
    """SmolLM2's format for SmolLM2's template (the models were trained on it), Hermes-style otherwise."""
    return SMOLLM2 if chat_template and "named SmolLM" in chat_template else HERMES


def template_reads_tools(chat_template: str | None) -> bool:
    """Whether the template uses the `tools` variable (then it renders tools and calls itself)."""
    return bool(chat_template and re.search(r"\btools\b", chat_template))


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools` as a list of function specs {name, description?, parameters?}; ParameterError names
    the bad entry."""
    if not isinstance(tools, list) or not tools:
        raise ParameterError("tools", "tools must be a non-empty list")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ParameterError(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ParameterError(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1-64 letters, "
                                 "digits, '_', '.' or '-'")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ParameterError(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
        out.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    if len({f["name"] for f in out}) != len(out):
        raise ParameterError("tools", "tool names must be distinct")
    return out


def tool_mode(tool_choice: Any, functions: list[dict[str, Any]]) -> tuple[ToolMode, str | None]:
    """OpenAI's `tool_choice` (default auto) as a mode and, for a named choice, the function's name."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ParameterError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
    if name not in {f["name"] for f in functions}:
        raise ParameterError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return "named", name


# ------------------------------------------------------------------------------------------- the prompt
def tools_system_prompt(functions: list[dict[str, Any]], fmt: ToolFormat) -> str:
    listing = json.dumps([{"type": "function", "function": f} for f in functions], ensure_ascii=False)
    if fmt.as_list:
        example = '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>'
        calls = "Write calls as a JSON list inside one tag, for example:"
    else:
        example = '<tool_call>{"name": "function_name", "arguments": {"argument": "value"}}</tool_call>'
        calls = "Write each call as a JSON object inside its own tag, for example:"
    return ("You are an expert in composing functions. You can call the following tools to answer the user:\n"
            f"<tools>{listing}</tools>\n\n{calls}\n{example}\n"
            "If no tool fits, answer in plain text.")


def format_calls(calls: list[dict[str, Any]], fmt: ToolFormat) -> str:
    """Earlier calls (name, arguments as objects) written as the model writes them."""
    items = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    if fmt.as_list:
        return f"{OPEN}{json.dumps(items, ensure_ascii=False)}{CLOSE}"
    return "\n".join(f"{OPEN}{json.dumps(c, ensure_ascii=False)}{CLOSE}" for c in items)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def render_messages(messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None, fmt: ToolFormat,
                    template_has_tools: bool) -> list[dict[str, Any]]:
    """The history as the template should see it. Messages are dicts with role, content (None allowed),
    and optionally tool_calls ([{id, function: {name, arguments}}]) and tool_call_id.

    A template that reads `tools` gets assistant calls with arguments as objects (transformers' convention)
    and tool messages as they are. Otherwise: the tools' system prompt is put in front of (or into) the
    system message, assistant calls become text in `fmt`, and tool results become user turns of
    `<tool_response>` blocks (consecutive results in one turn)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content")
        calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments", "{}")),
                  "id": c.get("id")} for c in m.get("tool_calls") or ()]
        if template_has_tools:
            msg = dict(m)
            if calls:
                msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            if msg.get("content") is None:
                msg["content"] = ""
            out.append(msg)
            continue
        if role == "tool":
            block = f"<tool_response>\n{content or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        text = content or ""
        if calls:
            text = (text + "\n" if text else "") + format_calls(calls, fmt)
        out.append({"role": role, "content": text, **({"name": m["name"]} if m.get("name") else {})})
    for m in out:
        m.pop("_tool_results", None)
    if functions and not template_has_tools:
        prompt = tools_system_prompt(functions, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def chat_inputs(messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None,
                chat_template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables for one chat: `functions` (None: no tools offered) and any
    earlier calls, tool results or null contents rendered for this template (`render_messages`)."""
    has_tools = template_reads_tools(chat_template)
    if functions or any(m.get("tool_calls") or m.get("role") == "tool" or m.get("content") is None for m in messages):
        messages = render_messages(messages, functions, tool_format_for(chat_template), has_tools)
    kwargs = {"tools": [{"type": "function", "function": f} for f in functions]} if functions and has_tools else {}
    return messages, kwargs


# ------------------------------------------------------------------------------------------ the grammar
def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists properties and does not say
    otherwise. A call's arguments are a function's parameters: an extra key would only break the call, and a
    small model given the room pads a call with invented keys (what OpenAI's strict mode and vLLM's
    disable_additional_properties also do)."""
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    maps = ("properties", "$defs", "definitions", "patternProperties")  # name -> schema: recurse into the values
    out = {k: {n: closed_objects(v2) for n, v2 in v.items()} if k in maps and isinstance(v, dict)
           else closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _hoist_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with its `$defs` moved into the shared root (their `#/$defs/...` refs then resolve
    from the call grammar's root). Two tools defining one name differently is a ParameterError."""
    schema = dict(schema)
    for k, v in (schema.pop("$defs", None) or {}).items():
        if k in defs and defs[k] != v:
            raise ParameterError("tools", f"tools define $defs/{k} differently; rename one")
        defs[k] = v
    return schema


def call_schema(functions: list[dict[str, Any]], parallel: bool, as_list: bool) -> dict[str, Any]:
    """A JSON schema for the calls: objects {"name": one of the tools, "arguments": its parameters}, in a
    list of at least one (at most one unless `parallel`) when `as_list`, else one object."""
    defs: dict[str, Any] = {}
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": _hoist_defs(closed_objects(f["parameters"]), defs)},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": one, "minItems": 1} if as_list else dict(one)
    if as_list and not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = json_options(None)  # compact JSON inside the call, as everywhere
    return schema


def call_grammar(functions: list[dict[str, Any]], mode: ToolMode, fmt: ToolFormat, parallel: bool,
                 name: str | None = None) -> StructuredOutputsParams | None:
    """The constraint for `tool_choice`: None for none; from the first token for required and named; for
    auto, any text, but once the call tag appears the rest must be a call (then the output ends)."""
    if mode == "none":
        return None
    chosen = [f for f in functions if f["name"] == name] if mode == "named" else functions
    schema = json.dumps(call_schema(chosen, parallel and mode != "named", fmt.as_list), ensure_ascii=False)
    rest = f'calls "{CLOSE}"'
    if not fmt.as_list and parallel and mode != "named":
        rest += f' ("\\n" "{OPEN}" calls "{CLOSE}")*'  # Hermes: one tag per call
    lines = ["%llguidance {}"]
    if mode == "auto":  # the lazy head ends TEXT at the first call tag; from there on the call is forced
        lines += ["start: TEXT | call", f"call: call_head {rest}", f'call_head[lazy]: TEXT "{OPEN}"',
                  r"TEXT: /(.|\n)*/"]
    else:
        lines += [f'start: "{OPEN}" {rest}']
    lines.append(f"calls: %json {schema}")
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")

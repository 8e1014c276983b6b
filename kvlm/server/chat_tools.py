"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask of one call (`ToolPlan`), and
the OpenAI message and finish_reason its output becomes. The formats, grammars and parsing live in
`kvlm.structured.tools` and `kvlm.structured.tool_parser`; this module only reads the request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams
from kvlm.server.protocol import ChatCompletionRequest, bad_request
from kvlm.structured.tool_parser import ToolCall, parse_tool_calls
from kvlm.structured.tools import (
    ToolFormat,
    ToolMode,
    call_grammar,
    check_tools,
    tool_format_for,
    tool_mode,
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    functions: list[dict[str, Any]]
    mode: ToolMode
    name: str | None  # the named function, for mode "named"
    fmt: ToolFormat
    parallel: bool

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        return call_grammar(self.functions, self.mode, self.fmt, self.parallel, self.name)

    def finish_reason(self, calls: list[ToolCall], finish: str | None) -> str | None:
        """OpenAI: "tool_calls" when the model called tools (auto, required), "stop" for a named choice."""
        if calls and finish == "stop" and self.mode != "named":
            return "tool_calls"
        return finish

    def message(self, text: str) -> tuple[dict[str, Any], list[ToolCall]]:
        """The assistant message for a whole answer: content and, when it called tools, tool_calls."""
        content, calls = parse_tool_calls(text) if self.active else (text, [])
        if not self.parallel:
            calls = calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.as_openai() for c in calls]
        return msg, calls


def tool_plan(r: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
    """None when the request has no tools (a tool_choice other than none/auto without tools is a 400)."""
    if r.functions:
        raise bad_request("functions (the deprecated form) is not supported; send tools", "functions")
    if not r.tools:
        if r.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    try:
        functions = check_tools(r.tools)
        mode, name = tool_mode(r.tool_choice, functions)
    except ParameterError as e:
        raise bad_request(str(e), e.param) from None
    return ToolPlan(functions, mode, name, tool_format_for(chat_template), r.parallel_tool_calls)

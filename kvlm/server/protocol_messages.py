"""Wire schemas of Anthropic's Messages API (pydantic v2), and Anthropic's error shape.

Validated as strictly as the OpenAI schemas (`protocol`): a wrong type or an unknown content block type is a
400 naming the field, unknown top-level fields are logged once and ignored. Content blocks are a union on
`type`: text, tool_use, tool_result, and the thinking blocks clients send back from earlier turns. What each
field becomes in a chat request is `serving_messages`' job; this module only says what is well-formed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvlm.server.protocol import APIError

MESSAGES_PATH = "/v1/messages"  # this route and those under it answer errors in Anthropic's shape

# Anthropic's error type per HTTP status; 503 (queue full, shutting down) is Anthropic's 529 "overloaded".
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error(e: APIError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error as Anthropic sends it: `{"type": "error", "error": {"type", "message"}}`."""
    status = 529 if e.status == 503 else e.status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a prompt-cache breakpoint: kvlm caches every prefix anyway


class ToolUseBlock(_Request):
    """An earlier call the assistant made (assistant turns only)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    """What an earlier call returned (user turns only)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Request):
    """Reasoning from an earlier turn, sent back by clients; not part of the prompt (templates drop it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Request):
    """A client tool: its input is a JSON schema, which constrains a forced call (`tool_choice` any or tool)."""

    name: str
    input_schema: dict[str, Any]
    description: str = ""
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": which one
    disable_parallel_tool_use: bool = False


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Metadata(_Request):
    user_id: str | None = None


class CountTokensRequest(_Request):
    """`/v1/messages/count_tokens`: what makes the prompt."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`. max_tokens is required, as Anthropic requires it; temperature, top_p and top_k come in the
    body (SDK 2.x sends them through `extra_body`)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None

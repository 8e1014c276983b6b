"""Wire schema of OpenAI's Responses API (`/v1/responses`) requests (pydantic v2, strict like `protocol`).

Only the shape is checked here; what the fields mean (and which values are refused) is
`serving_responses`. Input items keep unknown keys (`annotations`, `status`, ...) so that a client may send
a response's `output` back as the next `input`, as the SDK's examples do.
"""

from __future__ import annotations

from typing import Any

from kvlm.server.protocol import _Request


class InputContent(_Request):
    """A content part: `input_text` (user, system, developer) or `output_text` (an earlier assistant turn)."""

    type: str
    text: str | None = None


class InputItem(_Request):
    """One `input` item: a message (`type` "message" or absent), a `function_call` the model made earlier,
    or the `function_call_output` the client answers it with."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # effort (a reasoning budget), summary (accepted, none is made)
    # Refused unless off (`serving_responses`): kvlm has no background queue.
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    # vLLM-style extras a client may send in extra_body (as in chat completions)
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    reasoning_budget: int | None = None

"""Wire schemas of the OpenAI-compatible API (pydantic v2), and the OpenAI-shaped error.

Requests are validated strictly (a string where a number belongs is a 400, never coerced), unknown fields
are kept in `model_extra` so the server can log them once per name, and known fields with values we do not
support are refused by the serving layer, never ignored. Responses are plain dicts built by `serving`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TokenId = Annotated[int, Field(ge=0)]

# `/v1/completions` without max_tokens generates this many tokens, as OpenAI's API and vLLM do. Chat has no
# such default: it may run to the end of the context (vLLM's behaviour), see `OpenAIServing._check_prompt`.
COMPLETION_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """An error the client caused (or may retry): becomes `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status if code is None else code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    max_tokens: int | None = None
    best_of: int | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # kvlm: a bounded KV cache for this request (sinks + window, kvlm.kv_policy); past the context it goes on
    max_kv_tokens: int | None = None
    sink_tokens: int | None = None
    # Structured outputs (`structured_request`): OpenAI's, vLLM's, and the older vLLM / llama.cpp aliases
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp
    grammar: str | None = None  # llama.cpp (GBNF)


class CompletionRequest(_Sampling):
    """max_tokens None (absent or null): `COMPLETION_DEFAULT_MAX_TOKENS`, fewer where the context has less room."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(_Request):
    type: str
    text: str | None = None


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients send the object


class ToolCall(_Request):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools (content then often null)
    tool_call_id: str | None = None  # role "tool": which call this is the result of


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    # Reasoning models (`kvlm.structured.reasoning`): OpenAI's effort, vLLM's template variables
    # (enable_thinking), and kvlm's explicit budget in tokens
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_budget: int | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the field (`messages[0].content`). Of a union's errors, the deepest
    says most (`prompt[1]` for a negative token id rather than "prompt: not a string")."""
    errs = e.errors(include_url=False)
    err = max(errs, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))  # value errors beat type errors
    param = ""
    for part in err["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "int", "float", "list[TextPart]",
                      "function-after", "constrained-int") or "[" in str(part):
            continue  # union branch names, not fields
        else:
            param += f".{part}" if param else str(part)
    msg = err["msg"]
    return bad_request(f"{param}: {msg}" if param else msg, param or None)


class LoadLoRARequest(_Request):
    """POST /v1/load_lora_adapter, vLLM's shape (kvlm adds an optional scale, as `--lora NAME=PATH:SCALE`)."""

    lora_name: str
    lora_path: str
    scale: float = 1.0


class UnloadLoRARequest(_Request):
    """POST /v1/unload_lora_adapter, vLLM's shape."""

    lora_name: str

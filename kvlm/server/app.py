"""The FastAPI application: routes, the request gate (request ids, API keys), body limits, errors, disconnects.

Every error leaves as OpenAI's `{"error": {"message", "type", "param", "code"}}` (400 for anything the
client got wrong, never FastAPI's 422 `detail`), or as Anthropic's under `/v1/messages` (`error_response`).
Bodies are read here, with a size limit and a JSON content-type check, then validated with the `protocol`
schemas. A non-streaming request races its client's `http.disconnect` (as vLLM does:
`request.is_disconnected()` is unreliable behind middleware); a streaming one ends when Starlette cancels its
generator. Both paths close the `Submission`, which aborts the engine requests. Behaviour of the endpoints
lives in `serving_completion`, `serving_chat`, `serving_responses` and `serving_messages`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvlm
from kvlm.engine.engine import Engine
from kvlm.errors import KvlmError, LoRAError
from kvlm.server.async_engine import AsyncEngine, EngineDeadError
from kvlm.server.metrics import ServerMetrics
from kvlm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    bad_request,
    validation_error,
)
from kvlm.server.protocol_messages import anthropic_error, is_messages_path
from kvlm.server.protocol_responses import ResponsesRequest
from kvlm.server.serving import SSEStream
from kvlm.server.serving_chat import ChatServing
from kvlm.server.serving_completion import CompletionServing
from kvlm.server.serving_embeddings import EmbeddingServing, add_embeddings_route
from kvlm.server.serving_messages import add_messages_routes
from kvlm.server.serving_responses import ResponsesServing

log = logging.getLogger("kvlm.server")

PUBLIC_PATHS = frozenset({"/health", "/"})  # everything else needs the API key when one is set
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _route_path(scope: dict) -> str:
    """The request's path without the app's root_path (what the routes are matched on)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def error_response(scope: dict, e: APIError) -> JSONResponse:
    """An error in the shape of the route's protocol: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if is_messages_path(_route_path(scope)):
        status, body = anthropic_error(e)
        return JSONResponse(body, status, headers=e.headers)
    return JSONResponse(e.body(), e.status, headers=e.headers)


class RequestGate:
    """Pure ASGI middleware: echo or create `X-Request-Id`; check the API key, sent as `Authorization: Bearer
    <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's)."""

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        self._digests = [_digest(k) for k in api_keys]  # compared as digests, in constant time

    def _authorized(self, headers: dict[str, str]) -> bool:
        bearer = headers.get("authorization", "")
        key = bearer[len("Bearer "):].strip() if bearer.startswith("Bearer ") else headers.get("x-api-key")
        if not key:
            return False
        got = _digest(key)
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(got, d)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id", "")
        rid = rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex
        scope["kvlm.request_id"] = rid

        async def send_with_id(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                msg["headers"] = [*msg.get("headers", []), (b"x-request-id", rid.encode())]
            await send(msg)

        if self._digests and _route_path(scope) not in PUBLIC_PATHS and scope["method"] != "OPTIONS" \
                and not self._authorized(headers):
            err = APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key').",
                           "authentication_error", None, "invalid_api_key")
            return await error_response(scope, err)(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


class _SSEResponse(StreamingResponse):
    """Server-sent events whose engine requests are aborted however the response ends (even when the
    client leaves before the first chunk, when Starlette never starts the generator)."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream.lines, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._submission = stream.submission

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._submission.close()


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past `limit` bytes (checked while reading), 400 for another content type or bad JSON."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {ctype or 'none'!r}")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", "invalid_request_error", None, 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", "invalid_request_error", None, 413)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON body: {e}") from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Run `work` (a coroutine) but cancel it if the client disconnects first; returns its result or None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()  # the handler's finally closes its Submission: the engine aborts the requests
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the route's protocol shapes it (`error_response`): ours, FastAPI's validation and routing
    errors, a dead engine, bugs."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(request.scope, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(request.scope, bad_request(str(e.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return error_response(request.scope, APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(request.scope, APIError(500, "the engine stopped on an internal error",
                                                      "internal_server_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        rid = request.scope.get("kvlm.request_id")
        log.exception("kvlm: internal error in request %s", rid)
        return error_response(request.scope, APIError(500, f"internal error (request {rid})", "internal_server_error"))


class _Parser:
    """Validate a JSON body against a `protocol` schema; unknown fields are logged once each, then ignored."""

    def __init__(self) -> None:
        self.seen_extra: set[str] = set()

    def __call__(self, model: type[BaseModel], obj: Any) -> Any:
        if not isinstance(obj, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            req = model.model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        for name in req.model_extra or {}:
            if name not in self.seen_extra:
                self.seen_extra.add(name)
                log.warning("kvlm: ignoring unknown request field %r (logged once)", name)
        return req


def _add_tokenizer_routes(app: FastAPI, chat: ChatServing, parse: _Parser, max_body_bytes: int) -> None:
    """vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        r = parse(TokenizeRequest, await read_json(request, max_body_bytes))
        chat.check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if r.messages is not None:
            ids = chat.chat_prompt(ChatCompletionRequest(messages=r.messages,
                                                         add_generation_prompt=r.add_generation_prompt))
        else:
            ids = chat.tokenizer.encode(r.prompt, add_special_tokens=r.add_special_tokens)
        return {"count": len(ids), "max_model_len": chat.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        r = parse(DetokenizeRequest, await read_json(request, max_body_bytes))
        chat.check_model(r.model)
        try:
            return {"prompt": chat.tokenizer.decode(r.tokens)}
        except KvlmError as e:
            raise bad_request(str(e), "tokens") from None

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        t = chat.tokenizer
        return {"tokenizer_class": "kvlm", "eos_token": t.eos_token, "bos_token": t.bos_token, "pad_token": None,
                "chat_template": t.chat_template, "model_max_length": chat.max_model_len,
                "vocab_size": chat.vocab_size}


def _add_responses_routes(app: FastAPI, responses: ResponsesServing, generation_route: Callable[..., None]) -> None:
    """OpenAI's Responses API: create, retrieve, cancel, delete (`serving_responses`)."""
    generation_route("/v1/responses", ResponsesRequest, responses.create)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return responses.store.get(response_id).response

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        responses.store.get(response_id)
        raise bad_request("Cannot cancel a synchronous response.")  # no background mode: it has finished

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        responses.store.pop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def create_app(completion: CompletionServing, chat: ChatServing, aengine: AsyncEngine, metrics: ServerMetrics,
               api_keys: list[str], max_body_bytes: int = 2 << 20, root_path: str = "",
               log_requests: bool = False) -> FastAPI:
    app = FastAPI(title="kvlm", version=kvlm.__version__, root_path=root_path, docs_url=None, redoc_url=None)
    app.add_middleware(RequestGate, api_keys=api_keys)
    _add_error_handlers(app)
    parse = _Parser()
    page = (Path(__file__).parent / "static" / "index.html").read_text(encoding="utf-8")
    engine = chat.engine

    def refuse_when_unavailable() -> None:
        if aengine.dead is not None:
            raise EngineDeadError(str(aengine.dead))
        if aengine.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", None, 503)

    async def respond(request: Request, work: Any) -> Response:
        if log_requests:
            log.info("kvlm: request %s %s", request.scope["kvlm.request_id"], request.url.path)
        result = await _unless_disconnected(request, work)
        if result is None:  # the client is gone: nobody reads this
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return _SSEResponse(result)

    def generation_route(path: str, model: type[BaseModel], handler: Callable[[Any, str], Awaitable[Any]]) -> None:
        """POST `path`: refused on a dead or draining engine, the body validated as `model`, then `handler`'s
        answer (a dict or an `SSEStream`) unless the client left first."""

        async def route(request: Request) -> Response:
            refuse_when_unavailable()
            r = parse(model, await read_json(request, max_body_bytes))
            return await respond(request, handler(r, request.scope["kvlm.request_id"]))

        app.add_api_route(path, route, methods=["POST"], name=handler.__name__)

    generation_route("/v1/completions", CompletionRequest, completion.completions)
    generation_route("/v1/chat/completions", ChatCompletionRequest, chat.chat)

    # "root" is the model's file (or folder) name: an absolute path would tell every client the server's layout.
    root = Path(engine.model_path).name

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        names = chat.opts.served_model_names
        adapters = list(engine.loras.adapters.values()) if isinstance(engine, Engine) else []
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "kvlm", "root": root,
             "max_model_len": chat.max_model_len} for name in names] + [  # LoRA adapters, as vLLM lists them
            {"id": a.name, "object": "model", "created": created, "owned_by": "kvlm", "root": Path(a.path).name,
             "parent": names[0], "max_model_len": chat.max_model_len} for a in adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's run-time adapter loading: {"lora_name", "lora_path"} (kvlm: and an optional "scale")."""
        body = parse(LoadLoRARequest, await read_json(request, max_body_bytes))
        if not isinstance(engine, Engine):
            raise APIError(501, "LoRA adapters are not served with --replicas", "invalid_request_error")
        try:  # off the event loop: reading the file takes milliseconds to seconds
            await asyncio.to_thread(engine.load_lora, body.lora_name, body.lora_path, body.scale)
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's {"lora_name"}: new requests cannot name it; requests already running under it finish."""
        body = parse(UnloadLoRARequest, await read_json(request, max_body_bytes))
        if not isinstance(engine, Engine) or body.lora_name not in engine.loras:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError",
                           "lora_name", "model_not_found")
        engine.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> Response:
        if aengine.dead is not None:
            return JSONResponse(APIError(503, "the engine stopped", "service_unavailable").body(), 503)
        state = aengine.health()  # replicas: (200, "degraded") while one is down, (503, ...) with none up
        return Response(status_code=200) if state is None else JSONResponse(state[1], state[0])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvlm.__version__}

    _add_tokenizer_routes(app, chat, parse, max_body_bytes)
    _add_responses_routes(app, ResponsesServing(engine, aengine, chat.opts), generation_route)

    add_messages_routes(generation_route, chat)
    add_embeddings_route(generation_route, EmbeddingServing(engine, aengine, chat.opts))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv_cache")
    async def kv_cache() -> Any:
        """The KV pool block by block, for the chat page's panel (`AsyncEngine.kv_map`)."""
        if not hasattr(aengine, "kv_map"):  # replicas: each has its own pool
            raise APIError(501, "the KV map is not available with --replicas", "invalid_request_error")
        refuse_when_unavailable()
        return await aengine.kv_map()

    @app.get("/")
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    return app

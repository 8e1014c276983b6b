"""`kvlm serve [MODEL]`: load the model, start the engine loop, serve the OpenAI API with uvicorn.

Prints one line when ready (URL, served model, KV pool). SIGINT/SIGTERM: new requests get 503, requests
in flight end at the next engine step with `finish_reason: "abort"` (their streams get a final chunk and
`[DONE]`), then the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from kvlm.args import add_engine_args, engine_config_from_args
from kvlm.cli.snapshot import add_prefix_snapshot_flag, load_prefix_snapshot
from kvlm.errors import KvlmError

log = logging.getLogger("kvlm.server")


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    s.add_argument("model", nargs="?", default="smollm2-135m", help="model alias, .gguf file or HF folder")
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", action="append", default=None,
                   help="name clients use in 'model' (repeatable; default: the alias or file name)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or env KVLM_API_KEY; default: none, no key)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 when this many requests wait for a seat (default: unbounded)")
    g.add_argument("--max-logprobs", type=int, default=20, help="cap on logprobs / top_logprobs")
    g.add_argument("--max-n", type=int, default=16, help="cap on n (completions per prompt)")
    g.add_argument("--max-body-bytes", type=int, default=2_000_000, help="larger request bodies get 413")
    g.add_argument("--root-path", default="", help="URL prefix when behind a proxy (default: none)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    g.add_argument("--log-requests", action="store_true", help="log each request's id and route (never its text)")
    add_engine_args(s)
    add_prefix_snapshot_flag(s)
    s.set_defaults(func=cmd_serve)


def served_names(model: str, given: list[str] | None) -> list[str]:
    return given or [Path(model).name if os.sep in model or model.endswith(".gguf") else model]


def _check_bind(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise KvlmError(f"could not start the server on {host}:{port} ({e.strerror})") from None


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from kvlm.engine.engine import Engine
    from kvlm.server.app import create_app
    from kvlm.server.async_engine import AsyncEngine
    from kvlm.server.metrics import ServerMetrics
    from kvlm.server.serving import ServingOptions
    from kvlm.server.serving_chat import ChatServing
    from kvlm.server.serving_completion import CompletionServing

    for name, low in (("max_logprobs", 0), ("max_n", 1), ("max_body_bytes", 1), ("port", 0)):
        if getattr(a, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}")
    if a.max_queued_requests is not None and a.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    level = getattr(logging, a.log_level.upper())
    logging.getLogger("kvlm").setLevel(logging.WARNING if a.quiet else level)
    keys = [k for k in (a.api_key or os.environ.get("KVLM_API_KEY") or "").split(",") if k]

    _check_bind(a.host, a.port)  # before loading the model: a busy port should fail in a second
    engine = Engine(a.model, engine_config_from_args(a), quiet=a.quiet)
    bm = engine.block_manager
    if engine.config.enable_kv_cache and bm.num_blocks * bm.block_size < engine.max_model_len:
        fits = bm.num_blocks * bm.block_size
        raise KvlmError(f"the KV pool holds {fits} tokens, less than one full context ({engine.max_model_len}); "
                        f"raise --kv-cache-memory or use --max-model-len {fits}")
    load_prefix_snapshot(engine, a.prefix_snapshot, a.quiet)
    names = served_names(a.model, a.served_model_name)
    aengine = AsyncEngine(engine, a.max_queued_requests)
    metrics = ServerMetrics(aengine, names[0])  # takes the loop thread's token / finish hooks
    opts = ServingOptions(names, max_logprobs=a.max_logprobs, max_n=a.max_n)
    app = create_app(CompletionServing(engine, aengine, opts), ChatServing(engine, aengine, opts), aengine, metrics,
                     keys, a.max_body_bytes, a.root_path, a.log_requests)

    class Server(uvicorn.Server):
        async def startup(self, *args: Any, **kw: Any) -> None:
            await super().startup(*args, **kw)
            if self.started:
                print(f"kvlm: serving {names[0]} at http://{a.host}:{a.port}{a.root_path} "
                      f"(max_model_len {engine.max_model_len}; {engine.describe_cache().removeprefix('kvlm: ')})",
                      file=sys.stderr, flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            aengine.abort_all()  # in-flight requests end with "abort" at the next step; new ones get 503
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after shutting down (exit status -15); a clean drain exits 0.
            self._captured_signals.clear()

    config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False,
                            timeout_graceful_shutdown=5, root_path=a.root_path, lifespan="off")
    server = Server(config)
    aengine.start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits this way when it cannot bind
        pass
    finally:
        aengine.stop()
    if not server.started:
        raise KvlmError(f"could not start the server on {a.host}:{a.port} (is the port in use?)")
    return 0

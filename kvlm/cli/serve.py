"""`kvlm serve [MODEL]`: load the model, start the engine loop, serve the OpenAI API with uvicorn.

Prints one line when ready: the served model, the URL of the chat page and the context length (`-v`
adds the KV pool's size, which the engine logs). SIGINT/SIGTERM: new requests get 503, requests
in flight end at the next engine step with `finish_reason: "abort"` (their streams get a final chunk and
`[DONE]`), then the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from kvlm.args import add_engine_args, engine_config_from_args
from kvlm.cli.lora import add_lora_flag, load_lora_flags
from kvlm.cli.snapshot import add_prefix_snapshot_flag, load_prefix_snapshot
from kvlm.config import EngineConfig
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
    g.add_argument("--max-stored-responses", type=int, default=1024,
                   help="/v1/responses kept for previous_response_id and GET, least recently used dropped first "
                        "(0: none)")
    g.add_argument("--max-body-bytes", type=int, default=2_000_000, help="larger request bodies get 413")
    g.add_argument("--root-path", default="", help="URL prefix when behind a proxy (default: none)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    g.add_argument("--log-requests", action="store_true", help="log each request's id and route (never its text)")
    g.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                   help="/v1/embeddings: which final hidden states of a prompt make its vector (the last token's, "
                        "the mean, the first token's; default: the model folder's sentence-transformers pooling "
                        "config, else last)")
    t = s.add_argument_group("reasoning models")
    t.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none"],
                   help="think: split a <think>...</think> span from chat answers into 'reasoning' (and "
                        "'reasoning_content'); auto: think where the model's chat template declares thinking "
                        "(writes <think> or takes enable_thinking); none: leave the text whole")
    t.add_argument("--reasoning-budget", type=int, default=None,
                   help="force </think> after this many reasoning tokens, unless a request sets reasoning_budget "
                        "or reasoning_effort (default: no budget)")
    r = s.add_argument_group("replicas (Ray Serve; needs pip install 'kvlm[ray]')")
    r.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas (one process each, --threads threads each) on Ray Serve behind this "
                        "one endpoint (default: one engine in this process, Ray not loaded)")
    r.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale on queue length from this many replicas (default: no autoscaling)")
    r.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale up to this many replicas (default: --min-replicas)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 from `ray start --head`) instead of starting a "
                        "local Ray instance (default: a local one)")
    r.add_argument("--router", default="prefix", choices=["prefix", "pow2", "round-robin"],
                   help="prefix: the replica holding the longest cached prefix of the prompt's KV blocks (power of "
                        "two choices when it is too busy); pow2: the less busy of two random replicas")
    r.add_argument("--route-imbalance", type=int, default=4,
                   help="prefix router: fall back to load when the best replica runs this many more requests "
                        "than the least busy")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests one replica takes at once; more wait for the first free replica "
                        "(default: --max-num-seqs)")
    add_engine_args(s)
    add_prefix_snapshot_flag(s)
    add_lora_flag(s, "requests select it by its NAME in the `model` field")
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


def _check_flags(a: argparse.Namespace) -> None:
    for name, low in (("max_logprobs", 0), ("max_n", 1), ("max_stored_responses", 0), ("max_body_bytes", 1),
                      ("port", 0)):
        if getattr(a, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}")
    if a.max_queued_requests is not None and a.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    if a.reasoning_budget is not None and a.reasoning_budget < 0:
        raise ValueError("--reasoning-budget must be >= 0")
    for name in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if a.min_replicas is not None and a.max_replicas is not None and a.max_replicas < a.min_replicas:
        raise ValueError("--max-replicas must be >= --min-replicas")


def _check_pool(fits: int, max_model_len: int, what: str) -> None:
    if fits < max_model_len:
        raise KvlmError(f"{what} holds {fits} tokens, less than one full context ({max_model_len}); "
                        f"raise --kv-cache-memory or use --max-model-len {fits}")


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    """The engine flags' config, with the server's own `--pooling`."""
    return dataclasses.replace(engine_config_from_args(a), pooling=a.pooling)


def _replicated(a: argparse.Namespace) -> bool:
    return any(getattr(a, n) is not None for n in ("replicas", "min_replicas", "max_replicas", "ray_address"))


def cmd_serve(a: argparse.Namespace) -> int:
    from kvlm.engine.engine import Engine
    from kvlm.server.async_engine import AsyncEngine
    from kvlm.server.metrics import ServerMetrics

    _check_flags(a)
    level = getattr(logging, a.log_level.upper())
    logging.getLogger("kvlm").setLevel(logging.WARNING if a.quiet else logging.DEBUG if a.verbose else level)
    if _replicated(a):
        return _serve_replicas(a)
    _check_bind(a.host, a.port)  # before loading the model: a busy port should fail in a second
    engine = Engine(a.model, _engine_config(a), quiet=a.quiet)
    bm = engine.block_manager
    if engine.config.enable_kv_cache:
        _check_pool(bm.num_blocks * bm.block_size, engine.max_model_len, "the KV pool")
    load_prefix_snapshot(engine, a.prefix_snapshot, a.quiet)
    load_lora_flags(engine, a.lora, a.quiet)
    names = served_names(a.model, a.served_model_name)
    aengine = AsyncEngine(engine, a.max_queued_requests)
    metrics = ServerMetrics(aengine, names[0])  # takes the loop thread's token / finish hooks
    ready = f"max_model_len {engine.max_model_len}; {engine.backend.summary()}"
    aengine.start()
    try:
        return _run_http(a, engine, aengine, metrics, names, ready)
    finally:
        aengine.stop()


def _serve_replicas(a: argparse.Namespace) -> int:
    """`--replicas N` (or autoscaling, or a Ray cluster): the same app in front of Ray Serve replicas."""
    from kvlm.serve_ray import require_ray

    require_ray()  # one line naming the extra, before any Ray import
    from kvlm.loader.registry import resolve_model
    from kvlm.serve_ray.launch import ReplicaDeployment, ReplicaOptions
    from kvlm.serve_ray.metrics import ReplicaMetrics

    if a.prefix_snapshot:
        raise KvlmError("--prefix-snapshot is not supported with --replicas (each replica has its own cache)")
    if a.lora:
        raise KvlmError("--lora is not supported with --replicas")
    _check_bind(a.host, a.port)
    resolve_model(a.model, quiet=a.quiet)  # an unknown model fails here in a second, not in N replicas
    cfg = _engine_config(a)
    n = a.replicas or a.min_replicas or 1
    if cfg.kv_tier_dir is not None and not cfg.kv_tier_write_through:
        # Replicas sharing a tier share what reaches it: with eviction alone a document prefilled by one
        # replica reaches the tier only once that replica's pool evicts it, so the others prefill it again.
        cfg = dataclasses.replace(cfg, kv_tier_write_through=True)
    if cfg.num_threads is None:  # share this machine's cores between the replicas
        cfg = dataclasses.replace(cfg, num_threads=max(1, (os.cpu_count() or 1) // n))
    opts = ReplicaOptions(replicas=n, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                          ray_address=a.ray_address, router=a.router, imbalance_threshold=a.route_imbalance,
                          max_ongoing_requests=a.max_ongoing_requests or cfg.max_num_seqs,
                          max_queued_requests=a.max_queued_requests)
    dep = ReplicaDeployment(a.model, dataclasses.asdict(cfg), opts)
    try:
        dep.start()
        client = dep.client()
        info = dep.info
        if cfg.enable_kv_cache:
            _check_pool(info.num_blocks * info.block_size, info.max_model_len, "a replica's KV pool")
        names = served_names(a.model, a.served_model_name)
        metrics = ReplicaMetrics(dep.book, names[0], opts.target)
        scale = (f"{opts.min_replicas or 1}..{opts.max_replicas or opts.min_replicas} replicas (autoscaling)"
                 if opts.autoscaling else f"{n} replicas")
        ready = f"{scale}, router {a.router}, {cfg.num_threads} threads each; max_model_len {info.max_model_len}"
        if cfg.kv_tier_dir is not None:
            ready += f"; KV tier {cfg.kv_tier_dir} shared (write-through)"
        if a.verbose:
            ready += f"; per replica {info.cache_line.removeprefix('kvlm: ')}"
        return _run_http(a, info, client, metrics, names, ready)
    finally:
        dep.shutdown()


def _run_http(a: argparse.Namespace, engine: Any, aengine: Any, metrics: Any, names: list[str], ready: str) -> int:
    """Serve the OpenAI app on uvicorn until SIGINT/SIGTERM; `engine` is an `Engine` or what replicas
    described (`ReplicaInfo`), `aengine` an `AsyncEngine` or a `ReplicaClient`."""
    import uvicorn

    from kvlm.server.app import create_app
    from kvlm.server.serving import ServingOptions
    from kvlm.server.serving_chat import ChatServing
    from kvlm.server.serving_completion import CompletionServing
    from kvlm.structured.reasoning import ReasoningConfig

    keys = [k for k in (a.api_key or os.environ.get("KVLM_API_KEY") or "").split(",") if k]
    reasoning = ReasoningConfig.choose(a.reasoning_parser, engine.tokenizer.chat_template, a.reasoning_budget)
    ready += f"; {reasoning.describe()}"
    opts = ServingOptions(names, max_logprobs=a.max_logprobs, max_n=a.max_n,
                          max_stored_responses=a.max_stored_responses, reasoning=reasoning)
    app = create_app(CompletionServing(engine, aengine, opts), ChatServing(engine, aengine, opts), aengine, metrics,
                     keys, a.max_body_bytes, a.root_path, a.log_requests)

    class Server(uvicorn.Server):
        async def startup(self, *args: Any, **kw: Any) -> None:
            await super().startup(*args, **kw)
            if self.started:
                url = f"http://{a.host}:{a.port}{a.root_path}"
                print(f"kvlm: serving {names[0]} at {url} (chat page: {url}/, OpenAI API: {url}/v1; {ready})",
                      file=sys.stderr, flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            aengine.abort_all()  # in-flight requests end with "abort" at the next step; new ones get 503
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after shutting down (exit status -15); a clean drain exits 0.
            self._captured_signals.clear()

    # uvicorn's own start and stop lines repeat the URL the ready line gives: shown with -v or --log-level debug.
    uv_level = "warning" if a.log_level == "info" and not a.verbose else a.log_level
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level=uv_level, access_log=False,
                            timeout_graceful_shutdown=5, root_path=a.root_path, lifespan="off")
    server = Server(config)
    try:
        server.run()
    except SystemExit:  # uvicorn exits this way when it cannot bind
        pass
    if not server.started:
        raise KvlmError(f"could not start the server on {a.host}:{a.port} (is the port in use?)")
    return 0

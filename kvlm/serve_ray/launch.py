"""`ReplicaDeployment`: start (or join) Ray, deploy N `EngineReplica`s as one Serve deployment routed by
`KvlmRequestRouter`, hand out the `ReplicaClient` the OpenAI app runs on, and undo it all on shutdown.

A local Ray instance (no `--ray-address`) is sized for this machine: no dashboard, an 80 MiB object
store (requests and deltas are small), replica logs not copied to this terminal, Serve's HTTP proxy off
(kvlm's own uvicorn app is the one HTTP endpoint). Replicas ask Ray for no CPUs (`num_cpus=0`): each
runs `--threads` threads whatever Ray's accounting says, so two 1-thread replicas fit a 2-core machine.
`shutdown()` deletes the Serve application (its replicas drain and exit), stops Serve and, when this
process started Ray, stops Ray too: no raylet, GCS or worker process outlives `kvlm serve`.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvlm.errors import KvlmError
from kvlm.serve_ray.client import ReplicaClient
from kvlm.serve_ray.records import ReplicaInfo
from kvlm.serve_ray.replica import EngineReplica
from kvlm.serve_ray.router import KvlmRequestRouter
from kvlm.serve_ray.routing import BOOKS, RoutingBook

log = logging.getLogger("kvlm.server")
APP_NAME, DEPLOYMENT_NAME = "kvlm", "kvlm-engine"
OBJECT_STORE_BYTES = 80 << 20
STATS_PERIOD_S = 0.5  # how often Serve asks each replica for its cached blocks and load


@dataclass(slots=True)
class ReplicaOptions:
    replicas: int = 2  # fixed count; ignored when min/max are given (autoscaling)
    min_replicas: int | None = None
    max_replicas: int | None = None
    ray_address: str | None = None
    router: str = "prefix"
    imbalance_threshold: int = 4
    max_ongoing_requests: int = 16  # per replica; more wait in Serve's queue, where any replica can take them
    max_queued_requests: int | None = None

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def target(self) -> int:
        return (self.min_replicas or 1) if self.autoscaling else self.replicas


class ReplicaDeployment:
    def __init__(self, model: str, engine_config: dict[str, Any], opts: ReplicaOptions) -> None:
        self.model, self.engine_config, self.opts = model, engine_config, opts
        self.started_ray = False
        self.book = RoutingBook(opts.router, opts.imbalance_threshold, STATS_PERIOD_S)
        self.book_key = uuid.uuid4().hex
        BOOKS[self.book_key] = self.book
        self.info: ReplicaInfo | None = None
        self.handle: Any = None

    def _deployment_options(self) -> dict[str, Any]:
        o = self.opts
        kw: dict[str, Any] = dict(
            name=DEPLOYMENT_NAME, max_ongoing_requests=o.max_ongoing_requests, max_queued_requests=-1,
            ray_actor_options={"num_cpus": 0}, health_check_period_s=1.0, health_check_timeout_s=10.0,
            graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=3.0,
            request_router_config=RequestRouterConfig(
                request_router_class=f"{KvlmRequestRouter.__module__}.{KvlmRequestRouter.__name__}",
                request_router_kwargs={"book_key": self.book_key, "policy": o.router,
                                       "imbalance_threshold": o.imbalance_threshold},
                request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=5.0))
        if o.autoscaling:
            lo = o.min_replicas or 1
            kw["autoscaling_config"] = {"min_replicas": lo, "max_replicas": max(lo, o.max_replicas or lo),
                                        "initial_replicas": lo,
                                        "target_ongoing_requests": max(1, o.max_ongoing_requests // 2),
                                        "upscale_delay_s": 5.0, "downscale_delay_s": 30.0}
        else:
            kw["num_replicas"] = o.replicas
        return kw

    def start(self) -> None:
        """Ray up, replicas deployed and ready (each has loaded the model), the first one described."""
        for name in ("ray", "ray.serve"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # Until uvicorn takes the signals over, SIGTERM/SIGINT unwind to `shutdown()`: by default SIGTERM would
        # end this process and orphan what Ray started, and Ray's core installs a handler that aborts it.
        _catch_signals()
        if self.opts.ray_address:
            ray.init(address=self.opts.ray_address, log_to_driver=False, namespace="kvlm",
                     logging_level=logging.WARNING)
        else:
            # "local": a new instance even where `ray start` left one (ray.init() would join that one).
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False, namespace="kvlm",
                     logging_level=logging.WARNING)
            self.started_ray = True
        _catch_signals()  # again: ray.init replaced them
        serve.start(proxy_location="Disabled")
        dep = serve.deployment(EngineReplica).options(**self._deployment_options())
        try:
            serve.run(dep.bind(self.model, self.engine_config), name=APP_NAME, route_prefix=None)
        except RuntimeError as e:  # a replica's constructor failed (no kvlm on a node, the model missing there)
            raise KvlmError(f"the replicas did not start ({str(e).splitlines()[0]}); every node needs kvlm and "
                            "the model; Serve's logs are in Ray's session directory, logs/serve/") from None
        self.handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME)
        self.info = self.handle.describe.remote().result(timeout_s=120)

    def client(self) -> ReplicaClient:
        assert self.info is not None, "start() first"
        o = self.opts
        return ReplicaClient(self.handle, self.book, self.info, target_replicas=o.target,
                             max_ongoing_requests=o.max_ongoing_requests, max_queued_requests=o.max_queued_requests)

    def shutdown(self) -> None:
        """Idempotent; safe after a failed `start()`."""
        BOOKS.pop(self.book_key, None)
        if ray.is_initialized() and not self.started_ray:  # a shared cluster: remove only what we deployed
            try:
                serve.delete(APP_NAME)
            except Exception as e:  # the cluster is going down too: nothing left to remove
                log.warning("kvlm: removing the Serve application: %s", e)
        # Our own instance: its requests were aborted already (`ReplicaClient.abort_all`), and stopping Ray
        # ends every process it started (GCS, raylet, agents, the Serve controller, the replicas) at once.
        # Serve's own graceful shutdown would wait up to 30 s more, and hangs when a terminal's Ctrl-C
        # has reached Ray's processes too (they share this process group). Also after a start interrupted
        # inside ray.init: whatever it had started is stopped.
        ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _catch_signals() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)

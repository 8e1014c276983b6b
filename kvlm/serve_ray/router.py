"""`KvlmRequestRouter`: Ray Serve's public request-router API (`ray.serve.request_router.RequestRouter`)
routing by kvlm's prefix block hashes. Imports Ray: only `serve_ray.launch` imports this module, and only
when `kvlm serve --replicas` runs.

Why a RequestRouter and not a home-made ingress that picks replica handles: Serve keeps the replica set
(starts, health checks, restarts a killed replica, autoscaling), probes each chosen replica's queue, holds
back requests when every replica is at `max_ongoing_requests` and tells the router when a replica dies;
kvlm adds only the choice (`RoutingBook.rank`). Ray builds the router inside the deployment handle of the
`kvlm serve` process; `initialize_state` finds that process's `RoutingBook` by the key it was deployed
with (`routing.BOOKS`, the one bridge from Ray's object to the client and /metrics). A handle made in another
process (none is, today) gets a book of its own.

Each request carries a `RouteHint` (keyword `route`): its prompt's block hashes. The router writes the
chosen replica's id into it, so the client can tell the book when that request ends.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Serve pickles this module by value to ship the router class: names of it are copies in the handle's
# process, so the book registry and the hint class are reached through `routing` (pickled by reference).
from kvlm.serve_ray import routing


class KvlmRequestRouter(RequestRouter):
    def initialize_state(self, book_key: str = "", policy: str = "prefix", imbalance_threshold: int = 4,
                         **kwargs: Any) -> None:
        self.book = routing.BOOKS.get(book_key) or routing.RoutingBook(policy, imbalance_threshold)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.book.set_replicas(r.replica_id.unique_id for r in replicas)
        for r in replicas:
            self.book.report(r.replica_id.unique_id, r.routing_stats)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint = pending_request.kwargs.get("route") if pending_request is not None else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid, r in by_id.items():
            self.book.report(rid, r.routing_stats)
        ranking = self.book.rank(list(by_id), hint.hashes if isinstance(hint, routing.RouteHint) else [])
        if isinstance(hint, routing.RouteHint):
            hint.decision, hint.order = ranking.decision, ranking.order
        if pending_request is not None:
            # Every rank tried and all replicas full: back off before the next round instead of spinning.
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid]] for rid in ranking.order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hint = pending_request.kwargs.get("route")
        if isinstance(hint, routing.RouteHint):
            hint.replica_id = replica_id.unique_id
            self.book.routed(replica_id.unique_id, hint.hashes, hint.decision)
        # Other calls (describe) are not engine requests: the client never reports them finished.

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.book.forget(replica_id.unique_id)

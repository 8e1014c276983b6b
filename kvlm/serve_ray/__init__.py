"""Serving past one process: `kvlm serve --replicas N` runs N engine replicas on Ray Serve behind the one
OpenAI-compatible app, routed by kvlm's own prefix block hashes.

`routing` (which replica: plain Python), `router` (Ray Serve's RequestRouter over it), `replica` (one
engine per replica process), `client` (what the app calls instead of `AsyncEngine`), `metrics`,
`records` (what crosses the process boundary) and `launch` (Ray up, deploy, shut down). Only `router`,
`launch` and `client`'s fault handling import Ray, and nothing imports them unless `--replicas` is given:
a single `kvlm serve` never loads Ray.
"""

from __future__ import annotations

from kvlm.errors import KvlmError

INSTALL_HINT = "kvlm serve --replicas needs Ray Serve: pip install 'kvlm[ray]' (ray[serve] 2.60.0)"


def require_ray() -> None:
    """Raise one readable line when Ray Serve is not installed."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:  # no ray, or ray without its serve extra (fastapi, aiohttp, ...)
        raise KvlmError(INSTALL_HINT) from None

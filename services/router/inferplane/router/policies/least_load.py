"""`least_load`: the replica with the fewest requests in flight from this router, ties broken
by fewer queued prompt tokens (requests still in prefill), then by lowest index.

The counters are the router's own (exact, updated on every start, first chunk and end); the
engine's `GetLoads` is not reachable from the router (see services/router/README.md for the
node-agent load report proposed to add it).
"""

from __future__ import annotations

from inferplane.router.features import RequestFeatures
from inferplane.router.replicas import ReplicaSet


class LeastLoad:
    """Least outstanding requests (join-the-shortest-queue) over our own counters."""

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        return replicas.least_loaded()

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        return replicas.least_loaded_others(chosen, n)

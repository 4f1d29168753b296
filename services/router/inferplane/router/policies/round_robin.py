"""`round_robin`: each request to the next replica that can take it (a cursor per deployment)."""

from __future__ import annotations

from inferplane.router.features import RequestFeatures
from inferplane.router.replicas import INF, ReplicaSet


class RoundRobin:
    """Cycles through the replicas, skipping those that cannot take a request now."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        n = replicas.n
        scores = replicas.scores
        for step in range(n):
            i = (self._cursor + step) % n
            if scores[i] != INF:
                self._cursor = i + 1
                return i
        return None

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """The replicas after `chosen` in cycle order (the cursor does not move)."""
        size = replicas.n
        start = (chosen + 1) if chosen is not None else self._cursor
        return replicas.fallbacks(((start + k) % size for k in range(size)), chosen, n)

"""`round_robin`: each request to the next replica that can take it (a cursor per deployment)."""

from __future__ import annotations

from inferplane.router.features import RequestFeatures
from inferplane.router.replicas import ReplicaSet


class RoundRobin:
    """Cycles through the replicas, skipping those that cannot take a request now (found in
    the set's free bit set, so a nearly full deployment costs no scan)."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        i = replicas.next_free(self._cursor)
        if i is not None:
            self._cursor = i + 1
        return i

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """The replicas after `chosen` in cycle order (the cursor does not move)."""
        start = (chosen + 1) if chosen is not None else self._cursor
        return replicas.cyclic_fallbacks(start, chosen, n)

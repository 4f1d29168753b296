"""`session_affinity`: requests of one session (`x-session-id`, else the request's `user`) go to
the same replica, by consistent hashing with bounded loads; requests without a session go to
the least loaded replica."""

from __future__ import annotations

from inferplane.router.features import RequestFeatures
from inferplane.router.policies.hashring import bounded_choice, ring_fallbacks
from inferplane.router.replicas import ReplicaSet


class SessionAffinity:
    """Sticky by session key; a replica over the bound sheds to the next one on the ring."""

    def __init__(self, load_factor: float = 1.25) -> None:
        self._c = load_factor

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        if request.session is not None:
            chosen = bounded_choice(replicas, request.session, self._c)
            if chosen is not None:
                return chosen
        return replicas.least_loaded()

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """Ring order from the session key (where the session goes if its replica leaves)."""
        if request.session is None:
            return replicas.least_loaded_others(chosen, n)
        return ring_fallbacks(replicas, request.session, chosen, n)

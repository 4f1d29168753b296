"""The router's own view of its replicas' load, laid out so a routing decision stays O(1)-ish.

`ReplicaState` is one replica's live counters (requests in flight, queued prompt tokens) and
circuit breaker; it outlives routing-table versions (keyed by `Endpoint.key`). `ReplicaSet` is
the immutable membership of one deployment in one table version plus flat per-index arrays
(in flight, capacity, score) that every change updates in O(1), so that least-load is one
C-level `min` over a list of floats even at 1,000 replicas (bench/router_decision.py).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any

from inferplane.router.breaker import CircuitBreaker
from inferplane.router.routes import Endpoint

INF = math.inf
# Queued prompt tokens only break ties between replicas with the same number of requests in
# flight: the fraction stays below 1 so "fewest requests in flight" always wins.
_TOKEN_TIE_SCALE = 1_000_000.0

ReplicaKey = tuple[str, str]


class ReplicaState:
    """Live counters of one replica (shared by every table version it appears in).

    Attributes:
        in_flight: requests the router has sent it and not yet finished.
        queued_tokens: estimated prompt tokens of those requests still waiting for their first
            chunk (prefill not done), summed.
        breaker: its circuit breaker.
    """

    __slots__ = ("breaker", "in_flight", "key", "owners", "queued_tokens")

    def __init__(self, key: ReplicaKey, breaker: CircuitBreaker) -> None:
        self.key = key
        self.in_flight = 0
        self.queued_tokens = 0
        self.breaker = breaker
        self.owners: list[tuple[ReplicaSet, int]] = []

    def changed(self, now: float) -> None:
        for replica_set, index in self.owners:
            replica_set.refresh(index, now)


class ReplicaSet:
    """The replicas of one deployment in one routing-table version, with O(1)-updated arrays.

    `scores[i]` is `in_flight + tie-break(queued_tokens)` when replica i can take a request
    now, `inf` when it cannot (draining, breaker open or probing, at its concurrency cap).
    Policies read these arrays; only `ReplicaState.changed` and `refresh` write them.
    """

    def __init__(
        self,
        deployment: str,
        endpoints: Sequence[Endpoint],
        states: Sequence[ReplicaState],
        default_max_concurrency: int,
        now: float,
    ) -> None:
        self.deployment = deployment
        self.endpoints = tuple(endpoints)
        self.states = tuple(states)
        self.keys = tuple(e.key for e in endpoints)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.n = len(self.endpoints)
        self.caps = [e.max_concurrency or default_max_concurrency or 1 << 30 for e in endpoints]
        self.draining = [e.draining for e in endpoints]
        self.in_flight = [0] * self.n
        self.blocked = [True] * self.n
        self.scores = [INF] * self.n
        self.total_in_flight = 0
        self.usable = 0
        # Replicas that can take a request now (score < inf): 0 answers "all full" in O(1).
        self.free = 0
        self.next_wake = INF
        # Per-set caches for policies (e.g. a hash ring), dropped with the set.
        self.cache: dict[str, Any] = {}
        for i in range(self.n):
            self.refresh(i, now)

    def attach(self) -> None:
        """Makes the states update this set (called when the set becomes current)."""
        for i, state in enumerate(self.states):
            state.owners = [(s, j) for s, j in state.owners if s.deployment != self.deployment]
            state.owners.append((self, i))

    def detach(self) -> None:
        """Stops the states updating this set (it left the table or was replaced)."""
        for state in self.states:
            state.owners = [(s, j) for s, j in state.owners if s is not self]

    def refresh(self, i: int, now: float) -> None:
        """Recomputes replica i's entries from its state (O(1))."""
        state = self.states[i]
        self.total_in_flight += state.in_flight - self.in_flight[i]
        self.in_flight[i] = state.in_flight
        blocked = self.draining[i] or not state.breaker.available(now)
        if blocked != self.blocked[i]:
            self.usable += -1 if blocked else 1
            self.blocked[i] = blocked
        open_until = state.breaker.open_until
        if open_until and open_until < self.next_wake:
            self.next_wake = open_until
        was_free = self.scores[i] != INF
        if blocked or state.in_flight >= self.caps[i]:
            self.scores[i] = INF
        else:
            tie = min(state.queued_tokens / _TOKEN_TIE_SCALE, 0.999)
            self.scores[i] = state.in_flight + tie
        self.free += (self.scores[i] != INF) - was_free

    def wake(self, now: float) -> None:
        """Re-reads breakers whose open period ended (HALF_OPEN lets a probe through)."""
        if now < self.next_wake:
            return
        self.next_wake = INF
        for i in range(self.n):
            self.refresh(i, now)

    def least_loaded(self) -> int | None:
        """The usable replica with the fewest requests in flight (ties: fewer queued tokens,
        then lowest index), or None when every replica is blocked or at its cap."""
        scores = self.scores
        best = min(scores)
        return None if best == INF else scores.index(best)

    def can_take(self, i: int) -> bool:
        return self.scores[i] != INF

    def fallbacks(self, order: Iterable[int], chosen: int | None, n: int) -> list[int]:
        """Up to `n` replicas besides `chosen`, in `order`, that Envoy may try when `chosen`
        fails before answering (the endpoint picker's list after its primary): not draining,
        breaker not open; those under their cap come first (a fallback is used only when the
        primary failed, so one request over a cap beats a failed request)."""
        under: list[int] = []
        full: list[int] = []
        seen: set[int] = set()
        for i in order:
            if i == chosen or i in seen or self.blocked[i]:
                continue
            seen.add(i)
            (under if self.scores[i] != INF else full).append(i)
            if len(under) >= n:
                break
        return (under + full)[:n]

    def least_loaded_others(self, chosen: int | None, n: int) -> list[int]:
        """`fallbacks` in least-load order (score, then requests in flight, then index);
        O(replicas)."""
        if n <= 0:
            return []
        scores, in_flight, blocked = self.scores, self.in_flight, self.blocked
        candidates = (i for i in range(self.n) if i != chosen and not blocked[i])
        order = heapq.nsmallest(n, candidates, key=lambda i: (scores[i], in_flight[i], i))
        return self.fallbacks(order, chosen, n)

    def bound(self, c: float) -> int:
        """The bounded-load cap of consistent hashing with bounded loads: ceil(c·(m+1)/n) for
        m requests in flight over n usable replicas (Mirrokni, Thorup, Zadimoghaddam,
        "Consistent Hashing with Bounded Loads", SODA 2018, arXiv:1608.01350)."""
        return math.ceil(c * (self.total_in_flight + 1) / max(1, self.usable))

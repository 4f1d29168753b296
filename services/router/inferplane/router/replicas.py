"""The router's own view of its replicas' load, laid out so a routing decision stays
sub-linear in the number of replicas.

`ReplicaState` is one replica's live counters (requests in flight, queued prompt tokens) and
circuit breaker; it outlives routing-table versions (keyed by `Endpoint.key`). `ReplicaSet` is
the immutable membership of one deployment in one table version plus flat per-index arrays
(in flight, capacity, score) that every change updates in O(log n), and three indexes over
them: a lazily invalidated heap of load ranks (least load and its fallbacks in O(log n)
amortized instead of a scan), a bit set of the replicas under their cap (round robin's next
one in a few word operations), and a heap of breaker wake-ups (only the breakers whose open
period ended are re-read). At 10,000 replicas a decision stays within tens of microseconds
(bench/router_decision.py; a linear `min` over the scores took ~110 µs there).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from heapq import heappop, heappush
from typing import Any

from inferplane.router.breaker import CircuitBreaker
from inferplane.router.routes import Endpoint

INF = math.inf
# Queued prompt tokens only break ties between replicas with the same number of requests in
# flight: the fraction stays below 1 so "fewest requests in flight" always wins.
_TOKEN_TIE_SCALE = 1_000_000.0
# Rank of a usable replica at its cap: after every replica under its cap, ordered by requests
# in flight (exact in a float up to 2**53).
_FULL = float(1 << 40)

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
    """The replicas of one deployment in one routing-table version, with O(log n)-updated
    arrays and indexes.

    `scores[i]` is `in_flight + tie-break(queued_tokens)` when replica i can take a request
    now, `inf` when it cannot (draining, breaker open or probing, at its concurrency cap).
    Policies read these arrays; only `ReplicaState.changed` and `refresh` write them. A
    caller may hide replicas from one decision by setting their score to `inf` and putting
    it back right after (`Admission` does, for the replicas a request already tried): every
    index below checks the score of what it finds.
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
        self.by_address: dict[str, int] = {}
        for i, e in enumerate(self.endpoints):
            self.by_address.setdefault(e.address, i)
        self.n = len(self.endpoints)
        self.caps = [e.cap(default_max_concurrency) for e in endpoints]
        self.draining = [e.draining for e in endpoints]
        self.in_flight = [0] * self.n
        self.blocked = [True] * self.n
        self.scores = [INF] * self.n
        self.total_in_flight = 0
        self.usable = 0
        # Replicas that can take a request now (score < inf): 0 answers "all full" in O(1).
        self.free = 0
        # Bit i set: replica i can take a request now (round robin's next one in O(n/64) C).
        self.free_bits = 0
        # Least-load index: (rank, i) entries, valid while rank[i] still equals theirs; rank
        # is the score under the cap, _FULL + in flight at it, None when blocked.
        self._rank: list[float | None] = [None] * self.n
        self._heap: list[tuple[float, int]] = []
        # Breakers' wake-ups: (open_until, i), and the one pushed per replica.
        self._wakes: list[tuple[float, int]] = []
        self._wake_at = [0.0] * self.n
        self.next_wake = INF
        # Per-set caches for policies (e.g. a hash ring), dropped with the set; entries
        # depend on membership only (`keys`), so a set with the same keys may take them over.
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
        """Recomputes replica i's entries from its state (O(log n) amortized)."""
        state = self.states[i]
        in_flight = state.in_flight
        self.total_in_flight += in_flight - self.in_flight[i]
        self.in_flight[i] = in_flight
        breaker = state.breaker
        available = breaker.available(now)  # also moves an OPEN breaker past its time
        blocked = self.draining[i] or not available
        if blocked != self.blocked[i]:
            self.usable += -1 if blocked else 1
            self.blocked[i] = blocked
        open_until = breaker.open_until
        if open_until > now and open_until != self._wake_at[i]:
            self._wake_at[i] = open_until
            heappush(self._wakes, (open_until, i))
            if open_until < self.next_wake:
                self.next_wake = open_until
        was_free = self.scores[i] != INF
        rank: float | None
        if blocked:
            self.scores[i] = INF
            rank = None
        elif in_flight >= self.caps[i]:
            self.scores[i] = INF
            rank = _FULL + in_flight
        else:
            tie = min(state.queued_tokens / _TOKEN_TIE_SCALE, 0.999)
            rank = self.scores[i] = in_flight + tie
        if (rank is not None and rank < _FULL) != was_free:
            self.free += -1 if was_free else 1
            self.free_bits ^= 1 << i
        if rank != self._rank[i]:
            self._rank[i] = rank
            if rank is not None:
                heap = self._heap
                heappush(heap, (rank, i))
                if len(heap) > 4 * self.n + 64:
                    self._rebuild()

    def _rebuild(self) -> None:
        # Stale entries outnumber live ones: start over from the ranks (O(n), amortized O(1)).
        self._heap = [(r, i) for i, r in enumerate(self._rank) if r is not None]
        heapq.heapify(self._heap)

    def wake(self, now: float) -> None:
        """Re-reads the breakers whose open period ended (HALF_OPEN lets a probe through)."""
        if now < self.next_wake:
            return
        wakes = self._wakes
        while wakes and wakes[0][0] <= now:
            until, i = heappop(wakes)
            if self._wake_at[i] == until:
                self._wake_at[i] = 0.0
                self.refresh(i, now)
        self.next_wake = wakes[0][0] if wakes else INF

    def least_loaded(self) -> int | None:
        """The usable replica with the fewest requests in flight (ties: fewer queued tokens,
        then lowest index), or None when every replica is blocked or at its cap."""
        heap, rank, scores = self._heap, self._rank, self.scores
        hidden: list[tuple[float, int]] = []
        chosen = None
        while heap:
            entry = heap[0]
            r, i = entry
            if rank[i] != r:
                heappop(heap)
            elif r >= _FULL:
                break
            elif scores[i] == INF:  # hidden from this decision by the caller
                hidden.append(heappop(heap))
            else:
                chosen = i
                break
        for entry in hidden:
            heappush(heap, entry)
        return chosen

    def can_take(self, i: int) -> bool:
        return self.scores[i] != INF

    def next_free(self, start: int) -> int | None:
        """The first replica at or after index `start` (wrapping around) that can take a
        request now, or None."""
        bits, scores, n = self.free_bits, self.scores, self.n
        if not bits or not n:
            return None
        start %= n
        while bits:
            after = bits >> start
            if after:
                i = start + (after & -after).bit_length() - 1
            else:
                i = (bits & -bits).bit_length() - 1
            if scores[i] != INF:
                return i
            bits &= ~(1 << i)  # hidden from this decision by the caller
        return None

    def fallbacks(self, order: Iterable[int], chosen: int | None, n: int) -> list[int]:
        """Up to `n` replicas besides `chosen`, in `order`, that Envoy may try when `chosen`
        fails before answering (the endpoint picker's list after its primary): not draining,
        breaker not open; those under their cap come first (a fallback is used only when the
        primary failed, so one request over a cap beats a failed request). Walks `order`
        until it found `n` under their cap: give it an order that ends (or use the indexes:
        `least_loaded_others`, `cyclic_fallbacks`)."""
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
        O(n log replicas) amortized from the load heap."""
        if n <= 0:
            return []
        heap, rank = self._heap, self._rank
        out: list[int] = []
        seen: set[int] = set()
        popped: list[tuple[float, int]] = []
        while heap and len(out) < n:
            entry = heappop(heap)
            r, i = entry
            if rank[i] != r:
                continue  # stale: dropped for good
            popped.append(entry)
            if i != chosen and i not in seen:
                seen.add(i)
                out.append(i)
        for entry in popped:
            heappush(heap, entry)
        return out

    def cyclic_fallbacks(self, start: int, chosen: int | None, n: int) -> list[int]:
        """`fallbacks` in index order from `start`, wrapping around (round robin's), from the
        free bit set: those under their cap first, then the usable ones at it."""
        size = self.n
        if n <= 0 or not size:
            return []
        under: list[int] = []
        bits = self.free_bits
        if chosen is not None:
            bits &= ~(1 << chosen)
        start %= size
        while bits and len(under) < n:
            after = bits >> start
            i = (
                start + (after & -after).bit_length() - 1
                if after
                else (bits & -bits).bit_length() - 1
            )
            bits &= ~(1 << i)
            under.append(i)
        if len(under) >= n:
            return under
        # Too few under their cap (saturated): the usable ones at it, in the same order.
        taken = set(under)
        order = ((start + k) % size for k in range(size))
        full = (i for i in order if i != chosen and i not in taken and not self.blocked[i])
        return under + [i for _, i in zip(range(n - len(under)), full, strict=False)]

    def bound(self, c: float) -> int:
        """The bounded-load cap of consistent hashing with bounded loads: ceil(c·(m+1)/n) for
        m requests in flight over n usable replicas (Mirrokni, Thorup, Zadimoghaddam,
        "Consistent Hashing with Bounded Loads", SODA 2018, arXiv:1608.01350)."""
        return math.ceil(c * (self.total_in_flight + 1) / max(1, self.usable))

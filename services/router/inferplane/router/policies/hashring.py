"""Consistent hashing with bounded loads, shared by the affinity policies.

Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018,
arXiv:1608.01350): replicas sit on a hash ring (here `VNODES` points each); a key goes to the
first replica clockwise from its hash whose load is below ceil(c·(m+1)/n). No replica ever goes
over that bound, and when a replica leaves only the keys it held (plus overflow) move.
"""

from __future__ import annotations

import bisect
import dataclasses

from inferplane.router.features import hash64
from inferplane.router.replicas import INF, ReplicaSet

VNODES = 16
# How many ring points to walk before giving up on affinity and taking the least loaded.
MAX_PROBES = 64


@dataclasses.dataclass(frozen=True, slots=True)
class HashRing:
    """Sorted ring points and the replica index owning each."""

    points: tuple[int, ...]
    owners: tuple[int, ...]

    @classmethod
    def of(cls, replicas: ReplicaSet) -> HashRing:
        pairs = sorted(
            (hash64(f"{address}/{replica_id}#{v}".encode()), i)
            for i, (address, replica_id) in enumerate(replicas.keys)
            for v in range(VNODES)
        )
        return cls(tuple(p for p, _ in pairs), tuple(i for _, i in pairs))

    def first(self, key: int) -> int:
        """The owner of `key` ignoring load (the replica that would hold it when idle)."""
        return self.owners[bisect.bisect(self.points, key) % len(self.points)]


def ring_of(replicas: ReplicaSet) -> HashRing:
    """The set's ring, built once per set (membership is immutable within a set)."""
    ring = replicas.cache.get("ring")
    if ring is None:
        ring = replicas.cache["ring"] = HashRing.of(replicas)
    return ring  # type: ignore[no-any-return]


def bounded_choice(replicas: ReplicaSet, key: int, c: float) -> int | None:
    """The first replica clockwise from `key` that can take a request and is under the bound;
    None when none is found within `MAX_PROBES` points (the caller falls back to least load)."""
    if replicas.n == 0:
        return None
    ring = ring_of(replicas)
    bound = replicas.bound(c)
    points = len(ring.points)
    start = bisect.bisect(ring.points, key)
    scores, in_flight, owners = replicas.scores, replicas.in_flight, ring.owners
    for step in range(min(points, MAX_PROBES)):
        i = owners[(start + step) % points]
        if scores[i] != INF and in_flight[i] < bound:
            return i
    return None


def ring_fallbacks(replicas: ReplicaSet, key: int, chosen: int | None, n: int) -> list[int]:
    """Up to `n` replicas besides `chosen` in ring order from `key` (where the key moves when
    its replica leaves), filtered by `ReplicaSet.fallbacks`."""
    if replicas.n == 0 or n <= 0:
        return []
    ring = ring_of(replicas)
    points = len(ring.points)
    start = bisect.bisect(ring.points, key)
    owners = ring.owners
    order = (owners[(start + step) % points] for step in range(points))
    return replicas.fallbacks(order, chosen, n)

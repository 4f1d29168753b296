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
    """Sorted ring points, the replica index owning each, and each replica's ring positions
    (sorted indices into `points`)."""

    points: tuple[int, ...]
    owners: tuple[int, ...]
    positions: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, replicas: ReplicaSet) -> HashRing:
        pairs = sorted(
            (hash64(f"{address}/{replica_id}#{v}".encode()), i)
            for i, (address, replica_id) in enumerate(replicas.keys)
            for v in range(VNODES)
        )
        positions: list[list[int]] = [[] for _ in range(replicas.n)]
        for at, (_, i) in enumerate(pairs):
            positions[i].append(at)
        return cls(
            tuple(p for p, _ in pairs),
            tuple(i for _, i in pairs),
            tuple(tuple(p) for p in positions),
        )

    def distance(self, i: int, start: int) -> int:
        """Steps from ring index `start` (clockwise) to replica i's first point."""
        positions = self.positions[i]
        at = bisect.bisect_left(positions, start)
        if at < len(positions):
            return positions[at] - start
        return positions[0] + len(self.points) - start

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
    None when none is found within `MAX_PROBES` points (the caller falls back to least load).

    When few replicas can take a request (a saturated deployment, where each freed slot is
    granted at once), only those few are looked at, by their own first point: the same answer
    as probing the ring, without the probes."""
    if replicas.n == 0:
        return None
    ring = ring_of(replicas)
    bound = replicas.bound(c)
    points = len(ring.points)
    start = bisect.bisect(ring.points, key)
    scores, in_flight, owners = replicas.scores, replicas.in_flight, ring.owners
    probes = min(points, MAX_PROBES)
    if replicas.free <= FEW_FREE:
        best, best_distance = None, probes
        start %= points
        for i in _free_indices(replicas):
            if scores[i] == INF or in_flight[i] >= bound:
                continue
            distance = ring.distance(i, start)
            if distance < best_distance:
                best, best_distance = i, distance
        return best
    for step in range(probes):
        i = owners[(start + step) % points]
        if scores[i] != INF and in_flight[i] < bound:
            return i
    return None


# Free replicas at or below which `bounded_choice` looks at them rather than at ring points.
FEW_FREE = 8


def ring_fallbacks(replicas: ReplicaSet, key: int, chosen: int | None, n: int) -> list[int]:
    """Up to `n` replicas besides `chosen` in ring order from `key` (where the key moves when
    its replica leaves), filtered as `ReplicaSet.fallbacks` does: under their cap first.

    Walking the ring costs about n·replicas/free steps to meet `n` replicas under their cap;
    when few are (a nearly saturated deployment), those few are ordered by their own first
    point instead, so the cost stays O(free + n) rather than O(ring)."""
    if replicas.n == 0 or n <= 0:
        return []
    ring = ring_of(replicas)
    points = len(ring.points)
    start = bisect.bisect(ring.points, key) % points
    owners = ring.owners
    free = replicas.free - (1 if chosen is not None and replicas.can_take(chosen) else 0)
    if free * WALK >= n * replicas.n:
        order = (owners[(start + step) % points] for step in range(points))
        return replicas.fallbacks(order, chosen, n)
    under = [i for i in _free_indices(replicas) if i != chosen]
    under.sort(key=lambda i: ring.distance(i, start))
    del under[n:]
    if len(under) >= n:
        return under
    full: list[int] = []
    seen = set(under)
    scores, blocked = replicas.scores, replicas.blocked
    for step in range(points):
        i = owners[(start + step) % points]
        if i == chosen or i in seen or blocked[i] or scores[i] != INF:
            continue
        seen.add(i)
        full.append(i)
        if len(under) + len(full) >= n:
            break
    return under + full


# Ring steps a fallback walk may expect to take before ordering the free replicas directly.
WALK = 256


def _free_indices(replicas: ReplicaSet) -> list[int]:
    bits = replicas.free_bits
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out

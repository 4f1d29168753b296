"""`power_of_two`: the power of two choices (Mitzenmacher, "The Power of Two Choices in
Randomized Load Balancing", IEEE TPDS 2001; Azar, Broder, Karlin, Upfal, "Balanced
Allocations", STOC 1994).

Two distinct replicas that can take the request are drawn uniformly at random; the one with
fewer requests in flight from this router wins (ties: fewer queued prompt tokens, which
`ReplicaSet.scores` already folds in). With n replicas the busiest ends about
log log n / log 2 above the mean, against log n / log log n for one random choice, while
routers sharing a fleet do not all herd to the same least-loaded replica (what a strict
least-load choice does on stale or partial counters).

Sampling never scans: while at least a quarter of the replicas can take a request, indexes
are drawn at random and checked (about four draws on average); otherwise the r-th set bit of
the set's free bit set (`ReplicaSet.free_bits`) is found by halving the bit set with
`int.bit_count` (O(log n) big-int operations, each a few machine words per 64 replicas).
A decision stays within microseconds at 10,000 replicas (bench/router_decision.py).
Fallbacks are the least loaded others (the set's load heap).
"""

from __future__ import annotations

import random

from inferplane.router.features import RequestFeatures
from inferplane.router.replicas import INF, ReplicaSet

# Index draws are used while free replicas are at least 1/DENSE of the set (expected draws
# per sample ≤ DENSE); below that, the free bit set is sampled by rank.
DENSE = 4
# Draws of one sample before it turns to the bit set (replicas hidden by the caller, bad
# luck): the chance of getting there with ≥ 1/DENSE free is (3/4)^16 ≈ 1 %.
DRAWS = 16
# Replicas a sample may find hidden from this decision (score inf, bit still set: the
# replicas a request already tried) before it gives up and lets least load decide.
HIDDEN_TRIES = 8


class PowerOfTwo:
    """Two random choices, the less loaded wins.

    Args:
        rng: the random source (a seeded `random.Random` in tests); default: its own.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        if not replicas.free:
            return None
        first = self._sample(replicas, None)
        if first is None:  # only replicas hidden by the caller were found
            return replicas.least_loaded()
        second = self._sample(replicas, first)
        if second is None:
            return first
        scores = replicas.scores
        return second if scores[second] < scores[first] else first

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """The least loaded others (`ReplicaSet.least_loaded_others`)."""
        return replicas.least_loaded_others(chosen, n)

    def _sample(self, replicas: ReplicaSet, other: int | None) -> int | None:
        """A uniformly drawn replica that can take a request, other than `other`; None when
        there is none (or only ones hidden from this decision were met)."""
        n, scores, draw = replicas.n, replicas.scores, self._rng.randrange
        if replicas.free * DENSE >= n:
            for _ in range(DRAWS):
                i = draw(n)
                if i != other and scores[i] != INF:
                    return i
        bits = replicas.free_bits
        if other is not None:
            bits &= ~(1 << other)
        for _ in range(HIDDEN_TRIES):
            count = bits.bit_count()
            if not count:
                return None
            i = nth_set_bit(bits, draw(count))
            if scores[i] != INF:
                return i
            bits &= ~(1 << i)  # hidden from this decision by the caller
        return None


def nth_set_bit(bits: int, rank: int) -> int:
    """The position of the set bit of rank `rank` (0: the lowest) in `bits`.

    Halves the window with `int.bit_count` until it is a byte wide: O(log(bits)) big-int
    operations. Raises ValueError when `bits` has `rank` set bits or fewer."""
    if rank < 0 or rank >= bits.bit_count():
        raise ValueError(f"no set bit of rank {rank} in a set of {bits.bit_count()}")
    offset, width = 0, bits.bit_length()
    while width > 8:
        half = width >> 1
        low = bits & ((1 << half) - 1)
        count = low.bit_count()
        if rank < count:
            bits, width = low, half
        else:
            rank -= count
            bits >>= half
            offset += half
            width -= half
    while True:
        lowest = bits & -bits
        if not rank:
            return offset + lowest.bit_length() - 1
        bits ^= lowest
        rank -= 1

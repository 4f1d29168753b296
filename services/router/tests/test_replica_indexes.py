"""The replica set's indexes (load heap, free bit set, breaker wake-ups) answer exactly what a
scan of its arrays answers (the linear versions they replaced), whatever the loads, caps,
breakers, draining replicas and hidden ones — the sub-linear decision at 10,000 replicas
(bench/router_decision.py) changes no routing outcome."""

from __future__ import annotations

import bisect
import heapq
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.router.breaker import CircuitBreaker
from inferplane.router.policies.hashring import (
    MAX_PROBES,
    bounded_choice,
    ring_fallbacks,
    ring_of,
)
from inferplane.router.replicas import ReplicaSet, ReplicaState
from inferplane.router.routes import Endpoint

INF = math.inf


def _naive_least_loaded(s: ReplicaSet) -> int | None:
    best = min(s.scores)
    return None if best == INF else s.scores.index(best)


def _naive_others(s: ReplicaSet, chosen: int | None, n: int) -> list[int]:
    candidates = (i for i in range(s.n) if i != chosen and not s.blocked[i])
    order = heapq.nsmallest(n, candidates, key=lambda i: (s.scores[i], s.in_flight[i], i))
    return s.fallbacks(order, chosen, n)


def _naive_next_free(s: ReplicaSet, start: int) -> int | None:
    for step in range(s.n):
        i = (start + step) % s.n
        if s.scores[i] != INF:
            return i
    return None


def _naive_ring(s: ReplicaSet, key: int, chosen: int | None, n: int) -> list[int]:
    ring = ring_of(s)
    points = len(ring.points)
    start = bisect.bisect(ring.points, key)
    order = (ring.owners[(start + step) % points] for step in range(points))
    return s.fallbacks(order, chosen, n)


def _naive_bounded(s: ReplicaSet, key: int, c: float) -> int | None:
    ring = ring_of(s)
    bound = s.bound(c)
    points = len(ring.points)
    start = bisect.bisect(ring.points, key)
    for step in range(min(points, MAX_PROBES)):
        i = ring.owners[(start + step) % points]
        if s.scores[i] != INF and s.in_flight[i] < bound:
            return i
    return None


def _check(s: ReplicaSet, probe: int) -> None:
    assert s.least_loaded() == _naive_least_loaded(s)
    assert s.free == sum(1 for x in s.scores if x != INF)
    assert s.free_bits == sum(1 << i for i, x in enumerate(s.scores) if x != INF)
    chosen = probe % s.n if probe % 3 else None
    for n in (1, 2, 5):
        assert s.least_loaded_others(chosen, n) == _naive_others(s, chosen, n)
        start = probe % (s.n + 1)
        naive_cycle = s.fallbacks(((start + k) % s.n for k in range(s.n)), chosen, n)
        assert s.cyclic_fallbacks(start, chosen, n) == naive_cycle
        key = (probe * 0x9E3779B97F4A7C15) % (1 << 64)
        assert ring_fallbacks(s, key, chosen, n) == _naive_ring(s, key, chosen, n)
    for c in (1.0, 1.25, 2.0):
        key = (probe * 0xBF58476D1CE4E5B9) % (1 << 64)
        assert bounded_choice(s, key, c) == _naive_bounded(s, key, c)
    assert s.next_free(probe) == _naive_next_free(s, probe)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(
        st.tuples(
            st.sampled_from(["load", "tokens", "fail", "ok", "time", "hide", "cap"]),
            st.integers(0, 1 << 16),
            st.integers(0, 6),
        ),
        min_size=20,
        max_size=150,
    ),
)
def test_indexes_agree_with_a_scan(n: int, ops: list[tuple[str, int, int]]) -> None:
    caps = [1 + (i % 4) for i in range(n)]
    eps = tuple(
        Endpoint(f"10.0.{i // 250}.{i % 250}:9000", f"r{i}", max_concurrency=caps[i])
        for i in range(n)
    )
    eps = tuple(
        e
        if i % 7 != 3
        else Endpoint(e.address, e.replica_id, draining=True, max_concurrency=caps[i])
        for i, e in enumerate(eps)
    )
    states = [
        ReplicaState(e.key, CircuitBreaker(failure_threshold=1, open_seconds=2.0)) for e in eps
    ]
    now = 0.0
    s = ReplicaSet("d", eps, states, 64, now)
    s.attach()
    for op, x, y in ops:
        i = x % n
        state = states[i]
        if op == "load":
            state.in_flight = y
        elif op == "tokens":
            state.queued_tokens = x
        elif op == "fail":
            state.breaker.on_failure(now)
        elif op == "ok":
            state.breaker.on_start(now)
            if y % 2:
                state.breaker.on_success()
        elif op == "time":
            now += y * 0.7
            s.wake(now)
            _check(s, x)
            continue
        elif op == "hide":  # one decision that must not see replica i, then put back
            saved = s.scores[i]
            s.scores[i] = INF
            assert s.least_loaded() == _naive_least_loaded(s)
            assert s.next_free(x) == _naive_next_free(s, x)
            s.scores[i] = saved
            _check(s, x)
            continue
        elif op == "cap":
            state.in_flight = s.caps[i]  # at its cap exactly
        state.changed(now)
        _check(s, x)


def test_the_load_heap_stays_bounded_under_churn() -> None:
    eps = tuple(Endpoint(f"10.0.0.{i}:9000", f"r{i}", max_concurrency=8) for i in range(10))
    states = [ReplicaState(e.key, CircuitBreaker()) for e in eps]
    s = ReplicaSet("d", eps, states, 64, 0.0)
    s.attach()
    for step in range(10_000):
        state = states[step % 10]
        state.in_flight = (step * 7) % 9
        state.changed(0.0)
        assert len(s._heap) <= 4 * s.n + 64
    assert s.least_loaded() == _naive_least_loaded(s)


def test_ring_fallbacks_of_a_nearly_full_deployment_keep_the_ring_order() -> None:
    """At 3,000 replicas with only a few under their cap, the few are ordered by their own
    ring points instead of walking the ring: the same list as the walk."""
    rng = random.Random(5)
    n = 3000
    eps = tuple(
        Endpoint(f"10.{i // 250}.{i % 250}.1:9000", f"r{i}", max_concurrency=2) for i in range(n)
    )
    states = [ReplicaState(e.key, CircuitBreaker()) for e in eps]
    s = ReplicaSet("d", eps, states, 64, 0.0)
    s.attach()
    for state in states:
        state.in_flight = 2
        state.changed(0.0)
    for free in (0, 1, 3, 10):
        for i in rng.sample(range(n), free):
            states[i].in_flight = 1
            states[i].changed(0.0)
        for _ in range(50):
            key = rng.getrandbits(64)
            chosen = rng.randrange(n) if rng.random() < 0.5 else None
            for k in (1, 2, 4):
                assert ring_fallbacks(s, key, chosen, k) == _naive_ring(s, key, chosen, k)
            assert bounded_choice(s, key, 1.25) == _naive_bounded(s, key, 1.25)

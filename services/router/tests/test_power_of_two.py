"""`power_of_two`: two random choices, the less loaded wins; sampling uses the set's indexes
(never a scan), on a seeded RNG."""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.router.features import RequestFeatures
from inferplane.router.policies import PowerOfTwo, default_registry
from inferplane.router.policies.power_of_two import nth_set_bit
from inferplane.router.replicas import INF, ReplicaSet

from .fakes import endpoints, replica_set, set_load

NONE = RequestFeatures()


def test_it_is_registered_by_name() -> None:
    assert "power_of_two" in default_registry().names
    assert isinstance(default_registry().create("power_of_two"), PowerOfTwo)


def test_with_two_replicas_the_less_loaded_one_is_chosen_every_time() -> None:
    s = replica_set(endpoints(2), cap=10)
    policy = PowerOfTwo(random.Random(1))
    set_load(s, 0, 3)
    set_load(s, 1, 1)
    assert {policy.choose(s, NONE) for _ in range(200)} == {1}
    set_load(s, 1, 5)
    assert {policy.choose(s, NONE) for _ in range(200)} == {0}


def test_ties_on_requests_go_to_fewer_queued_prompt_tokens() -> None:
    s = replica_set(endpoints(2), cap=10)
    set_load(s, 0, 2)
    set_load(s, 1, 2)
    s.states[0].queued_tokens = 8000  # a long prefill still ahead on replica 0
    s.states[0].changed(0.0)
    policy = PowerOfTwo(random.Random(2))
    assert {policy.choose(s, NONE) for _ in range(100)} == {1}


def test_a_replica_that_cannot_take_a_request_is_never_chosen() -> None:
    s = replica_set(endpoints(3), cap=2)
    policy = PowerOfTwo(random.Random(3))
    set_load(s, 0, 2)  # at its cap
    assert {policy.choose(s, NONE) for _ in range(200)} <= {1, 2}
    set_load(s, 1, 2)
    assert {policy.choose(s, NONE) for _ in range(50)} == {2}  # one left: no second choice
    set_load(s, 2, 2)
    assert policy.choose(s, NONE) is None


def test_the_choice_is_uniform_over_equally_loaded_replicas() -> None:
    s = replica_set(endpoints(20), cap=10)
    policy = PowerOfTwo(random.Random(4))
    counts = collections.Counter(policy.choose(s, NONE) for _ in range(20_000))
    assert set(counts) == set(range(20))
    assert max(counts.values()) < 1.2 * 1000 and min(counts.values()) > 0.8 * 1000


def test_sparse_sampling_is_uniform_over_the_free_replicas_too() -> None:
    """With few replicas under their cap the bit-set rank sampler draws; it stays uniform."""
    s = replica_set(endpoints(200), cap=1)
    free = {3, 50, 51, 130, 199}
    for i in range(200):
        if i not in free:
            set_load(s, i, 1)
    policy = PowerOfTwo(random.Random(5))
    counts = collections.Counter(policy._sample(s, None) for _ in range(10_000))
    assert set(counts) == free
    assert max(counts.values()) < 1.15 * 2000 and min(counts.values()) > 0.85 * 2000


def test_loads_stay_balanced_without_releases() -> None:
    """Balls into bins: 1,000 requests over 100 replicas end within a few of the mean
    (about log log n / log 2 above it; one random choice would reach about 2x)."""
    s = replica_set(endpoints(100), cap=1000)
    policy = PowerOfTwo(random.Random(6))
    for _ in range(1000):
        i = policy.choose(s, NONE)
        assert i is not None
        set_load(s, i, s.states[i].in_flight + 1)
    loads = [st.in_flight for st in s.states]
    assert max(loads) <= 10 + 5 and min(loads) >= 10 - 5


def test_fallbacks_are_the_least_loaded_others() -> None:
    s = replica_set(endpoints(4), cap=10)
    for i, load in enumerate((3, 0, 2, 1)):
        set_load(s, i, load)
    assert PowerOfTwo(random.Random(7)).fallbacks(s, NONE, 1, 2) == [3, 2]


def test_replicas_hidden_by_the_caller_are_not_chosen() -> None:
    """Admission hides the replicas a request already tried by setting their score to inf
    (their free bit stays set): sampling must skip them."""
    s = replica_set(endpoints(4), cap=10)
    policy = PowerOfTwo(random.Random(8))
    saved = list(s.scores)
    for i in (0, 1, 2):
        s.scores[i] = INF
    assert {policy.choose(s, NONE) for _ in range(100)} == {3}
    s.scores[3] = INF
    assert policy.choose(s, NONE) is None
    s.scores[:] = saved


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    draining=st.sets(st.integers(0, 79)),
    hidden=st.sets(st.integers(0, 79)),
    seed=st.integers(0, 2**32),
)
def test_property_never_a_replica_that_cannot_take(
    loads: list[int], draining: set[int], hidden: set[int], seed: int
) -> None:
    """Full, draining, or hidden by the caller (a tried replica: score inf, free bit still
    set): never chosen; None exactly when no replica can take the request."""
    eps = endpoints(len(loads), cap=4)
    eps = tuple(
        e if i not in draining else type(e)(e.address, e.replica_id, draining=True)
        for i, e in enumerate(eps)
    )
    s = replica_set(eps, cap=4)
    for i, load in enumerate(loads):
        set_load(s, i, load)
    for i in hidden:
        if i < s.n:
            s.scores[i] = INF
    policy = PowerOfTwo(random.Random(seed))
    takers = [i for i in range(s.n) if s.can_take(i)]
    for _ in range(5):
        chosen = policy.choose(s, NONE)
        if not takers:
            assert chosen is None
        else:
            assert chosen is not None and s.can_take(chosen)


@given(bits=st.integers(1, 2**300), data=st.data())
def test_property_nth_set_bit_matches_a_scan(bits: int, data: Any) -> None:
    positions = [i for i in range(bits.bit_length()) if bits >> i & 1]
    rank = data.draw(st.integers(0, len(positions) - 1))
    assert nth_set_bit(bits, rank) == positions[rank]


def test_nth_set_bit_refuses_a_rank_it_does_not_have() -> None:
    with pytest.raises(ValueError):
        nth_set_bit(0b101, 2)


class _CountingList(list):  # type: ignore[type-arg]
    """A list counting element reads (a scan of 10,000 replicas would read 10,000)."""

    reads = 0

    def __getitem__(self, i: Any) -> Any:
        _CountingList.reads += 1
        return super().__getitem__(i)


def _counted(s: ReplicaSet) -> None:
    for name in ("scores", "in_flight", "caps", "blocked", "draining"):
        setattr(s, name, _CountingList(getattr(s, name)))


@pytest.mark.parametrize("free", [10_000, 5_000, 300, 2])
def test_a_decision_at_10000_replicas_reads_a_few_entries_not_all(free: int) -> None:
    """Dense (index draws) and sparse (the bit set by rank) alike: a decision reads a bounded
    number of replica entries, not one per replica."""
    s = replica_set(endpoints(10_000), cap=2)
    rng = random.Random(9)
    full = rng.sample(range(10_000), 10_000 - free)
    for i in full:
        set_load(s, i, 2)
    for i in rng.sample(range(10_000), 1000):
        if s.can_take(i):
            set_load(s, i, 1)
    _counted(s)
    policy = PowerOfTwo(random.Random(10))
    _CountingList.reads = 0
    for _ in range(100):
        chosen = policy.choose(s, NONE)
        assert chosen is not None and s.scores[chosen] != INF
    assert _CountingList.reads <= 100 * 40  # ≤ 40 entries a decision (a scan: 10,000)

"""`FairQueue` on its own: order by weighted fair share, per-flow caps, and (property tests)
that no waiter is ever lost or served twice whatever mix of pushes, grants and departures."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferplane.router.fairqueue import FairQueue, Refusal, Ticket

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fill(q: FairQueue[str], flow: str, weight: float, n: int) -> None:
    for i in range(n):
        q.push(flow, weight, f"{flow}{i}")


def _pop_flows(q: FairQueue[str], n: int) -> str:
    return "".join(q.pop()[0] for _ in range(n))


def test_equal_weights_alternate_whatever_each_flow_offers() -> None:
    """Invariant: two waiting flows of equal weight are served in turn, so a flow that
    queued 100 requests first delays one that queued later by one request, not by 100."""
    q: FairQueue[str] = FairQueue(1000)
    _fill(q, "a", 1, 100)
    _fill(q, "b", 1, 3)
    assert _pop_flows(q, 7) == "ababab" + "a"


def test_grants_follow_the_weights_while_both_flows_wait() -> None:
    """Invariant (SFQ's fairness bound): while flows f and g both wait, their grants divided
    by their weights never differ by more than 1/w_f + 1/w_g."""
    q: FairQueue[str] = FairQueue(10_000)
    _fill(q, "p", 8, 900)
    _fill(q, "s", 1, 900)
    served = Counter(_pop_flows(q, 900))
    assert abs(served["p"] / 8 - served["s"]) <= 1 / 8 + 1
    assert served["s"] == 100  # 1 in 9


def test_a_flow_that_was_not_waiting_goes_next_and_a_heavier_one_wins_a_tie() -> None:
    """Invariant: a flow that starts waiting is granted after at most one request of each
    flow already waiting; at the same start the heavier flow goes first (tiers: a priority
    key overtakes queued standard requests)."""
    q: FairQueue[str] = FairQueue(1000)
    _fill(q, "a", 1, 50)
    assert _pop_flows(q, 10) == "a" * 10
    q.push("b", 1, "b0")
    assert _pop_flows(q, 2) in ("ab", "ba")
    q.push("p", 8, "p0")
    assert q.pop() == "p0"


def test_a_departure_costs_its_flow_nothing() -> None:
    """Invariant: a waiter that leaves without a grant (cancel, timeout) does not charge its
    flow: the flow's next request keeps its place."""
    q: FairQueue[str] = FairQueue(1000)
    _fill(q, "a", 1, 10)
    tickets = [q.push("b", 1, f"b{i}") for i in range(3)]
    assert q.discard(tickets[0]) and not q.discard(tickets[0])
    assert len(q) == 12 and q.flows == 2
    assert _pop_flows(q, 4) == "abab"
    assert q.drop() == "a2"  # the head leaves (its task was cancelled)
    assert _pop_flows(q, 2) == "aa"


def test_a_flow_over_its_share_of_the_queue_is_refused_and_a_newcomer_gets_in() -> None:
    """Invariant (dynamic thresholds, alpha = 1): a flow alone holds at most w/(1+w) of the
    queue; a flow with nothing queued is refused only when the whole queue is full."""
    q: FairQueue[str] = FairQueue(64)
    held = 0
    while q.refusal("a", 1) is None:
        q.push("a", 1, "a")
        held += 1
    assert held == 32 and q.refusal("a", 1) is Refusal.FLOW_SHARE
    assert q.refusal("b", 1) is None
    while q.refusal("b", 1) is None:
        q.push("b", 1, "b")
    assert len(q) == 48  # b stops at capacity - queued = its own length: 16
    for flow in "cdefghijklmnopqr":  # 16 one-request flows fill the rest
        assert q.refusal(flow, 1) is None
        q.push(flow, 1, flow)
    assert len(q) == 64 and q.refusal("s", 1) is Refusal.QUEUE_FULL


def test_memory_follows_the_waiting_flows_not_every_key_seen() -> None:
    """Invariant: flows without waiters are forgotten (at the latest when the queue
    empties), so 10,000 keys that each queued once leave nothing behind."""
    q: FairQueue[str] = FairQueue(100_000)
    _fill(q, "heavy", 1, 10)
    for i in range(10_000):  # a busy queue: the heavy flow keeps waiting
        q.push(f"k{i}", 1, f"k{i}")
        q.push("heavy", 1, "heavy")
        q.pop()
        q.pop()
        assert q.tracked_flows <= 3
    while len(q):
        q.pop()
    assert q.tracked_flows == 0 and q.flows == 0


def test_pop_and_drop_on_an_empty_queue_raise() -> None:
    q: FairQueue[str] = FairQueue(1)
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(IndexError):
        q.drop()
    with pytest.raises(ValueError):
        FairQueue(0)


# -- properties -------------------------------------------------------------------------------

FLOWS = st.sampled_from([("a", 1.0), ("b", 1.0), ("c", 8.0), ("", 1.0), ("", 0.5)])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), FLOWS),
        st.tuples(st.just("discard"), st.integers(0, 1 << 16)),
        st.tuples(st.just("pop"), st.none()),
        st.tuples(st.just("drop"), st.none()),
    ),
    max_size=120,
)


@SETTINGS
@given(OPS, st.integers(1, 12))
def test_no_waiter_is_lost_or_served_twice(ops: list[tuple[str, object]], capacity: int) -> None:
    """Invariant: every admitted waiter leaves exactly once (granted, dropped or discarded),
    FIFO inside its flow; `len` and `flows` always equal what is really queued; the caps
    hold (never more than the capacity, never a flow over its share when it joined)."""
    q: FairQueue[int] = FairQueue(capacity)
    ids = itertools.count()
    live: dict[int, tuple[tuple[str, float], Ticket[int]]] = {}
    order: list[int] = []  # admission order, to check FIFO per flow
    left: set[int] = set()
    for op, arg in ops:
        if op == "push":
            assert isinstance(arg, tuple)
            flow, weight = arg
            held = sum(1 for key, _ in live.values() if key == (flow, weight))
            refusal = q.refusal(flow, weight)
            if len(live) >= capacity:
                assert refusal is Refusal.QUEUE_FULL
            elif held >= weight * (capacity - len(live)):
                assert refusal is Refusal.FLOW_SHARE
            else:
                assert refusal is None
            if refusal is None:
                i = next(ids)
                live[i] = ((flow, weight), q.push(flow, weight, i))
                order.append(i)
        elif op == "discard" and live:
            assert isinstance(arg, int)
            i = sorted(live)[arg % len(live)]
            assert q.discard(live.pop(i)[1])
            left.add(i)
        elif op in ("pop", "drop"):
            if not live:
                assert q.head() is None
                continue
            head = q.head()
            i = q.pop() if op == "pop" else q.drop()
            assert i == head and i in live and i not in left
            key = live.pop(i)[0]
            earlier = [j for j in order if j < i and j in live and live[j][0] == key]
            assert not earlier  # FIFO inside a flow
            left.add(i)
        assert len(q) == len(live) <= capacity
        assert q.flows == len({key for key, _ in live.values()})
    while live:
        i = q.pop()
        assert i in live and i not in left
        live.pop(i)
        left.add(i)
    assert len(q) == 0 and q.flows == 0 and q.head() is None and q.tracked_flows == 0


@SETTINGS
@given(
    st.sampled_from([0.5, 1.0, 2.0, 8.0]),
    st.sampled_from([0.5, 1.0, 2.0, 8.0]),
    st.lists(st.booleans(), min_size=1, max_size=200),
)
def test_fairness_bound_holds_on_every_prefix(w_f: float, w_g: float, grants: list[bool]) -> None:
    """Invariant (SFQ, Goyal et al. 1996): while f and g both wait, after every grant
    |grants_f / w_f - grants_g / w_g| <= 1/w_f + 1/w_g; the booleans only decide how long
    each flow's backlog is topped up (both always wait)."""
    q: FairQueue[str] = FairQueue(10_000)
    _fill(q, "f", w_f, 2)
    _fill(q, "g", w_g, 2)
    served = Counter[str]()
    for top_up_f in grants:
        flow = q.pop()[0]
        served[flow] += 1
        q.push(flow, w_f if flow == "f" else w_g, flow)  # keep both backlogged
        if top_up_f:
            q.push("f", w_f, "f")
        assert abs(served["f"] / w_f - served["g"] / w_g) <= 1 / w_f + 1 / w_g + 1e-9

"""Per-key limits in the picker (`inferplane.router.keylimits`): one router's windows,
concurrency and budget on a fake clock, and several `KeyLimiter`s as several routers for the
bounds stated in services/router/README.md ("Per-key limits")."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.router.keylimits import (
    UNLIMITED,
    KeyLease,
    KeyLimiter,
    QuotaError,
    RequestsLimitError,
    TokensLimitError,
    share,
)
from inferplane.router.keys import KeyLimits, Principal
from inferplane.router.routes import RouteTable
from inferplane.router.sources import table_from_proto
from inferplane.runtime import ResourceExhaustedError
from inferplane.testing.clock import FakeClock

START = datetime(2026, 3, 10, 12, 0, 0, tzinfo=UTC)  # on a window boundary (epoch-aligned)


def _key(key_id: str = "k1", **limits: int) -> Principal:
    return Principal(key_id, "acme", ("inference",), (), "standard", KeyLimits(**limits))


def _routers(clock: FakeClock, n: int) -> list[KeyLimiter]:
    routers = [KeyLimiter(clock) for _ in range(n)]
    for rank, r in enumerate(routers):
        r.set_routers(n, rank)
    return routers


def _try(limiter: KeyLimiter, principal: Principal) -> KeyLease | None:
    try:
        return limiter.admit(principal, "r")
    except ResourceExhaustedError:
        return None


# -- shares ------------------------------------------------------------------------------------


@given(limit=st.integers(0, 500), count=st.integers(1, 40))
def test_shares_sum_to_the_limit_or_give_every_router_at_least_one(limit: int, count: int) -> None:
    parts = [share(limit, count, rank) for rank in range(count)]
    if limit == 0:
        assert parts == [0] * count
    else:
        assert min(parts) >= 1, "no router locks a key out"
        assert sum(parts) == max(limit, count)
        assert max(parts) - min(parts) <= 1


def test_one_router_or_none_enforces_the_whole_limit() -> None:
    assert share(7, 1, 0) == 7 and share(7, 0, 0) == 7
    limiter = KeyLimiter(FakeClock(START))
    limiter.on_table(RouteTable.of([], router_count=3, router_rank=2))
    assert limiter.routers == (3, 2)
    limiter.on_table(RouteTable.of([]))  # a table without a count (static, no shared caps)
    assert limiter.routers == (1, 0)
    assert limiter.shares(KeyLimits(10, 100, 3, 5000)) == KeyLimits(10, 100, 3, 5000)
    view = opb.WatchRoutingTableResponse(lease_epoch="e.1", router_count=4, router_rank=3)
    limiter.on_table(table_from_proto(view))  # the orchestrator's view for this router
    assert limiter.routers == (4, 3)
    assert limiter.shares(KeyLimits(10, 100, 3, 5000)) == KeyLimits(2, 25, 1, 5000)


# -- one router --------------------------------------------------------------------------------


def test_a_key_without_limits_shares_one_lease_and_leaves_no_state() -> None:
    limiter = KeyLimiter(FakeClock(START))
    for _ in range(3):
        lease = limiter.admit(_key(), "r")
        assert lease is UNLIMITED and lease.headers == ()
        lease.account(100)
        lease.release()
    assert limiter._states == {}


def test_requests_per_minute_refuse_until_the_aligned_window_resets() -> None:
    clock = FakeClock(START + timedelta(seconds=45))
    limiter = KeyLimiter(clock)
    key = _key(requests_per_minute=2)
    first = limiter.admit(key, "a")
    assert dict(first.headers) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "15s",
    }
    limiter.admit(key, "b")
    with pytest.raises(RequestsLimitError) as refused:
        limiter.admit(key, "c")
    error = refused.value
    assert (error.code, error.openai_type, error.http_status) == (
        "rate_limit_exceeded",
        "requests",
        429,
    )
    assert error.retry_after_seconds == 15
    assert dict(error.headers)["x-ratelimit-remaining-requests"] == "0"
    assert "Limit 2, Used 2" in error.message
    clock.advance(15)  # the next window (aligned like auth's: epoch // 60)
    assert dict(limiter.admit(key, "d").headers)["x-ratelimit-remaining-requests"] == "1"


def test_tokens_are_counted_after_the_fact_and_overshoot_by_what_was_in_flight() -> None:
    """Bound: a router's window exceeds its tokens share by at most the tokens of the
    requests it admitted before its count reached the share (those in flight then)."""
    clock = FakeClock(START)
    limiter = KeyLimiter(clock)
    key = _key(tokens_per_minute=1000)
    leases = [limiter.admit(key, str(i)) for i in range(3)]  # nothing counted yet: all admitted
    assert dict(leases[0].headers)["x-ratelimit-remaining-tokens"] == "1000"
    for lease in leases:
        lease.release()
        lease.account(700)  # after release, as when the replica's report comes late
    with pytest.raises(TokensLimitError) as refused:
        limiter.admit(key, "x")
    assert refused.value.openai_type == "tokens" and refused.value.retry_after_seconds == 60
    assert dict(refused.value.headers)["x-ratelimit-remaining-tokens"] == "0"
    counted = limiter._states["k1"].tokens
    assert counted == 2100 <= 1000 - 1 + 3 * 700, "share - 1 + the in-flight requests' tokens"
    clock.advance(60)
    limiter.admit(key, "y")


def test_concurrency_slots_free_on_release_once() -> None:
    limiter = KeyLimiter(FakeClock(START))
    key = _key(max_concurrent_requests=2)
    a, b = limiter.admit(key, "a"), limiter.admit(key, "b")
    assert a.headers == ()  # no x-ratelimit header for a concurrency limit (as auth)
    with pytest.raises(RequestsLimitError) as refused:
        limiter.admit(key, "c")
    assert refused.value.retry_after_seconds == 1
    a.release()
    a.release()  # idempotent: frees one slot only
    assert limiter.in_flight("k1") == 1
    c = limiter.admit(key, "c")
    with pytest.raises(RequestsLimitError):
        limiter.admit(key, "d")
    b.release()
    c.release()
    assert limiter.in_flight("k1") == 0


def test_idle_keys_are_forgotten_but_a_late_account_still_counts() -> None:
    clock = FakeClock(START)
    limiter = KeyLimiter(clock)
    key = _key(tokens_per_minute=100)
    lease = limiter.admit(key, "a")
    lease.release()
    clock.advance(60)
    limiter.admit(_key("k2", requests_per_minute=5), "b")  # a new window purges idle k1
    assert "k1" not in limiter._states
    lease.account(150)  # its tokens come after the purge: counted into the current window
    with pytest.raises(TokensLimitError):
        limiter.admit(key, "c")


# -- monthly budget ----------------------------------------------------------------------------


def test_a_spent_budget_is_insufficient_quota_until_it_resets() -> None:
    clock = FakeClock(START)
    limiter = KeyLimiter(clock)
    resets = datetime(2026, 4, 1, tzinfo=UTC)
    key = dataclasses.replace(
        _key(monthly_token_budget=1000), budget_exhausted=True, budget_resets=resets
    )
    with pytest.raises(QuotaError) as refused:
        limiter.admit(key, "a")
    error = refused.value
    assert (error.code, error.openai_type) == ("insufficient_quota", "insufficient_quota")
    assert error.retry_after_seconds == (resets - START).total_seconds()
    assert "resets at 2026-04-01T00:00:00Z" in error.message
    clock.advance((resets - START).total_seconds())  # the entry is of a month that ended
    limiter.admit(key, "b").release()


def test_budget_counts_the_entry_and_this_routers_tokens_since_it_arrived() -> None:
    clock = FakeClock(START)
    limiter = KeyLimiter(clock)
    entry = dataclasses.replace(_key(monthly_token_budget=1000), month_tokens=600)
    lease = limiter.admit(entry, "a")
    lease.account(300)
    lease.release()
    limiter.admit(entry, "b").account(100)  # 600 + 400 reaches the budget
    with pytest.raises(QuotaError) as refused:
        limiter.admit(entry, "c")
    assert "1000 were used" in refused.value.message
    assert (
        refused.value.retry_after_seconds
        == (datetime(2026, 4, 1, tzinfo=UTC) - START).total_seconds()
    )
    # auth's next entry includes what this router reported: counted once, not twice
    newer = dataclasses.replace(entry, month_tokens=900)
    limiter.admit(newer, "d").account(50)
    limiter.admit(newer, "e")
    newer_still = dataclasses.replace(entry, month_tokens=1000)
    with pytest.raises(QuotaError):
        limiter.admit(newer_still, "f")


# -- several routers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "routers"), [(10, 3), (2, 3), (1, 4), (60, 7)])
def test_requests_per_window_across_routers_sum_to_the_stated_bound(
    limit: int, routers: int
) -> None:
    """Bound: Σ shares = max(limit, N) per window, every router admits at least one."""
    clock = FakeClock(START)
    limiters = _routers(clock, routers)
    key = _key(requests_per_minute=limit)
    admitted = [0] * routers
    for i in range(10 * (limit + routers)):  # a client spreads its requests over the routers
        if _try(limiters[i % routers], key) is not None:
            admitted[i % routers] += 1
    assert sum(admitted) == max(limit, routers)
    assert min(admitted) >= 1


@pytest.mark.parametrize(("limit", "routers"), [(4, 2), (1, 3), (5, 3)])
def test_concurrency_across_routers_sums_to_the_stated_bound(limit: int, routers: int) -> None:
    clock = FakeClock(START)
    limiters = _routers(clock, routers)
    key = _key(max_concurrent_requests=limit)
    held = [lease for i in range(5 * limit) if (lease := _try(limiters[i % routers], key))]
    assert len(held) == max(limit, routers)
    held[0].release()
    assert sum(_try(r, key) is not None for r in limiters) == 1, "one slot freed, one admitted"


def test_a_router_joining_mid_window_admits_at_most_its_new_share_more() -> None:
    """Bound during the re-split: each router admits at most the largest share it had in
    the window, so one join adds at most the newcomer's share (here 10 + 5)."""
    clock = FakeClock(START)
    a, b = KeyLimiter(clock), KeyLimiter(clock)
    key = _key(requests_per_minute=10)
    assert sum(_try(a, key) is not None for _ in range(20)) == 10
    a.set_routers(2, 0)
    b.set_routers(2, 1)
    assert sum(_try(a, key) is not None for _ in range(20)) == 0, "a is over its new share"
    assert sum(_try(b, key) is not None for _ in range(20)) == 5
    clock.advance(60)
    assert sum(_try(r, key) is not None for r in (a, b) for _ in range(20)) == 10


def test_tokens_across_routers_overshoot_by_at_most_each_routers_in_flight_tokens() -> None:
    clock = FakeClock(START)
    limiters = _routers(clock, 2)
    key = _key(tokens_per_minute=1000)  # 500 per router
    in_flight = [[r.admit(key, str(i)) for i in range(2)] for r in limiters]
    for leases in in_flight:
        for lease in leases:
            lease.account(400)
    total = sum(r._states["k1"].tokens for r in limiters)
    bound = sum(share(1000, 2, rank) - 1 + 2 * 400 for rank in range(2))
    assert total == 1600 <= bound
    assert all(_try(r, key) is None for r in limiters)


def test_budget_across_routers_overshoots_by_the_others_tokens_until_the_next_entry() -> None:
    """Bound: a router sees auth's month_tokens plus its own tokens since that entry; the
    tokens other routers used meanwhile reach it only with auth's next entry."""
    clock = FakeClock(START)
    a, b = _routers(clock, 2)
    entry = dataclasses.replace(_key(monthly_token_budget=1000), month_tokens=0)
    used = {id(a): 0, id(b): 0}
    for i in range(100):  # 100-token requests, alternating routers, until both refuse
        router = (a, b)[i % 2]
        lease = _try(router, entry)
        if lease is not None:
            lease.account(100)
            lease.release()
            used[id(router)] += 100
    assert used == {id(a): 1000, id(b): 1000}, "each stops at the budget on its own count"
    total = sum(used.values())
    assert total == 1000 + used[id(b)], "overshoot = the other router's tokens since the entry"
    refreshed = dataclasses.replace(entry, month_tokens=500)  # auth counted part of it
    assert _try(a, refreshed) is not None, "a new entry replaces this router's own count"
    assert _try(a, dataclasses.replace(entry, month_tokens=total)) is None

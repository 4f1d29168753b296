"""Admission: per-replica caps, the deployment queue (timeout, priority), table swaps and
circuit breakers, on an injected clock and scheduler (no sleeps)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from inferplane.router.admission import AdmissionSettings
from inferplane.router.breaker import BreakerState, CircuitBreaker
from inferplane.router.features import TIER_WEIGHT, RequestFeatures
from inferplane.router.routes import RouteTable
from inferplane.runtime import ResourceExhaustedError, UnavailableError

from .fakes import admission, route

STANDARD = RequestFeatures()
PRIORITY = RequestFeatures(weight=TIER_WEIGHT["priority"])


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_caps_then_queue_then_grant_on_release() -> None:
    async def scenario() -> None:
        r = route(2, cap=1)
        a, _, _ = admission(RouteTable.of([r]))
        first = await a.acquire(r, STANDARD)
        second = await a.acquire(r, STANDARD)
        assert {first.key, second.key} == {e.key for e in r.endpoints}
        waiting = asyncio.ensure_future(a.acquire(r, STANDARD))
        await _settle()
        assert not waiting.done() and a.queue_length("d") == 1
        first.release()
        await _settle()
        third = waiting.result()
        assert third.key == first.key  # the freed slot
        second.release()
        third.release()
        assert a.replicas("d").total_in_flight == 0

    asyncio.run(scenario())


def test_queue_timeout_is_a_429_with_retry_after_never_a_5xx() -> None:
    async def scenario() -> None:
        r = route(1, cap=1)
        a, _, scheduler = admission(
            RouteTable.of([r]), AdmissionSettings(queue_timeout_seconds=5, retry_after_seconds=2)
        )
        held = await a.acquire(r, STANDARD)
        waiting = asyncio.ensure_future(a.acquire(r, STANDARD))
        await _settle()
        scheduler.advance(4.9)
        await _settle()
        assert not waiting.done()
        scheduler.advance(0.2)
        await _settle()
        error = waiting.exception()
        assert isinstance(error, ResourceExhaustedError)
        assert error.retry_after_seconds == 2 and error.code == "model_overloaded"
        held.release()
        assert a.queue_length("d") == 0

    asyncio.run(scenario())


def test_caller_deadline_shortens_the_queue_wait() -> None:
    async def scenario() -> None:
        r = route(1, cap=1)
        a, _, scheduler = admission(RouteTable.of([r]))
        await a.acquire(r, STANDARD)
        waiting = asyncio.ensure_future(a.acquire(r, STANDARD, timeout=1.0))
        await _settle()
        scheduler.advance(1.0)
        await _settle()
        assert isinstance(waiting.exception(), ResourceExhaustedError)

    asyncio.run(scenario())


def test_priority_tier_is_served_before_earlier_standard_requests() -> None:
    async def scenario() -> None:
        r = route(1, cap=1)
        a, _, _ = admission(RouteTable.of([r]))
        held = await a.acquire(r, STANDARD)
        order: list[str] = []

        async def wait(name: str, features: RequestFeatures) -> None:
            slot = await a.acquire(r, features)
            order.append(name)
            slot.release()

        tasks = [
            asyncio.ensure_future(wait("standard-1", STANDARD)),
            asyncio.ensure_future(wait("standard-2", STANDARD)),
        ]
        await _settle()
        tasks.append(asyncio.ensure_future(wait("priority", PRIORITY)))
        await _settle()
        held.release()
        await asyncio.gather(*tasks)
        assert order == ["priority", "standard-1", "standard-2"]

    asyncio.run(scenario())


def test_full_queue_answers_429_at_once() -> None:
    async def scenario() -> None:
        r = route(1, cap=1)
        a, _, _ = admission(RouteTable.of([r]), AdmissionSettings(max_queue_per_deployment=1))
        await a.acquire(r, STANDARD)
        queued = asyncio.ensure_future(a.acquire(r, STANDARD))
        await _settle()
        with pytest.raises(ResourceExhaustedError):
            await a.acquire(r, STANDARD)
        queued.cancel()

    asyncio.run(scenario())


def test_a_replica_that_leaves_the_table_gets_no_new_request_at_once() -> None:
    async def scenario() -> None:
        r = route(2)
        a, _, _ = admission(RouteTable.of([r]))
        gone = r.endpoints[0]
        in_flight = await a.acquire(r, STANDARD)
        assert in_flight.key == gone.key
        smaller = dataclasses.replace(r, endpoints=r.endpoints[1:])
        a.apply(RouteTable.of([smaller]))
        keys = set()
        for _ in range(5):
            slot = await a.acquire(smaller, STANDARD)
            keys.add(slot.key)
        assert keys == {r.endpoints[1].key}
        in_flight.release()  # the old request still finishes cleanly

    asyncio.run(scenario())


def test_new_replicas_in_a_table_swap_drain_the_queue() -> None:
    async def scenario() -> None:
        r = route(1, cap=1)
        a, _, _ = admission(RouteTable.of([r]))
        await a.acquire(r, STANDARD)
        waiting = asyncio.ensure_future(a.acquire(r, STANDARD))
        await _settle()
        a.apply(RouteTable.of([route(2, cap=1)]))
        await _settle()
        assert waiting.result().key == route(2).endpoints[1].key

    asyncio.run(scenario())


def test_draining_or_tried_replicas_only_is_unavailable_not_queued() -> None:
    async def scenario() -> None:
        r = route(2)
        a, _, _ = admission(RouteTable.of([r]))
        with pytest.raises(UnavailableError):
            await a.acquire(r, STANDARD, exclude=[e.key for e in r.endpoints])
        drained = dataclasses.replace(
            r, endpoints=tuple(dataclasses.replace(e, draining=True) for e in r.endpoints)
        )
        a.apply(RouteTable.of([drained]))
        with pytest.raises(UnavailableError):
            await a.acquire(drained, STANDARD)

    asyncio.run(scenario())


def test_breaker_opens_after_consecutive_failures_then_lets_one_probe_through() -> None:
    async def scenario() -> None:
        r = route(2)
        a, clock, _ = admission(
            RouteTable.of([r]), AdmissionSettings(breaker_failures=3, breaker_open_seconds=10)
        )
        bad = r.endpoints[0].key
        for _ in range(3):
            slot = await a.acquire(r, STANDARD, exclude=[r.endpoints[1].key])
            assert slot.key == bad
            slot.failed()
            slot.release()
        # Open: everything goes to the other replica, even when it is busier.
        slots = [await a.acquire(r, STANDARD) for _ in range(3)]
        assert {slot.key for slot in slots} == {r.endpoints[1].key}
        clock.advance(10)
        probe = await a.acquire(r, STANDARD)
        assert probe.key == bad  # half-open: one probe
        assert (await a.acquire(r, STANDARD)).key != bad  # no second one while it runs
        probe.first_chunk()  # the replica answered: closed again
        probe.release()
        assert (await a.acquire(r, STANDARD)).key == bad

    asyncio.run(scenario())


def test_breaker_state_machine() -> None:
    b = CircuitBreaker(failure_threshold=2, open_seconds=1, max_open_seconds=4)
    b.on_failure(0)
    assert b.state(0) is BreakerState.CLOSED
    b.on_failure(0)
    assert b.state(0.5) is BreakerState.OPEN and not b.available(0.5)
    assert b.state(1) is BreakerState.HALF_OPEN and b.available(1)
    b.on_start(1)
    assert not b.available(1)
    b.on_failure(1)  # failed probe: open twice as long
    assert b.state(2.9) is BreakerState.OPEN and b.state(3) is BreakerState.HALF_OPEN
    b.on_start(3)
    b.on_success()
    assert b.state(3) is BreakerState.CLOSED and b.available(3)

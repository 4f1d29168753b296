"""The routers' demand in the routing hub (`RoutingHub.renew(demand=...)`, `RoutingHub.demand`,
`autoscale.demand.DemandBook`): each router's latest report per deployment, summed and maxed
over routers; counters turned into rates and idle time; a router silent past its lease (plus
margin) drops out; a released router at once; a request held for a cold start wakes the
autoscaler."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.autoscale.demand import DemandBook, RouterDemand
from inferplane.orchestrator.routing import RoutingHub
from inferplane.testing.clock import FakeClock

LEASE = 10.0
MARGIN = 1.0


async def _watch(hub: RoutingHub, router_id: str) -> asyncio.Task[None]:
    async def follow() -> None:
        async for _ in hub.watch((), router_id):
            pass

    task = asyncio.create_task(follow())
    for _ in range(3):
        await asyncio.sleep(0)
    return task


def test_two_routers_are_aggregated_and_a_silent_one_drops_out() -> None:
    clock = FakeClock()
    hub = RoutingHub(clock=clock, lease_seconds=LEASE, lease_margin_seconds=MARGIN, epoch="e")
    woken: list[int] = []
    hub.on_cold_demand(lambda: woken.append(1))

    async def scenario() -> None:
        tasks = [await _watch(hub, "r1"), await _watch(hub, "r2")]
        r1 = RouterDemand(
            queued_requests=2, max_queue_wait_seconds=1.5, queue_rejections_total=10,
            in_flight_requests=5, engine_waiting_requests=1, kv_usage=0.4, requests_total=100,
        )  # fmt: skip
        r2 = RouterDemand(
            queued_requests=1, max_queue_wait_seconds=3.0, queue_rejections_total=0,
            in_flight_requests=3, engine_waiting_requests=2, kv_usage=0.7, requests_total=50,
        )  # fmt: skip
        hub.renew("r1", "", "", demand=[("d", r1), ("other", RouterDemand())])
        hub.renew("r2", "", "", demand=[("d", r2)])
        agg = hub.demand("d")
        assert (agg.routers, agg.queued_requests, agg.in_flight_requests) == (2, 3, 8)
        assert agg.engine_waiting_requests == 3
        assert agg.max_queue_wait_seconds == 3.0 and agg.kv_usage == 0.7
        assert agg.queue_rejections_per_second == 0.0  # one report: no rate yet
        assert agg.idle_seconds == 0.0
        # r1 again 5 s later: 10 more 429s -> 2/s; r2 silent from now on.
        clock.advance(5)
        later = RouterDemand(queue_rejections_total=20, in_flight_requests=1, requests_total=130)
        hub.renew("r1", "", "", demand=[("d", later)])
        agg = hub.demand("d")
        assert agg.queue_rejections_per_second == pytest.approx(2.0)
        assert (agg.routers, agg.in_flight_requests) == (2, 4)
        # Past r2's lease + margin since its report (11 s): only r1 counts.
        clock.advance(LEASE + MARGIN - 5 + 0.1)
        hub.renew("r1", "", "", demand=[("d", later)])
        agg = hub.demand("d")
        assert (agg.routers, agg.in_flight_requests, agg.kv_usage) == (1, 1, 0.0)
        assert woken == []
        # Nothing moves any more: idle counts from the last report with activity.
        quiet = RouterDemand(queue_rejections_total=20, requests_total=130)
        hub.renew("r1", "", "", demand=[("d", quiet)])
        clock.advance(7)
        hub.renew("r1", "", "", demand=[("d", quiet)])
        assert hub.demand("d").idle_seconds == pytest.approx(7.0)
        # A request held for a cold start: the autoscaler is woken.
        hub.renew("r1", "", "", demand=[("d", RouterDemand(cold_waiting_requests=1,
                                                           requests_total=131))])  # fmt: skip
        assert woken == [1]
        assert hub.demand("d").cold_waiting_requests == 1
        assert hub.demand("d").idle_seconds == 0.0
        # A router that releases its lease is dropped at once.
        hub.renew("r1", "", "", release=True)
        assert hub.demand("d").routers == 0
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


def test_idle_counts_from_first_sight_and_a_restarted_router_counts_no_negative_rate() -> None:
    clock = FakeClock()
    book = DemandBook(clock=clock, stale_after_seconds=11)
    assert book.aggregate("d").idle_seconds == 0.0
    clock.advance(30)
    assert book.aggregate("d").idle_seconds == 30.0  # no router ever reported a request
    book.record("r", [("d", RouterDemand(queue_rejections_total=50, requests_total=9))])
    clock.advance(2)
    assert book.aggregate("d").idle_seconds == 2.0  # a first report with requests: activity
    book.record("r", [("d", RouterDemand(queue_rejections_total=3, requests_total=1))])
    assert book.aggregate("d").queue_rejections_per_second == 0.0  # a counter reset
    with pytest.raises(ValueError):
        DemandBook(clock=clock, stale_after_seconds=0)


def test_renewal_demand_from_the_proto() -> None:
    from inferplane.orchestrator.convert import demand_from_proto

    message = pb.DeploymentDemand(
        deployment="d", queued_requests=1, max_queue_wait_seconds=0.5, queue_rejections_total=2,
        in_flight_requests=3, engine_waiting_requests=4, kv_usage=0.25, cold_waiting_requests=5,
        requests_total=6,
    )  # fmt: skip
    assert demand_from_proto(message) == RouterDemand(1, 0.5, 2, 3, 4, 0.25, 5, 6)

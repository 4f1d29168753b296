"""Shared caps (issue 20), the router's side: it admits at most its share of a replica's cap,
only while it holds a lease, reports shares it is still above, and gives them back on stop.

Two routers (each its own admission, routing-table watch and lease keeper, as `build_app`
wires them) follow a small fake RoutingService over real gRPC on loopback, which plays the
orchestrator's decisions as each test scripts them (the splitting itself is tested on the
orchestrator: services/orchestrator/tests/test_routing_shares.py; both together:
tests/integration/test_shared_caps.py). Time is a FakeClock per router (no sleeps).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.router.admission import Admission, AdmissionSettings, Slot
from inferplane.router.app import build_app
from inferplane.router.features import RequestFeatures
from inferplane.router.leases import CapLease
from inferplane.router.policies import default_registry
from inferplane.router.routes import ModelRoute
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import OrchestratorRouteSource
from inferplane.runtime import ResourceExhaustedError
from inferplane.testing.clock import FakeClock

from .fakes import FakeScheduler

ADDRESS = "10.0.0.1:9000"
REPLICA = (ADDRESS, "r0")
LEASE = 10.0
REQUEST = RequestFeatures()


def _table(cap: int, share: int, epoch: str = "e.1", version: str = "") -> Any:
    return opb.WatchRoutingTableResponse(
        version=version or f"cap{cap}-share{share}-{epoch}",
        lease_epoch=epoch,
        routes=[
            opb.ModelRoute(
                model="m",
                deployment="d",
                routing_policy="least_load",
                endpoints=[
                    opb.RouteEndpoint(
                        replica_id="r0",
                        address=ADDRESS,
                        max_concurrency=cap,
                        max_concurrency_share=share,
                    )
                ],
            )
        ],
    )


class FakeOrchestrator(orchestrator_pb2_grpc.RoutingServiceServicer):  # type: ignore[misc]
    """Sends each router the tables the test pushes (`send`) and answers renewals with
    `lease_seconds` and `hold_seconds` (or `refuse` as the status code)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.watches: list[Any] = []
        self.renewals: dict[str, list[Any]] = {}
        self.lease_seconds = LEASE
        self.hold_seconds = 0.0
        self.refuse: grpc.StatusCode | None = None

    def _queue(self, router_id: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault(router_id, asyncio.Queue())

    def send(self, router_id: str, table: Any) -> None:
        self._queue(router_id).put_nowait(table)

    async def WatchRoutingTable(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.watches.append(request)
        queue = self._queue(request.router_id)
        while True:
            yield await queue.get()

    async def RenewRouterLease(self, request: Any, context: Any) -> Any:
        self.renewals.setdefault(request.router_id, []).append(request)
        if self.refuse is not None:
            await context.abort(self.refuse, "refused by the test")
        return opb.RenewRouterLeaseResponse(
            lease_seconds=self.lease_seconds, hold_seconds=self.hold_seconds
        )


class Router:
    """One router: admission + the orchestrator's watch (with its id) + the lease keeper."""

    def __init__(self, address: str, router_id: str) -> None:
        self.clock = FakeClock()
        self.scheduler = FakeScheduler(self.clock)
        self.admission = Admission(
            default_registry(),
            AdmissionSettings(queue_timeout_seconds=5.0, retry_after_seconds=1.0),
            self.clock,
            self.scheduler,
        )
        self.source = OrchestratorRouteSource(address, router_id=router_id)
        self.lease = CapLease(address, router_id, self.admission, self.clock)
        self.source.subscribe(self.admission.apply)
        self.source.subscribe(self.lease.on_table)

    @property
    def route(self) -> ModelRoute:
        route = self.source.current().get("m")
        assert route is not None
        return route

    def in_flight(self) -> int:
        replicas = self.admission.replicas("d")
        return 0 if replicas is None else replicas.total_in_flight

    async def receive(self, version: str) -> None:
        await _wait_for(lambda: self.source.current().version == version, version)

    def acquire(self) -> asyncio.Future[Slot]:
        return asyncio.ensure_future(self.admission.acquire(self.route, REQUEST))

    async def stop(self) -> None:
        await self.lease.stop()
        await self.source.stop()


async def _wait_for(predicate: Any, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _rig() -> tuple[FakeOrchestrator, grpc.aio.Server, str]:
    fake = FakeOrchestrator()
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return fake, server, f"127.0.0.1:{port}"


def test_two_routers_at_a_replicas_cap_queue_their_extra_requests() -> None:
    """Invariant: two routers never have more requests in flight to a replica together than
    its cap; each admits its share, and its extra requests wait in its queue (429 after the
    queue timeout, the existing rule) instead of going to the full replica."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        a, b = Router(address, "a"), Router(address, "b")
        try:
            for r in (a, b):
                await r.source.start()
                fake.send(r.lease.router_id, _table(cap=4, share=2))
                await r.receive("cap4-share2-e.1")
                assert await r.lease.renew()
            held = [await a.acquire(), await a.acquire(), await b.acquire(), await b.acquire()]
            extra_a, extra_b = a.acquire(), b.acquire()
            await _settle()
            assert not extra_a.done() and not extra_b.done()
            assert a.in_flight() + b.in_flight() == 4
            held[0].release()  # a's own slot frees: a's queued request takes it
            await _settle()
            assert extra_a.done() and not extra_b.done()
            assert a.in_flight() + b.in_flight() == 4
            b.scheduler.advance(5.0)
            await _settle()
            assert isinstance(extra_b.exception(), ResourceExhaustedError)
            assert a.in_flight() + b.in_flight() == 4
        finally:
            for r in (a, b):
                await r.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_newcomer_waits_until_the_first_router_reports_it_fits_its_smaller_share() -> None:
    """Invariant: when a router's share shrinks below what it has in flight, it admits no
    more there and reports the replica (`over_share`) on every renewal until enough of its
    requests ended; it renews at once when they did, so the orchestrator can hand the room
    to the other router, whose queued requests then go at once."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        a, b = Router(address, "a"), Router(address, "b")
        try:
            await a.source.start()
            fake.send("a", _table(cap=2, share=2))
            await a.receive("cap2-share2-e.1")
            await a.lease.start()  # the keeper's loop: renews now and on every change
            await _wait_for(lambda: a.admission.lease_valid(), "a's lease")
            first, second = await a.acquire(), await a.acquire()
            # b joins: the orchestrator shrinks a's share and gives b nothing yet.
            fake.send("a", _table(cap=2, share=1))
            await a.receive("cap2-share1-e.1")
            await _wait_for(lambda: len(fake.renewals["a"]) >= 2, "a's acknowledgement")
            assert list(fake.renewals["a"][-1].over_share) == [
                opb.ReplicaRef(address=ADDRESS, replica_id="r0")
            ]
            await b.source.start()
            fake.send("b", _table(cap=2, share=0))
            await b.receive("cap2-share0-e.1")
            assert await b.lease.renew()
            waiting = b.acquire()
            more_a = a.acquire()
            await _settle()
            assert not waiting.done() and not more_a.done()
            renewed = len(fake.renewals["a"])
            first.release()  # a fits its share of 1 again: it says so at once
            await _wait_for(lambda: len(fake.renewals["a"]) > renewed, "a's drained renewal")
            assert not fake.renewals["a"][-1].over_share
            assert not more_a.done(), "a's freed slot is not its to reuse"
            fake.send("b", _table(cap=2, share=1))
            await b.receive("cap2-share1-e.1")
            await _settle()
            assert waiting.done() and waiting.result().key == REPLICA
            assert a.in_flight() + b.in_flight() == 2
            second.release()
            await _settle()
            assert more_a.done()
        finally:
            for r in (a, b):
                await r.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_without_a_lease_nothing_new_is_admitted() -> None:
    """Invariant: shares are admitted on only under a lease: before the first renewal, after
    the lease ran out (lease seconds after the renewal was sent, the orchestrator granting no
    hold) or under a table of a new epoch once the last lease ended, requests wait; a
    renewal lets them go at once."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        a = Router(address, "a")
        try:
            await a.source.start()
            fake.send("a", _table(cap=4, share=4))
            await a.receive("cap4-share4-e.1")
            early = a.acquire()
            await _settle()
            assert not early.done() and a.admission.lease_valid() is False
            assert await a.lease.renew()
            await _settle()
            assert early.done()
            a.clock.advance(LEASE - 0.01)
            assert (await a.acquire()).key == REPLICA
            a.clock.advance(0.01)  # the lease ran out: nothing new, the running ones run on
            late = a.acquire()
            await _settle()
            assert not late.done() and a.in_flight() == 2
            fake.refuse = grpc.StatusCode.UNAVAILABLE  # the orchestrator is away
            assert not await a.lease.renew()
            await _settle()
            assert not late.done()
            fake.refuse = None
            assert await a.lease.renew()
            await _settle()
            assert late.done()
            fake.send("a", _table(cap=4, share=4, epoch="e.2"))  # the orchestrator restarted
            await a.receive("cap4-share4-e.2")
            fresh = a.acquire()  # before e.2's lease: on e.1's shares while that lease lasts
            await _settle()
            assert fresh.done()
            fresh.result().release()
            a.clock.advance(LEASE)  # e.1's lease ended (no hold): nothing new
            later = a.acquire()
            await _settle()
            assert not later.done()
            assert fake.renewals["a"][-1].lease_epoch == "e.1"
            assert await a.lease.renew()
            await _settle()
            assert later.done() and fake.renewals["a"][-1].lease_epoch == "e.2"
        finally:
            await a.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_replica_without_a_cap_is_not_shared() -> None:
    """A table entry with max_concurrency 0 (the router's own default applies) carries no
    share to enforce: the router admits up to its default there, under its lease."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        a = Router(address, "a")
        try:
            await a.source.start()
            fake.send("a", _table(cap=0, share=0))
            await a.receive("cap0-share0-e.1")
            assert await a.lease.renew()
            assert a.admission.share(REPLICA) is None
            for _ in range(3):
                await a.acquire()
            assert a.in_flight() == 3 and not fake.renewals["a"][-1].over_share
        finally:
            await a.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_stopping_gives_the_shares_back_naming_what_still_runs() -> None:
    async def scenario() -> None:
        fake, server, address = await _rig()
        a = Router(address, "a")
        try:
            await a.source.start()
            fake.send("a", _table(cap=4, share=4))
            await a.receive("cap4-share4-e.1")
            assert await a.lease.renew()
            await a.acquire()
            await a.lease.stop()
            last = fake.renewals["a"][-1]
            assert last.release and [r.replica_id for r in last.over_share] == ["r0"]
            assert a.admission.lease_valid() is False
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(a.acquire(), 0.05)
        finally:
            await a.source.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_the_router_app_asks_for_its_shares_and_keeps_its_lease() -> None:
    """The composition root: with an orchestrator address (and shared caps, the default) the
    watch names this router and the lease keeper renews; turned off, neither happens."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        try:
            shared = build_app(
                RouterSettings(
                    host="127.0.0.1", port=0, orchestrator_address=address, router_id="r1"
                )
            )
            await shared.start()
            await _wait_for(lambda: "r1" in fake.renewals, "a renewal from r1")
            await shared.stop()
            assert [w.router_id for w in fake.watches] == ["r1"]
            assert fake.renewals["r1"][-1].release
            alone = build_app(
                RouterSettings(
                    host="127.0.0.1", port=0, orchestrator_address=address, shared_caps=False
                )
            )
            await alone.start()
            await _wait_for(lambda: len(fake.watches) == 2, "the second watch")
            await alone.stop()
            assert fake.watches[1].router_id == "" and set(fake.renewals) == {"r1"}
        finally:
            await server.stop(0)

    asyncio.run(scenario())

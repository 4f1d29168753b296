"""Shared caps (issue 20) with the real parts: the orchestrator's `RoutingService` and
`RoutingHub`, and two routers (admission, routing-table watch with their ids, lease keepers)
over real gRPC on loopback. One replica at its cap of 4.

Invariant: the two routers never have more than 4 requests in flight to the replica between
them: a router that joins while the other holds the whole cap queues until the first one's
requests ended down to its new share; when a router goes away, its share returns to the
other after the bound (lease + margin after its last renewal), not before, and the other's
queued requests then go. Time: a FakeClock for the hub and one per router, moved together.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.orchestrator.leadership import GrantsJournal, LeaderLease
from inferplane.orchestrator.routing import RoutingHub, make_table
from inferplane.orchestrator.servicer import RoutingService
from inferplane.orchestrator.store.lease import SqlLeaseStore, SqlRouterGrants
from inferplane.router.admission import Admission, AdmissionSettings, Slot
from inferplane.router.features import RequestFeatures
from inferplane.router.leases import CapLease
from inferplane.router.policies import default_registry
from inferplane.router.sources import OrchestratorRouteSource
from inferplane.runtime import ErrorInterceptor
from inferplane.testing.clock import FakeClock

LEASE = 10.0
MARGIN = 1.0
CAP = 4


class _Timer:
    def cancel(self) -> None:
        pass


class _NoTimeouts:
    """Queue timers that never fire: these requests wait as long as the test needs."""

    def call_later(self, delay: float, callback: Any) -> _Timer:
        return _Timer()


class Router:
    def __init__(self, address: str, router_id: str, clock: FakeClock) -> None:
        self.admission = Admission(default_registry(), AdmissionSettings(), clock, _NoTimeouts())
        self.source = OrchestratorRouteSource(address, router_id=router_id)
        self.lease = CapLease(lambda: self.source.address, router_id, self.admission, clock)
        self.source.subscribe(self.admission.apply)
        self.source.subscribe(self.lease.on_table)
        self.router_id = router_id

    def share(self) -> int | None:
        return self.admission.share(("10.0.0.1:9000", "r0"))

    def in_flight(self) -> int:
        replicas = self.admission.replicas("m")
        return 0 if replicas is None else replicas.total_in_flight

    def acquire(self) -> asyncio.Future[Slot]:
        route = self.source.current().get("m")
        assert route is not None
        return asyncio.ensure_future(self.admission.acquire(route, RequestFeatures()))


def _one_replica_table() -> pb.WatchRoutingTableResponse:
    """Model "m" on one replica, r0, whose cap is CAP."""
    return make_table(
        [
            pb.ModelRoute(
                model="m",
                deployment="m",
                routing_policy="least_load",
                endpoints=[
                    pb.RouteEndpoint(replica_id="r0", address="10.0.0.1:9000", max_concurrency=CAP)
                ],
            )
        ]
    )


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


async def _serve(hub: RoutingHub) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(RoutingService(hub), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _round(*routers: Router) -> None:
    """Every router renews (acknowledging its table), then the tables this caused arrive."""
    for _ in range(3):
        for r in routers:
            await r.lease.renew()
        await _settle()


def test_two_routers_share_a_replicas_cap_and_a_gone_routers_share_returns_after_the_bound() -> (
    None
):
    async def scenario() -> None:
        hub_clock = FakeClock()
        hub = RoutingHub(
            clock=hub_clock, lease_seconds=LEASE, lease_margin_seconds=MARGIN, hold_seconds=0
        )
        table = _one_replica_table()
        await hub.publish(table)
        hub_clock.advance(LEASE + MARGIN)  # the start-up wait is over
        server, address = await _serve(hub)
        clocks = [hub_clock, FakeClock(), FakeClock()]
        a = Router(address, "router-a", clocks[1])
        b = Router(address, "router-b", clocks[2])
        seen_total: list[int] = []

        def total() -> int:
            seen_total.append(a.in_flight() + b.in_flight())
            return seen_total[-1]

        async def advance(seconds: float, *renewing: Router) -> None:
            for clock in clocks:
                clock.advance(seconds)
            hub.expire_leases()
            await _round(*renewing)

        try:
            await a.source.start()
            await _settle()
            await _round(a)
            assert a.share() == CAP
            held = [await a.acquire() for _ in range(CAP)]
            assert total() == CAP
            # b joins: a's share shrinks to 2, b gets nothing while a still has 4 in flight.
            await b.source.start()
            await _settle()
            await _round(a, b)
            assert (a.share(), b.share()) == (2, 0)
            waiting_b = [b.acquire(), b.acquire()]
            await _settle()
            assert not any(f.done() for f in waiting_b) and total() == CAP
            held.pop().release()
            await _round(a, b)
            assert b.share() == 0 and total() == CAP - 1  # a is still over its share
            held.pop().release()
            await _round(a, b)
            assert (a.share(), b.share()) == (2, 2)
            assert all(f.done() for f in waiting_b) and total() == CAP
            # a goes away (crash or cut off: no release, no renewals); its requests end.
            await a.source.stop()
            for slot in held:
                slot.release()
            more_b = [b.acquire(), b.acquire()]
            await _settle()
            for _ in range(int(LEASE)):
                await advance(1.0, b)
                assert b.share() == 2 and not any(f.done() for f in more_b), "too early"
            await advance(MARGIN + 0.01, b)
            assert b.share() == CAP
            assert all(f.done() for f in more_b) and total() == CAP
            assert max(seen_total) <= CAP
        finally:
            for r in (a, b):
                await r.lease.stop()
                await r.source.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_restarted_orchestrator_adopts_the_grants_and_routers_keep_admitting(
    tmp_path: Any,
) -> None:
    """Hand-over (`inferplane.orchestrator.routing`) with the real lease, journal and routers:
    the orchestrator dies with both routers at their shares; the one that leads next (the same
    id restarted, term 2) adopts what term 1 wrote, so the routers, reconnected, are admitting
    again on their shares before the old leases could have ended, and never more than the cap
    between them."""

    async def scenario() -> None:
        store = SqlLeaseStore(f"sqlite:///{tmp_path}/orchestrator.db")
        store.create_schema()
        table = _one_replica_table()

        def leader(clock: FakeClock) -> tuple[RoutingHub, GrantsJournal]:
            lease = LeaderLease(
                store,
                holder="orch-1",
                duration_seconds=10,
                renew_interval_seconds=3,
                clock=FakeClock(),  # held throughout: the hub's clock moves on its own
            )
            assert lease.try_acquire()
            journal = GrantsJournal(
                SqlRouterGrants(store.database, fence=lease), lease, clock=clock
            )
            hub = RoutingHub(
                clock=clock,
                lease_seconds=LEASE,
                lease_margin_seconds=MARGIN,
                hold_seconds=0,
                journal=journal,
            )
            return hub, journal

        hub_clock = FakeClock()
        hub, _ = leader(hub_clock)
        await hub.publish(table)
        hub_clock.advance(LEASE + MARGIN)  # a first start: it waits out the leases
        server, address = await _serve(hub)
        clocks = [hub_clock, FakeClock(), FakeClock()]
        a = Router(address, "router-a", clocks[1])
        b = Router(address, "router-b", clocks[2])
        port = address.rsplit(":", 1)[1]
        try:
            for r in (a, b):
                await r.source.start()
            await _settle()
            await _round(a, b)
            assert (a.share(), b.share()) == (2, 2)
            held = [await a.acquire() for _ in range(2)] + [await b.acquire() for _ in range(2)]
            await _settle()

            old_epochs = {r.admission.table.lease_epoch for r in (a, b) if r.admission.table}
            await server.stop(0)  # the orchestrator dies; the next one leads (term 2)
            hub2, journal2 = leader(hub_clock)
            await hub2.publish(table)
            adopted = await journal2.adoptable()
            assert adopted == {
                "router-a": {("10.0.0.1:9000", "r0"): 2},
                "router-b": {("10.0.0.1:9000", "r0"): 2},
            }
            hub2.set_granting(True, adopted=adopted)
            server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
            orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(RoutingService(hub2), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            for _ in range(100):  # the routers reconnect (their backoff) and renew
                await _round(a, b)
                if all(
                    r.admission.table is not None
                    and r.admission.table.lease_epoch not in old_epochs
                    and r.admission.lease_valid()
                    for r in (a, b)
                ):
                    break
            assert (a.share(), b.share()) == (2, 2)
            # No clock moved: the old leases could all still run, yet the routers admit.
            held.pop().release()  # one of b's
            again = b.acquire()
            await _settle()
            assert again.done() and a.in_flight() + b.in_flight() == CAP
            extra = a.acquire()
            await _settle()
            assert not extra.done()  # a is at its share
            extra.cancel()
        finally:
            for r in (a, b):
                await r.lease.stop()
                await r.source.stop()
            await server.stop(0)
            store.close()

    asyncio.run(scenario())


def test_a_router_follows_the_leader_and_keeps_admitting_through_a_failover(tmp_path: Any) -> None:
    """Two orchestrators on one database: a router that lists both (the standby first) settles
    on the leader and admits on its share; when the other takes over (term 2, adopting the
    grants term 1 wrote) and the first stands by, the router's watch and lease move to the
    new leader, which grants the share at once (no wait for the old lease to end)."""

    async def scenario() -> None:
        store = SqlLeaseStore(f"sqlite:///{tmp_path}/orchestrator.db")
        store.create_schema()
        lease_clocks = [FakeClock(), FakeClock()]
        leases = [
            LeaderLease(
                store,
                holder=f"orch-{i + 1}",
                duration_seconds=10,
                renew_interval_seconds=3,
                clock=lease_clocks[i],
            )
            for i in range(2)
        ]
        journals = [
            GrantsJournal(
                SqlRouterGrants(store.database, fence=lease), lease, clock=lease_clocks[i]
            )
            for i, lease in enumerate(leases)
        ]
        hub_clock = FakeClock()
        hubs = [
            RoutingHub(
                clock=hub_clock,
                lease_seconds=LEASE,
                lease_margin_seconds=MARGIN,
                hold_seconds=0,
                journal=j,
            )
            for j in journals
        ]
        table = _one_replica_table()
        assert leases[0].try_acquire() and not leases[1].try_acquire()
        hubs[1].set_granting(False)  # orch-2 stands by
        for hub in hubs:
            await hub.publish(table)
        hub_clock.advance(LEASE + MARGIN)  # orch-1's first start: it waited out the leases
        served = [await _serve(hub) for hub in hubs]
        a = Router(f"{served[1][1]},{served[0][1]}", "router-a", FakeClock())

        async def settled_on(hub: int, share: int) -> bool:
            for _ in range(200):
                await _round(a)
                if (
                    a.source.address == served[hub][1]
                    and a.share() == share
                    and a.admission.lease_valid()
                ):
                    return True
            return False

        try:
            await a.source.start()
            assert await settled_on(0, CAP), (a.source.address, a.share())
            held = [await a.acquire() for _ in range(2)]
            # orch-1 stops renewing; orch-2 takes over and adopts what term 1 granted.
            lease_clocks[1].advance(10)
            assert leases[1].try_acquire() and leases[1].term() == 2
            hubs[1].set_granting(True, adopted=await journals[1].adoptable())
            hubs[0].set_granting(False)  # orch-1 notices it was deposed
            assert await settled_on(1, CAP), (a.source.address, a.share())
            more = [a.acquire(), a.acquire()]  # no clock moved: admitted on the adopted share
            await _settle()
            assert all(f.done() for f in more) and a.in_flight() == CAP
            extra = a.acquire()
            await _settle()
            assert not extra.done()
            extra.cancel()
            del held
        finally:
            await a.lease.stop()
            await a.source.stop()
            for server, _ in served:
                await server.stop(0)
            store.close()

    asyncio.run(scenario())

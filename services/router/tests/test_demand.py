"""Demand in lease renewals (issue 29): every `RenewRouterLease` carries one
`DeploymentDemand` per deployment of the router's table (admission's queue, waits, 429s,
requests in flight and received, cold holds; the engines' waiting requests and KV usage from
`EngineStates`), and a request held for a deployment at zero renews at once.

A router (admission + routing-table watch + lease keeper, as `build_app` wires them) follows
the small fake RoutingService of `test_shared_caps.py` over real gRPC on loopback; admission
runs on a FakeClock (no sleeps but the gRPC round trips)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.router.admission import Admission, AdmissionSettings, Slot
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.leases import CapLease
from inferplane.router.policies import default_registry
from inferplane.router.routes import ModelRoute
from inferplane.router.sources import OrchestratorRouteSource
from inferplane.runtime import ResourceExhaustedError
from inferplane.testing.clock import FakeClock

from .fakes import FakeScheduler
from .test_shared_caps import FakeOrchestrator, _rig, _settle, _wait_for

pytestmark = pytest.mark.timeout(30)


def _table(version: str, *, z_replicas: int = 0) -> Any:
    """Deployment "d" (two replicas, cap 1 each, this router's share 1) and "z", which
    scales to zero (no replica, or `z_replicas`)."""
    d = opb.ModelRoute(
        model="d",
        deployment="d",
        endpoints=[
            opb.RouteEndpoint(
                replica_id=f"d{i}",
                address=f"10.0.0.{i}:9000",
                max_concurrency=1,
                max_concurrency_share=1,
            )
            for i in range(2)
        ],
    )
    z = opb.ModelRoute(
        model="z",
        deployment="z",
        scale_to_zero=True,
        cold_start_budget_seconds=60,
        endpoints=[
            opb.RouteEndpoint(
                replica_id=f"z{i}",
                address=f"10.0.1.{i}:9000",
                max_concurrency=4,
                max_concurrency_share=4,
            )
            for i in range(z_replicas)
        ],
    )
    alias = opb.ModelRoute()
    alias.CopyFrom(d)
    alias.model = "d-alias"  # an alias: the same deployment, reported once
    return opb.WatchRoutingTableResponse(version=version, lease_epoch="e.1", routes=[d, alias, z])


class Router:
    def __init__(self, address: str) -> None:
        self.clock = FakeClock()
        self.scheduler = FakeScheduler(self.clock)
        self.admission = Admission(
            default_registry(),
            AdmissionSettings(queue_timeout_seconds=5.0),
            self.clock,
            self.scheduler,
        )
        self.engines = EngineStates(self.clock.monotonic, stale_after_seconds=3.0)
        self.source = OrchestratorRouteSource(address, router_id="a")
        self.lease = CapLease(address, "a", self.admission, self.clock, engine_states=self.engines)
        self.source.subscribe(self.admission.apply)
        self.source.subscribe(self.lease.on_table)

    def acquire(self, model: str) -> asyncio.Future[Slot]:
        route = self.source.current().get(model)
        assert isinstance(route, ModelRoute)
        return asyncio.ensure_future(self.admission.acquire(route, RequestFeatures()))

    async def receive(self, version: str) -> None:
        await _wait_for(lambda: self.source.current().version == version, version)

    async def stop(self) -> None:
        await self.lease.stop()
        await self.source.stop()


def _demand(renewal: Any) -> dict[str, Any]:
    return {d.deployment: d for d in renewal.demand}


def test_a_renewal_carries_each_deployments_demand() -> None:
    async def scenario() -> None:
        fake, server, address = await _rig()
        r = Router(address)
        try:
            await r.source.start()
            fake.send("a", _table("t1"))
            await r.receive("t1")
            assert await r.lease.renew()
            quiet = _demand(fake.renewals["a"][-1])
            assert set(quiet) == {"d", "z"}  # one per deployment, aliases included once
            assert quiet["d"] == opb.DeploymentDemand(deployment="d")
            # Engines: d0 has 3 waiting and 80 % of its KV blocks used, d1 2 and 50 %; a
            # state of a replica of another table and a stale one are not counted.
            r.engines.put(
                EngineState("d0", total_kv_blocks=100, free_kv_blocks=20, waiting_requests=3)
            )
            r.engines.put(
                EngineState("d1", total_kv_blocks=100, free_kv_blocks=50, waiting_requests=2)
            )
            r.engines.put(
                EngineState("x9", total_kv_blocks=10, free_kv_blocks=0, waiting_requests=9)
            )
            held = [await r.acquire("d"), await r.acquire("d-alias")]  # both replicas full
            queued = [r.acquire("d"), r.acquire("d")]
            await _settle()
            r.clock.advance(1.5)
            late = r.acquire("d")  # joins 1.5 s after the first two
            await _settle()
            assert await r.lease.renew()
            busy = _demand(fake.renewals["a"][-1])["d"]
            assert busy.queued_requests == 3 and busy.in_flight_requests == 2
            assert busy.max_queue_wait_seconds == pytest.approx(1.5)
            assert busy.engine_waiting_requests == 5
            assert busy.kv_usage == pytest.approx(0.8)
            assert busy.requests_total == 5 and busy.queue_rejections_total == 0
            assert busy.cold_waiting_requests == 0
            r.scheduler.advance(3.5)  # the first two queued time out (5 s): 429s
            await _settle()
            assert all(isinstance(q.exception(), ResourceExhaustedError) for q in queued)
            r.clock.advance(2.0)  # d0's state is stale (no update for 7 s); no timer fires

            r.engines.put(
                EngineState("d1", total_kv_blocks=100, free_kv_blocks=90, waiting_requests=1)
            )
            assert await r.lease.renew()
            after = _demand(fake.renewals["a"][-1])["d"]
            assert after.queue_rejections_total == 2 and after.queued_requests == 1
            assert after.max_queue_wait_seconds == pytest.approx(5.5)  # `late`: the oldest now
            assert after.engine_waiting_requests == 1
            assert after.kv_usage == pytest.approx(0.1)
            held[0].release()
            await _settle()
            assert late.done()
            assert await r.lease.renew()
            drained = _demand(fake.renewals["a"][-1])["d"]
            assert drained.queued_requests == 0 and drained.max_queue_wait_seconds == 0.0
            assert drained.requests_total == 5  # a counter
        finally:
            await r.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_request_held_for_a_deployment_at_zero_renews_at_once() -> None:
    """The lease keeper's period is long here (a 100 s lease: every 20 s), so the renewal that
    says `cold_waiting_requests` 1 comes from the hold itself; the table with a replica
    then admits the held request."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        assert isinstance(fake, FakeOrchestrator)
        fake.lease_seconds = 100.0
        r = Router(address)
        try:
            await r.source.start()
            fake.send("a", _table("t1"))
            await r.receive("t1")
            await r.lease.start()
            await _wait_for(lambda: len(fake.renewals.get("a", ())) >= 1, "the first renewal")
            await _wait_for(lambda: r.admission.lease_valid(), "the lease")
            before = len(fake.renewals["a"])
            held = r.acquire("z")
            await _wait_for(lambda: len(fake.renewals["a"]) > before, "the immediate renewal")
            cold = _demand(fake.renewals["a"][-1])["z"]
            assert cold.cold_waiting_requests == 1 and cold.queued_requests == 1
            assert cold.requests_total == 1
            assert not held.done()
            count = len(fake.renewals["a"])
            second = r.acquire("z")  # a second hold needs no renewal of its own
            await _settle()
            await asyncio.sleep(0.05)
            assert len(fake.renewals["a"]) == count
            fake.send("a", _table("t2", z_replicas=1))
            await r.receive("t2")
            await _wait_for(lambda: held.done() and second.done(), "the held requests")
            assert held.result().endpoint.replica_id == "z0"
            await _wait_for(lambda: len(fake.renewals["a"]) > count, "the table's renewal")
            warm = _demand(fake.renewals["a"][-1])["z"]
            assert warm.cold_waiting_requests == 0 and warm.in_flight_requests == 2
        finally:
            await r.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_release_carries_no_demand() -> None:
    async def scenario() -> None:
        fake, server, address = await _rig()
        r = Router(address)
        try:
            await r.source.start()
            fake.send("a", _table("t1"))
            await r.receive("t1")
            assert await r.lease.renew()
            assert len(fake.renewals["a"][-1].demand) == 2
            await r.lease.stop()
            assert fake.renewals["a"][-1].release and not fake.renewals["a"][-1].demand
        finally:
            await r.source.stop()
            await server.stop(0)

    asyncio.run(scenario())

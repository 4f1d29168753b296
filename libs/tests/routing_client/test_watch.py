"""`RoutingTableWatch` against a small fake RoutingService over real gRPC on loopback. (The
router's `OrchestratorRouteSource` tests cover reconnects and backoff through it.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

import inferplane.routing_client as routing_client
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.routing_client import RoutingTableWatch
from inferplane.runtime.processes.ports import free_port


def test_exports() -> None:
    assert sorted(routing_client.__all__) == [
        "OutcomeMetrics",
        "OutcomeReporter",
        "OutcomeReporterSettings",
        "RoutingTableWatch",
        "Sleep",
    ]


class FakeRoutingService(orchestrator_pb2_grpc.RoutingServiceServicer):  # type: ignore[misc]
    def __init__(self, tables: list[Any]) -> None:
        self.tables = tables
        self.requests: list[Any] = []
        self.release = asyncio.Event()

    async def WatchRoutingTable(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        for table in self.tables:
            yield table
        await self.release.wait()


def _table(version: str, *replicas: str) -> Any:
    return opb.WatchRoutingTableResponse(
        version=version,
        routes=[
            opb.ModelRoute(model="m", endpoints=[opb.RouteEndpoint(replica_id=r) for r in replicas])
        ],
    )


def _replicas(message: Any) -> tuple[str, ...]:
    if message.version == "bad":
        raise ValueError("cannot convert")
    return tuple(e.replica_id for r in message.routes for e in r.endpoints)


def test_each_table_becomes_the_callers_snapshot_and_a_bad_one_is_skipped() -> None:
    async def scenario() -> None:
        fake = FakeRoutingService([_table("v1", "a"), _table("bad", "x"), _table("v2", "a", "b")])
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        watch = RoutingTableWatch(f"127.0.0.1:{port}", _replicas, (), models=["m"])
        seen: list[tuple[str, ...]] = []
        watch.subscribe(seen.append)
        assert watch.current() == () and not watch.received.is_set()
        await watch.start()
        try:
            for _ in range(500):
                if watch.current() == ("a", "b"):
                    break
                await asyncio.sleep(0.01)
            assert seen == [(), ("a",), ("a", "b")]  # "bad" never reached a listener
            assert watch.received.is_set() and watch.connects == 1
            assert list(fake.requests[0].models) == ["m"]
        finally:
            fake.release.set()
            await watch.stop()
            await server.stop(0)

    asyncio.run(scenario())


async def _serve(fake: FakeRoutingService) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_routers_watch_moves_on_from_a_standby_and_a_dead_orchestrator_to_the_leader() -> None:
    """Several orchestrators, comma-separated: a router's stream leaves one that is down or
    stands by (its table says `standby`) and settles on the leader; the standby's table is
    applied only because none was. A watch without a router id (telemetry) stays on any."""

    async def scenario() -> None:
        standby_table = _table("s1", "a")
        standby_table.standby = True
        standby, leader = FakeRoutingService([standby_table]), FakeRoutingService([])
        leader.tables = [_table("l1", "a", "b")]
        (s_server, s_address), (l_server, l_address) = await _serve(standby), await _serve(leader)
        dead = f"127.0.0.1:{free_port()}"
        router = RoutingTableWatch(
            f"{dead}, {s_address},{l_address}",
            _replicas,
            (),
            router_id="router-1",
            initial_backoff_seconds=0.01,
        )
        plain = RoutingTableWatch(f"{s_address},{l_address}", _replicas, ())
        seen: list[tuple[str, ...]] = []
        router.subscribe(seen.append)
        await router.start()
        await plain.start()
        try:
            for _ in range(500):
                if router.current() == ("a", "b") and plain.received.is_set():
                    break
                await asyncio.sleep(0.01)
            assert seen == [(), ("a",), ("a", "b")]
            assert router.address == l_address and router.connects == 3
            assert sorted(r.router_id for r in standby.requests) == ["", "router-1"]
            assert [r.router_id for r in leader.requests] == ["router-1"]
            assert plain.address == s_address and plain.current() == ("a",)
        finally:
            standby.release.set()
            leader.release.set()
            await router.stop()
            await plain.stop()
            await s_server.stop(0)
            await l_server.stop(0)

    asyncio.run(scenario())

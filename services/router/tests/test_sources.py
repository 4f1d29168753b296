"""The routing-table watch against a small fake RoutingService over real gRPC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.app import route_source
from inferplane.router.policies import default_registry
from inferplane.router.routes import RouteTable
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import OrchestratorRouteSource, StaticRouteSource
from inferplane.testing.clock import FakeClock

from .fakes import FakeScheduler


def _table(version: str, replicas: list[str], policy: str = "prefix_affinity") -> Any:
    return opb.WatchRoutingTableResponse(
        version=version,
        routes=[
            opb.ModelRoute(
                model="kimi",
                deployment="kimi-d",
                routing_policy=policy,
                max_model_len=4096,
                endpoints=[
                    opb.RouteEndpoint(
                        replica_id=r, address=f"127.0.0.1:{9000 + i}", max_concurrency=4, weight=1
                    )
                    for i, r in enumerate(replicas)
                ],
            )
        ],
    )


class FakeRoutingService(orchestrator_pb2_grpc.RoutingServiceServicer):  # type: ignore[misc]
    """Each connection plays the next script: a list of tables, then `end` ("abort" or "hold")."""

    def __init__(self, scripts: list[tuple[list[Any], str]]) -> None:
        self.scripts = scripts
        self.connections = 0
        self.release = asyncio.Event()

    async def WatchRoutingTable(self, request: Any, context: Any) -> AsyncIterator[Any]:
        script, end = self.scripts[min(self.connections, len(self.scripts) - 1)]
        self.connections += 1
        for table in script:
            yield table
        if end == "abort":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "orchestrator restarting")
        await self.release.wait()


async def _wait_for(predicate: Any, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_follows_the_stream_reconnects_with_backoff_and_keeps_the_last_table() -> None:
    async def scenario() -> None:
        fake = FakeRoutingService(
            [
                ([_table("v1", ["a", "b"]), _table("v2", ["b"])], "abort"),
                ([], "abort"),
                ([_table("v3", ["b", "c"])], "hold"),
            ]
        )
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        delays: list[float] = []
        gate = asyncio.Event()

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            if len(delays) == 2:
                await gate.wait()  # stay disconnected until the test has looked

        clock = FakeClock()
        admission = Admission(default_registry(), AdmissionSettings(), clock, FakeScheduler(clock))
        source = OrchestratorRouteSource(
            f"127.0.0.1:{port}", initial_backoff_seconds=1, max_backoff_seconds=3, sleep=sleep
        )
        seen: list[str] = []
        source.subscribe(lambda t: seen.append(t.version))
        source.subscribe(admission.apply)
        await source.start()
        try:
            await _wait_for(lambda: len(delays) == 2, "two reconnect attempts")
            table = source.current()
            assert table.version == "v2"  # the last table survives the outage
            route = table.get("kimi")
            assert route is not None and route.routing_policy == "prefix_affinity"
            assert [e.replica_id for e in route.endpoints] == ["b"]
            assert route.endpoints[0].max_concurrency == 4 and route.deployment == "kimi-d"
            assert admission.replicas("kimi-d").keys == (("127.0.0.1:9000", "b"),)
            # Full jitter under a doubling cap: 1 then 2 seconds at most.
            assert 0 <= delays[0] <= 1 and 0 <= delays[1] <= 2
            gate.set()
            await _wait_for(lambda: source.current().version == "v3", "the table after reconnect")
            assert seen == ["", "v1", "v2", "v3"]
            assert fake.connections == 3
        finally:
            fake.release.set()
            await source.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_table_with_an_unknown_policy_is_rejected_and_the_previous_one_kept() -> None:
    async def scenario() -> None:
        fake = FakeRoutingService(
            [
                (
                    [
                        _table("v1", ["a"]),
                        _table("v2", ["a"], policy="fastest"),
                        _table("v3", ["a", "b"]),
                    ],
                    "hold",
                )
            ]
        )
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        clock = FakeClock()
        admission = Admission(default_registry(), AdmissionSettings(), clock, FakeScheduler(clock))
        source = OrchestratorRouteSource(f"127.0.0.1:{port}")
        versions: list[str] = []
        source.subscribe(admission.apply)
        source.subscribe(lambda t: versions.append(t.version))
        await source.start()
        try:
            await _wait_for(lambda: source.current().version == "v3", "v3")
            assert versions == ["", "v1", "v3"]  # v2 never became current
        finally:
            fake.release.set()
            await source.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_the_orchestrator_is_the_source_when_its_address_is_set(tmp_path: Any) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "models:\n  - model: m\n    routing_policy: round_robin\n"
        "    endpoints: [{address: '127.0.0.1:1', replica_id: r0, max_concurrency: 3}]\n"
    )
    static = route_source(RouterSettings(routes_file=str(routes)))
    assert isinstance(static, StaticRouteSource)
    route = static.current().get("m")
    assert route is not None and route.routing_policy == "round_robin"
    assert route.endpoints[0].max_concurrency == 3
    watched = route_source(RouterSettings(routes_file=str(routes), orchestrator_address="x:1"))
    assert isinstance(watched, OrchestratorRouteSource)
    assert watched.current() == RouteTable.of([])

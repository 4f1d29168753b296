"""The orchestrator as Envoy's ADS control plane, with a real Envoy started from the minimal
bootstrap (`inferplane.edge.render_ads_bootstrap`): everything else (listener, routes, clusters,
replica endpoints) comes over ADS from the orchestrator's snapshot cache.

Invariant: the replicas cluster follows the routing table the orchestrator publishes, and a
replica leaving it while an SSE stream runs there never breaks that stream (all chunks +
`data: [DONE]` arrive from the old replica), while new requests reach the new set only. Also:
NACK-free ACKs, and an inconsistent snapshot is refused before publishing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.api import httpbody_pb2
from google.rpc import code_pb2, status_pb2

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.edge import REPLICAS_CLUSTER, EnvoyProcess, render_ads_bootstrap
from inferplane.orchestrator.app import build_components
from inferplane.orchestrator.routing import make_table
from inferplane.orchestrator.settings import OrchestratorSettings
from inferplane.orchestrator.xds.cache import InconsistentSnapshotError, Snapshot
from inferplane.runtime import RunningServer
from inferplane.runtime.processes.ports import free_port
from inferplane.testing.loop import LoopThread
from inferplane.testing.picker import GOOD_KEY, FakePicker

pytestmark = pytest.mark.timeout(120)
CHUNKS = 12
GAP_S = 0.25


class Backend(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """A replica process that streams `CHUNKS` SSE chunks naming itself, `GAP_S` apart."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def StreamChatCompletionEvents(self, request: Any, context: Any) -> Iterator[Any]:
        self.calls += 1
        for i in range(CHUNKS):
            chunk = {"id": self.name, "choices": [{"index": 0, "delta": {"content": str(i)}}]}
            yield httpbody_pb2.HttpBody(
                content_type="text/event-stream", data=f"data: {json.dumps(chunk)}\n\n".encode()
            )
            if request.request.model == "slow":
                time.sleep(GAP_S)
        yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=b"data: [DONE]\n\n")


class AllowAll(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def Check(self, request: Any, context: Any) -> Any:
        return external_auth_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.OK))


def serve(add: Any, servicer: Any) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def stream(url: str, model: str) -> tuple[list[str], bool]:
    """POSTs a streaming chat completion; returns the backends named by the chunks and whether
    `data: [DONE]` ended the stream."""
    names: list[str] = []
    done = False
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    key = {"authorization": f"Bearer {GOOD_KEY}"}  # the fake picker authenticates it
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=key, timeout=30
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                names.append(json.loads(line[6:])["id"])
    return names, done


def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def table(*addresses: str) -> orchestrator_pb2.WatchRoutingTableResponse:
    endpoints = [
        orchestrator_pb2.RouteEndpoint(replica_id=f"r{i}", address=a)
        for i, a in enumerate(addresses)
    ]
    return make_table([orchestrator_pb2.ModelRoute(model="m", endpoints=endpoints)])


def test_replica_set_follows_the_table_while_a_stream_is_in_flight(tmp_path: Path) -> None:
    b1, b2 = Backend("b1"), Backend("b2")
    s1, p1 = serve(inference_pb2_grpc.add_InferenceServiceServicer_to_server, b1)
    s2, p2 = serve(inference_pb2_grpc.add_InferenceServiceServicer_to_server, b2)
    auth, auth_port = serve(external_auth_pb2_grpc.add_AuthorizationServicer_to_server, AllowAll())
    picker = FakePicker()
    router, router_port = serve(ep_grpc.add_ExternalProcessorServicer_to_server, picker)
    r1, r2 = f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"
    picker.targets = [r1]
    listen, admin = free_port(), free_port()
    settings = OrchestratorSettings(
        port=0,
        data_dir=tmp_path / "orch",
        grace_period_seconds=0.2,
        reconcile=False,
        edge_routers=(f"127.0.0.1:{router_port}",),
        edge_auth_address=f"127.0.0.1:{auth_port}",
        edge_listen_port=listen,
        edge_node_id="edge-test",
    )
    components = build_components(settings)
    loop = LoopThread()

    async def start() -> RunningServer:
        running = RunningServer(components.app(), settings)
        await running.start()
        return running

    server = loop.run(start(), timeout=20)
    envoy = None
    try:
        envoy = EnvoyProcess(
            render_ads_bootstrap(f"127.0.0.1:{server.port}", node_id="edge-test", admin_port=admin),
            data_dir=tmp_path / "envoy",
            admin_url=f"http://127.0.0.1:{admin}",
            concurrency=1,
        )
        envoy.start()  # LIVE only once listener and clusters arrived over ADS
        url = f"http://127.0.0.1:{listen}"
        loop.run(components.hub.publish(table(r1)))
        wait_for(lambda: envoy.cluster_hosts(REPLICAS_CLUSTER) == {r1})
        assert stream(url, "fast") == (["b1"] * CHUNKS, True)

        result: dict[str, Any] = {}
        in_flight = threading.Thread(target=lambda: result.update(slow=stream(url, "slow")))
        in_flight.start()
        wait_for(lambda: b1.calls == 2)
        loop.run(components.hub.publish(table(r1, r2)))  # a replica joins the table
        wait_for(lambda: envoy.cluster_hosts(REPLICAS_CLUSTER) == {r1, r2})
        picker.targets = [r2]
        loop.run(components.hub.publish(table(r2)))  # the first one leaves it
        wait_for(lambda: envoy.cluster_hosts(REPLICAS_CLUSTER) == {r2})
        assert in_flight.is_alive()  # the swap happened mid-stream
        for _ in range(4):
            assert stream(url, "fast") == (["b2"] * CHUNKS, True)
        in_flight.join(30)
        assert result["slow"] == (["b1"] * CHUNKS, True)  # complete, from the old replica
        assert components.ads.nacks == 0 and components.ads.acks >= 4
    finally:
        if envoy is not None:
            envoy.stop()
        loop.run(server.stop(), timeout=20)
        loop.run(asyncio.sleep(0))
        loop.close()
        for s in (s1, s2, auth, router):
            s.stop(grace=None)


def test_inconsistent_snapshot_is_refused() -> None:
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.route.v3 import route_components_pb2 as rc
    from envoy.config.route.v3 import route_pb2

    from inferplane.edge import CLUSTER_TYPE, ROUTE_TYPE

    eds = cluster_pb2.Cluster(name="a", type=cluster_pb2.Cluster.EDS)
    routes = route_pb2.RouteConfiguration(
        name="r",
        virtual_hosts=[
            rc.VirtualHost(
                name="v",
                domains=["*"],
                routes=[rc.Route(route=rc.RouteAction(cluster="missing"))],
            )
        ],
    )
    snapshot = Snapshot.of(
        {
            CLUSTER_TYPE: [eds],
            ROUTE_TYPE: [routes],
        }
    )
    with pytest.raises(InconsistentSnapshotError) as info:
        snapshot.consistent()
    assert "cluster missing is not in the snapshot" in str(info.value)
    assert "EDS cluster a has no ClusterLoadAssignment" in str(info.value)
    same = Snapshot.of({CLUSTER_TYPE: [eds]})
    assert same.versions == Snapshot.of({CLUSTER_TYPE: [eds]}).versions  # content hashes

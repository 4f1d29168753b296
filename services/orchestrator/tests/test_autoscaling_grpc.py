"""Autoscaling end to end over real gRPC: the real orchestrator app (SQLite, leader, reconcile
loop, autoscaler on short timings) and a fake node-agent serving `NodeAgentService` and the
replicas' warm-up; a router's demand arrives in `RenewRouterLease` renewals, as routers send
it. A deployment scales up on reported demand and back down through the drain path (marked
draining, DrainReplica, StopReplica only once its last request finished); another scales to
zero after its idle period (placement released, its route kept with `scale_to_zero`) and back
to one replica on a request held for a cold start. Decisions are listed newest first, counted
in the metrics, and an operator's write of `replicas` is refused.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from typer.testing import CliRunner

from inferplane.api.inference.v1 import inference_pb2, inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.orchestrator.cli import app
from inferplane.orchestrator.release.gate import GateReading, TelemetryLatency
from inferplane.runtime.time.clock import SystemClock
from inferplane.testing.loop import LoopThread

S = na.Replica.State


class FakeNodeAgent(
    nodeagent_pb2_grpc.NodeAgentServiceServicer,  # type: ignore[misc]
    inference_pb2_grpc.InferenceServiceServicer,  # type: ignore[misc]
):
    """Replicas READY once started, answering the warm-up on the agent's address; a replica
    listed in `busy` reports one request in flight while it drains. Records every call."""

    def __init__(self) -> None:
        self.address = ""
        self.replicas: dict[str, na.Replica] = {}
        self.calls: list[tuple[str, str]] = []
        self.busy: set[str] = set()

    async def StartReplica(self, request: Any, context: Any) -> na.StartReplicaResponse:
        self.calls.append(("Start", request.replica_id))
        current = self.replicas.get(request.replica_id)
        if current is None or current.state in (S.STATE_STOPPED, S.STATE_FAILED):
            self.replicas[request.replica_id] = na.Replica(
                name=f"replicas/{request.replica_id}",
                spec=request.spec,
                state=S.STATE_READY,
                inference_address=self.address,
            )
        return na.StartReplicaResponse(replica=self.replicas[request.replica_id])

    async def DrainReplica(self, request: Any, context: Any) -> na.DrainReplicaResponse:
        replica_id = request.name.removeprefix("replicas/")
        self.calls.append(("Drain", replica_id))
        replica = self.replicas[replica_id]
        replica.state = S.STATE_DRAINING
        replica.in_flight_requests = 1 if replica_id in self.busy else 0
        return na.DrainReplicaResponse(replica=replica)

    async def StopReplica(self, request: Any, context: Any) -> na.StopReplicaResponse:
        replica_id = request.name.removeprefix("replicas/")
        self.calls.append(("Stop", replica_id))
        self.replicas[replica_id].state = S.STATE_STOPPED
        return na.StopReplicaResponse(replica=self.replicas[replica_id])

    async def ListReplicas(self, request: Any, context: Any) -> na.ListReplicasResponse:
        for replica_id, replica in self.replicas.items():
            if replica.state == S.STATE_DRAINING and replica_id not in self.busy:
                replica.in_flight_requests = 0
        return na.ListReplicasResponse(replicas=[self.replicas[k] for k in sorted(self.replicas)])

    async def StreamChatCompletion(self, request: Any, context: Any) -> Any:
        yield inference_pb2.StreamChatCompletionResponse(
            id="chatcmpl-1",
            object="chat.completion.chunk",
            model=request.request.model,
            choices=[inference_pb2.ChatCompletionChunkChoice(index=0, finish_reason="stop")],
        )

    def live(self) -> set[str]:
        return {k for k, r in self.replicas.items() if r.state != S.STATE_STOPPED}


@contextlib.contextmanager
def fake_agent() -> Iterator[FakeNodeAgent]:
    loop = LoopThread()
    agent = FakeNodeAgent()

    async def serve() -> grpc.aio.Server:
        server = grpc.aio.server()
        nodeagent_pb2_grpc.add_NodeAgentServiceServicer_to_server(agent, server)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(agent, server)
        agent.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        return server

    server = loop.run(serve())
    try:
        yield agent
    finally:
        loop.run(server.stop(0))
        loop.close()


class RouterStub:
    """A router's routing-table watch (with its router id) on a thread, keeping the latest
    table, and its lease renewals carrying demand."""

    def __init__(self, channel: grpc.Channel, router_id: str = "router-1") -> None:
        self.routing = orchestrator_pb2_grpc.RoutingServiceStub(channel)
        self.router_id = router_id
        self.table = pb.WatchRoutingTableResponse()
        self._stream = self.routing.WatchRoutingTable(
            pb.WatchRoutingTableRequest(router_id=router_id)
        )
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for table in self._stream:
                self.table = table

    def renew(self, **demand: Any) -> None:
        self.routing.RenewRouterLease(
            pb.RenewRouterLeaseRequest(
                router_id=self.router_id,
                lease_epoch=self.table.lease_epoch,
                version=self.table.version,
                demand=[pb.DeploymentDemand(**demand)],
            ),
            timeout=5,
        )

    def route(self, model: str) -> pb.ModelRoute | None:
        return next((r for r in self.table.routes if r.model == model), None)

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(5)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def stack(tmp_path: Path, fx: Any) -> Iterator[tuple[Any, FakeNodeAgent, RouterStub]]:
    settings = fx.make_settings(
        tmp_path,
        reconcile_interval_seconds=0.1,
        drain_propagation_seconds=0.1,
        autoscale_interval_seconds=0.1,
        autoscale_grace_seconds=0.0,
        heartbeat_interval_seconds=60.0,
    )
    with fake_agent() as agent, fx.running(settings, SystemClock()) as orch:
        status = fx.cpu_status("cpu-1")
        status.address = agent.address
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=status))
        router = RouterStub(orch.channel)
        try:
            yield orch, agent, router
        finally:
            router.close()


def get(orch: Any, name: str) -> pb.Deployment:
    return orch.deployments.GetDeployment(pb.GetDeploymentRequest(name=f"deployments/{name}"))


def ready(orch: Any, name: str, replicas: int) -> Callable[[], bool]:
    def check() -> bool:
        d = get(orch, name).deployment
        return d.replicas == replicas and d.status.ready_replicas == replicas

    return check


def test_scales_up_on_reported_demand_and_down_through_drain(stack: Any, fx: Any) -> None:
    orch, agent, router = stack
    d = fx.tiny_cpu_proto(min_replicas=1, max_replicas=3)
    d.autoscaling.enabled = True
    d.autoscaling.target_in_flight_per_replica = 2
    d.autoscaling.scale_down_window_seconds = 1
    orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="auto", deployment=d)
    )
    wait_for("one ready replica", ready(orch, "auto", 1))

    router.renew(deployment="auto", in_flight_requests=5, requests_total=5)
    wait_for("three ready replicas", ready(orch, "auto", 3))
    status = get(orch, "auto").deployment.status.autoscaler
    # Each tick's decision: "hold" once the scale-up is made; when it was made stays.
    assert status.desired_replicas == 3 and status.last_decision in ("scale_up", "hold")
    assert status.HasField("last_change_time") and status.signals.in_flight_requests == 5

    # The operator may not set replicas while the autoscaler owns them.
    with pytest.raises(grpc.RpcError) as refused:
        orch.deployments.UpdateDeployment(
            pb.UpdateDeploymentRequest(
                deployment=pb.Deployment(name="deployments/auto", replicas=2),
                update_mask=field_mask_pb2.FieldMask(paths=["replicas"]),
            )
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "set by the autoscaler" in (refused.value.details() or "")

    # Demand falls to one replica's worth; one retired replica still has a request in flight.
    started = [rid for method, rid in agent.calls if method == "Start"]
    agent.busy.add(started[-1])
    router.renew(deployment="auto", in_flight_requests=1, requests_total=9)
    wait_for("replicas 1", lambda: get(orch, "auto").deployment.replicas == 1)
    wait_for("one replica stopped", lambda: len(agent.live()) == 2)
    assert started[-1] in agent.live()  # draining, its request not finished: not stopped
    assert agent.replicas[started[-1]].state == S.STATE_DRAINING
    agent.busy.clear()
    wait_for("the drained replica stopped", lambda: len(agent.live()) == 1)
    for replica_id in set(started) - agent.live():
        calls = [m for m, rid in agent.calls if rid == replica_id]
        assert calls.index("Drain") < calls.index("Stop"), calls  # drained, then stopped
    wait_for("one ready", ready(orch, "auto", 1))
    route = router.route("auto")
    assert route is not None and len(route.endpoints) == 1 and not route.scale_to_zero

    decisions = orch.deployments.ListAutoscalerDecisions(
        pb.ListAutoscalerDecisionsRequest(deployment="deployments/auto")
    ).decisions
    assert [(x.decision, x.from_replicas, x.to_replicas) for x in decisions] == [
        ("scale_down", 3, 1),
        ("scale_up", 1, 3),
    ]
    assert decisions[1].signals.in_flight_requests == 5 and decisions[0].reason
    registry = orch.components.registry
    for kind in ("scale_up", "scale_down"):
        assert (
            registry.get_sample_value(
                "inferplane_autoscaler_decisions_total", {"deployment": "auto", "decision": kind}
            )
            == 1.0
        )
    # The CLI verb prints the status, the signals and the decisions.
    result = CliRunner().invoke(
        app, ["autoscale", "auto", "--address", orch.address], env={"INFERPLANE_PLAINTEXT": "1"}
    )
    assert result.exit_code == 0, result.output
    for text in ("replicas 1 (bounds 1..3", "in_flight_requests", "scale_down", "3 -> 1"):
        assert text in result.output, result.output
    with pytest.raises(grpc.RpcError) as unknown:
        orch.deployments.ListAutoscalerDecisions(
            pb.ListAutoscalerDecisionsRequest(deployment="deployments/nope")
        )
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_scales_to_zero_when_idle_and_back_on_a_held_request(stack: Any, fx: Any) -> None:
    orch, agent, router = stack
    d = fx.tiny_cpu_proto(min_replicas=1, max_replicas=2)
    d.autoscaling.enabled = True
    d.autoscaling.scale_to_zero = True
    d.autoscaling.idle_seconds_before_zero = 2
    orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="cold", deployment=d)
    )
    wait_for("one ready replica", ready(orch, "cold", 1))

    wait_for("scaled to zero", lambda: get(orch, "cold").deployment.replicas == 0)
    wait_for("its replica stopped", lambda: not agent.live())
    calls = [m for m, _ in agent.calls]
    assert calls.index("Drain") < calls.index("Stop")
    assert orch.components.control.placements().of("cold") == ((), ())  # resources released
    view = get(orch, "cold").deployment
    assert view.status.autoscaler.last_decision in ("scale_to_zero", "hold")
    assert view.status.autoscaler.desired_replicas == 0
    assert view.status.phase == "Available" and "scaled to zero" in view.status.message
    # Still listed: its route stays, empty, marked for the picker to hold requests.
    wait_for("an empty route", lambda: (r := router.route("cold")) is not None and not r.endpoints)
    route = router.route("cold")
    assert route is not None
    assert route.scale_to_zero and route.cold_start_budget_seconds == 120

    router.renew(deployment="cold", cold_waiting_requests=1, requests_total=1)
    wait_for("one ready replica again", ready(orch, "cold", 1))
    wait_for("an endpoint", lambda: (r := router.route("cold")) is not None and r.endpoints)
    decisions = orch.deployments.ListAutoscalerDecisions(
        pb.ListAutoscalerDecisionsRequest(deployment="deployments/cold", page_size=1)
    ).decisions
    assert [(x.decision, x.from_replicas, x.to_replicas) for x in decisions] == [
        ("scale_from_zero", 0, 1)
    ]


class FakeTelemetry(telemetry_pb2_grpc.TelemetryServiceServicer):  # type: ignore[misc]
    """QueryLatency answering fixed percentiles; records the requests."""

    def __init__(self) -> None:
        self.requests: list[telemetry_pb2.QueryLatencyRequest] = []

    async def QueryLatency(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return telemetry_pb2.QueryLatencyResponse(
            request_count=40,
            error_count=2,
            time_to_first_token_seconds=[
                telemetry_pb2.Percentile(percentile=50, value=0.1),
                telemetry_pb2.Percentile(percentile=99, value=0.75),
            ],
            tool_call_validity=0.9,
        )


def test_ttft_p99_is_read_from_telemetry_query_latency() -> None:
    loop = LoopThread()
    fake = FakeTelemetry()

    async def serve() -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(fake, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        return server, address

    server, address = loop.run(serve())
    try:
        reader = TelemetryLatency(address, timeout_seconds=5)
        reading = loop.run(reader.read("auto", 60.4))
        assert reading == GateReading(40, 2, 0.75, tool_call_validity=0.9)
        assert fake.requests[0].deployment == "auto" and fake.requests[0].window_seconds == 60
        assert fake.requests[0].revision == ""
        loop.run(reader.read("auto", 30, revision="abc123"))  # the canary's reading (issue 30)
        assert fake.requests[1].revision == "abc123"
        assert list(fake.requests[0].percentiles) == [99]
        loop.run(reader.close())
        nowhere = TelemetryLatency("127.0.0.1:9", timeout_seconds=0.5)
        assert loop.run(nowhere.read("auto", 60)) is None  # unreachable: unknown, no error
        loop.run(nowhere.close())
    finally:
        loop.run(server.stop(0))
        loop.close()

"""The conformance gate's call over real gRPC (issue 30): `GrpcNodeAgents.conformance` sends
RunConformance to the replica process's own address with the gate's live requests, seed and
bound, and `run_conformance` turns the report into a verdict, or a refused call into an "error"
verdict naming the gRPC code."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import grpc

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.release.agents import GrpcNodeAgents
from inferplane.orchestrator.release.gates import run_conformance
from inferplane.testing.loop import LoopThread

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class Replica(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    """RunConformance answering a fixed report (or refusing with `refuse`)."""

    def __init__(self, report: replica_pb2.ConformanceReport, refuse: bool = False) -> None:
        self.report = report
        self.refuse = refuse
        self.requests: list[replica_pb2.RunConformanceRequest] = []
        self.deadlines: list[float | None] = []

    async def RunConformance(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        self.deadlines.append(context.time_remaining())
        if self.refuse:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "RunConformance is not served")
        return replica_pb2.RunConformanceResponse(report=self.report)


def run(replica: Replica, gates: pb.ReleaseGates) -> tuple[pb.GateVerdict, Any]:
    loop = LoopThread()

    async def scenario() -> tuple[pb.GateVerdict, Any]:
        server = grpc.aio.server()
        replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(replica, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        agents = GrpcNodeAgents(timeout_seconds=60)
        try:
            return await run_conformance(agents, address, gates, revision="00ff", now=NOW)
        finally:
            await agents.close()
            await server.stop(None)

    try:
        return loop.run(scenario())
    finally:
        loop.close()


def test_the_gate_sends_its_settings_and_scores_the_report() -> None:
    report = replica_pb2.ConformanceReport(
        replay_cases=10,
        replay_passed=10,
        live_requests=6,
        tool_calls_expected=4,
        tool_calls_returned=4,
        tool_calls=5,
        tool_calls_schema_valid=5,
        leaked_markers=1,
        seconds=3.5,
    )
    replica = Replica(report)
    verdict, got = run(
        replica, pb.ReleaseGates(conformance_live_requests=6, conformance_timeout_seconds=30)
    )
    (request,) = replica.requests
    assert (request.live_requests, request.seed, request.timeout_seconds) == (6, 255, 30.0)
    (deadline,) = replica.deadlines
    # The bound plus the control timeout (a loaded machine may take seconds to connect); gRPC
    # rounds a deadline on the wire, so the server may read a little over 90 s (CI: 90.099).
    assert deadline is not None and 60 < deadline <= 91
    assert got == report
    assert (verdict.gate, verdict.result, verdict.revision) == ("conformance", "failed", "00ff")
    assert "1 live requests leaked parser markers (at most 0)" in verdict.reason
    assert verdict.measurements["leaked_markers"] == 1
    assert verdict.measurements["run_seconds"] == 3.5
    assert verdict.decide_time.ToDatetime(tzinfo=UTC) == NOW


def test_a_refused_call_is_an_error_verdict() -> None:
    verdict, got = run(Replica(replica_pb2.ConformanceReport(), refuse=True), pb.ReleaseGates())
    assert got is None
    assert (verdict.gate, verdict.result) == ("conformance", "error")
    assert "UNIMPLEMENTED: RunConformance is not served" in verdict.reason

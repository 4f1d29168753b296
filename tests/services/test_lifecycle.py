"""Every service starts, answers health and /metrics, refuses what it does not serve with
UNIMPLEMENTED (generation is the replica processes': the node-agent serves no inference and the
router only lists models), and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.inference.v1 import inference_pb2, inference_pb2_grpc
from inferplane.runtime.ports import free_port


def _generate(channel: grpc.Channel) -> Any:
    """A streamed chat completion asked of a service that must not generate."""
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    return list(
        stub.StreamChatCompletionEvents(
            inference_pb2.StreamChatCompletionEventsRequest(), timeout=5
        )
    )


SERVICES: list[tuple[str, Callable[[grpc.Channel], Any] | None, str]] = [
    ("auth", None, "inferplane.auth.v1.ApiKeyService"),
    ("router", _generate, "inferplane.inference.v1.InferenceService"),
    ("orchestrator", None, "inferplane.orchestrator.v1.DeploymentService"),
    ("node_agent", _generate, "inferplane.nodeagent.v1.NodeAgentService"),
    ("telemetry", None, "inferplane.telemetry.v1.TelemetryService"),
]


@pytest.mark.parametrize(
    ("service", "unimplemented", "health_name"), SERVICES, ids=[s[0] for s in SERVICES]
)
def test_service_lifecycle(
    service: str,
    unimplemented: Callable[[grpc.Channel], Any] | None,
    health_name: str,
    tmp_path: Path,
) -> None:
    port, metrics_port = free_port(), free_port()
    prefix = f"INFERPLANE_{service.upper()}_"
    env = {**os.environ, prefix + "DATA_DIR": str(tmp_path), prefix + "JSON_LOGS": "true"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            f"inferplane.{service}",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--grace-period-seconds",
            "2",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    status = health.Check(
                        health_pb2.HealthCheckRequest(service=health_name), timeout=1
                    ).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None, f"{service} exited early"
                assert time.monotonic() < deadline, f"{service} never became healthy"
                time.sleep(0.2)
            if unimplemented is not None:
                with pytest.raises(grpc.RpcError) as info:
                    unimplemented(channel)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
        assert b"python_info" in body or b"inferplane_" in body or b"# HELP" in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert '"event": "stopped"' in stderr, stderr[-2000:]

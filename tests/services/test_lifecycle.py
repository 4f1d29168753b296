"""Every service starts with its identity (mutual TLS from a local CA), answers health and
/metrics, refuses what it does not serve with UNIMPLEMENTED (generation is the replica
processes': the node-agent serves no inference and the router only lists models), and exits 0
on SIGTERM. Without an identity or the explicit development flag a service does not start."""

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
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.identity import ADMIN, PeerSecurity
from inferplane.runtime.security.pki import LocalCA


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
    pki = tmp_path / "pki"
    ca = LocalCA.ensure(pki)
    for name in (service.replace("_", "-"), ADMIN):
        ca.issue(name, dns_names=(name,), ip_addresses=("127.0.0.1",))
    prefix = f"INFERPLANE_{service.upper()}_"
    env = {
        **os.environ,
        prefix + "DATA_DIR": str(tmp_path),
        prefix + "JSON_LOGS": "true",
        prefix + "TLS_DIR": str(pki),
    }
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
        with PeerSecurity(pki, ADMIN).channel(f"127.0.0.1:{port}") as channel:
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


@pytest.mark.parametrize("service", [s[0] for s in SERVICES])
def test_a_service_without_an_identity_does_not_start(service: str, tmp_path: Path) -> None:
    """Plaintext only behind the explicit development flag: no `tls_dir`, no `--plaintext` →
    exit code 1 and a message naming both."""
    prefix = f"INFERPLANE_{service.upper()}_"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERPLANE_")}
    env[prefix + "DATA_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", f"inferplane.{service}", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--plaintext" in done.stderr and "tls_dir" in done.stderr, done.stderr[-2000:]

"""RunConformance on the real replica process (`python -m inferplane.replica --transport
inproc`, the real engine): kimi-tiny passes the default thresholds with 12 live requests, and
kimi-tiny with a template that drops the tool declarations
(`inferplane.fixtures.kimi_tiny_broken_template`) fails replay. Prints each run's report and
its wall time (the gate's cost per release)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.conformance import ConformanceThresholds
from inferplane.fixtures import kimi_tiny as kt
from inferplane.fixtures.kimi_tiny_broken_template import build as build_broken
from inferplane.replica.testing.pipeline import kimi_tiny_spec
from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LIVE_REQUESTS = 12
SEED = 7


def _start(tmp_path: Path, name: str, model: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    spec = kimi_tiny_spec()
    spec.model_source = str(model)
    spec.dtype = "float32"
    spec.max_num_seqs = 16
    # The local stack's catalogue default (tool_choice "auto" constrained too).
    spec.constrain_tool_choice_auto = True
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json_format.MessageToJson(spec))
    port = free_port()
    log_path = tmp_path / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "inferplane.replica",
        *("--replica-id", name, "--spec-file", str(spec_file), "--port", str(port)),
        *("--transport", "inproc", "--device", "cpu", "--kv-cache-bytes", str(1 << 29)),
        *("--cache-root", str(tmp_path / "cache"), "--startup-timeout-seconds", "240"),
        "--plaintext",
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, port, log_path


async def _conformance(proc: subprocess.Popen[bytes], port: int) -> replica_pb2.ConformanceReport:
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = None
        while status != health_pb2.HealthCheckResponse.SERVING:
            assert proc.poll() is None, "the replica exited during start-up"
            assert time.monotonic() - started < 240, "not ready in 240 s"
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
            except grpc.aio.AioRpcError:
                status = None
            await asyncio.sleep(0.5)
        stub = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
        request = replica_pb2.RunConformanceRequest(
            live_requests=LIVE_REQUESTS, seed=SEED, timeout_seconds=120
        )
        called = time.monotonic()
        response = await stub.RunConformance(request, timeout=180)
        print(f"run_conformance_wall_seconds: {time.monotonic() - called:.1f}")
        return response.report


def _run(tmp_path: Path, name: str, model: Path) -> replica_pb2.ConformanceReport:
    proc, port, log_path = _start(tmp_path, name, model)
    try:
        report = asyncio.run(_conformance(proc, port))
    except BaseException:
        print(log_path.read_text()[-6000:])
        raise
    finally:
        procguard.kill_group(proc.pid)
        proc.wait(10)
    print(f"{name}: {json_format.MessageToJson(report, indent=None)}")
    return report


def test_kimi_tiny_passes_and_a_template_without_tools_fails_replay(tmp_path: Path) -> None:
    """kimi-tiny: every kimi_k2 public case replays, 12 live requests (auto, required, named)
    return their calls, schema-valid, no marker leaked: the default thresholds pass, within the
    run's bound. The broken template: the cases that declare tools fail replay (the prompt
    lacks them), so the gate fails, naming replay in its reason."""
    good = _run(tmp_path, "conformance-good", kt.model_path())
    passed, reason = ConformanceThresholds().check(good)
    print(reason)
    assert passed, (reason, list(good.replay_failures))
    assert good.replay_cases >= 60 and good.replay_passed == good.replay_cases
    assert good.live_requests == LIVE_REQUESTS and good.live_errors == 0
    assert good.tool_calls_expected == 8 and good.tool_calls_returned == 8
    assert good.leaked_markers == 0
    assert 0 < good.seconds < 120

    broken = _run(tmp_path, "conformance-broken", build_broken(tmp_path / "kimi-tiny-broken"))
    passed, reason = ConformanceThresholds().check(broken)
    print(reason)
    assert not passed and "replay" in reason
    assert broken.replay_passed < broken.replay_cases
    assert any("lacks the declared tools" in f for f in broken.replay_failures)

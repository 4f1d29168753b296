"""A fake replica process for the node-agent's tests: gRPC health and
`nodeagent.v1.ReplicaProcessService` (GetReplicaLoad, StartReplicaDrain; WatchReplicaState
with its in-flight count and draining flag only, no KV) on one port, without an
InferenceService or an engine of its own.

In-process (`FakeReplicaControl` + `serve_fake_replica`), a test sets its readiness and its
requests in flight by hand. As a process (`python -m inferplane.testing.fake_replica`), it takes
the replica process's command line: its parser declares the flags from the same contract
(`inferplane.replica_contract.ReplicaFlags.add_to`) as the replica's, so an unknown or missing
flag is an error here as there; it spawns `-- ENGINE ARGV` as its child (leading its own session, as
the replica process's does) when given, reports SERVING once
its engine's address accepts connections (at once for `inproc`), exits 1 when its engine
child dies, drains on SIGTERM for `--drain-grace-seconds` then exits 0, and dies with its
parent (`procguard`). These options, given before the others, make it misbehave:
    --fake-ready-after S     seconds before it reports SERVING (a slow engine start)
    --fake-fail-starts N     exit 3 at start the first N times (counted in --fake-state-file)
    --fake-state-file PATH   where start attempts are counted
    --fake-die-after S       exit 1 after S seconds of serving (a crash)
    --fake-in-flight N       report N requests in flight; once drained they end after
    --fake-drain-seconds S   S seconds
    --fake-spawn-child       start a sleeping child (an "engine core") when no engine is given
    --fake-ignore-sigterm    ignore SIGTERM (only SIGKILL stops it)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2, replica_pb2_grpc
from inferplane.replica_contract import ReplicaFlags, Transport
from inferplane.runtime.processes import procguard
from inferplane.runtime.security.identity import PeerSecurity

INFERENCE_SERVICE = "inferplane.inference.v1.InferenceService"
Context = grpc.aio.ServicerContext[Any, Any]
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeReplicaControl(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    """The replica process's control side with its state in plain attributes: `in_flight`
    (requests reported in flight), `draining`, `engine_ready`, and `drain_calls` (how many
    StartReplicaDrain it got). `health` serves gRPC health: SERVING only while the engine is
    ready and it is not draining, for service "" and InferenceService. RunConformance answers
    `conformance_report` (default: empty, nothing checked, which the default thresholds pass)
    and records each request in `conformance_requests`."""

    def __init__(self, replica_id: str = "fake", *, in_flight: int = 0) -> None:
        self.replica_id = replica_id
        self.in_flight = in_flight
        self.draining = False
        self.engine_ready = False
        self.drain_calls = 0
        self.state_interval_seconds = 1.0
        self.conformance_report = replica_pb2.ConformanceReport()
        self.conformance_requests: list[replica_pb2.RunConformanceRequest] = []
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]

    async def _publish(self) -> None:
        status = _SERVING if self.engine_ready and not self.draining else _NOT_SERVING
        for service in ("", INFERENCE_SERVICE):
            await self.health.set(service, status)

    async def set_ready(self, ready: bool = True) -> None:
        """The engine is (not) ready: health follows unless draining."""
        self.engine_ready = ready
        await self._publish()

    async def start_drain(self) -> None:
        """What StartReplicaDrain and SIGTERM do: admit nothing new, health NOT_SERVING."""
        self.draining = True
        await self._publish()

    async def GetReplicaLoad(
        self, request: replica_pb2.GetReplicaLoadRequest, context: Context
    ) -> replica_pb2.GetReplicaLoadResponse:
        return replica_pb2.GetReplicaLoadResponse(
            replica_id=self.replica_id,
            in_flight_requests=self.in_flight,
            draining=self.draining,
            engine_ready=self.engine_ready,
        )

    async def StartReplicaDrain(
        self, request: replica_pb2.StartReplicaDrainRequest, context: Context
    ) -> replica_pb2.StartReplicaDrainResponse:
        self.drain_calls += 1
        await self.start_drain()
        return replica_pb2.StartReplicaDrainResponse(in_flight_requests=self.in_flight)

    async def RunConformance(
        self, request: replica_pb2.RunConformanceRequest, context: Context
    ) -> replica_pb2.RunConformanceResponse:
        """`conformance_report`; FAILED_PRECONDITION before the engine is ready, as the real
        replica answers (code `replica_not_ready`)."""
        self.conformance_requests.append(request)
        if not self.engine_ready:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "replica_not_ready")
        return replica_pb2.RunConformanceResponse(report=self.conformance_report)

    async def ContinueGeneration(
        self, request: replica_pb2.ContinueGenerationRequest, context: Context
    ) -> AsyncIterator[replica_pb2.ContinueGenerationResponse]:
        """UNIMPLEMENTED: a fake replica has no engine to continue a stream on."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a fake replica generates nothing")
        yield replica_pb2.ContinueGenerationResponse()  # never reached: makes this a stream

    async def WatchReplicaState(
        self, request: replica_pb2.WatchReplicaStateRequest, context: Context
    ) -> AsyncIterator[replica_pb2.WatchReplicaStateResponse]:
        """The state a replica without an engine knows (in flight, draining; no KV), the
        first update a `reset`, then one every `state_interval_seconds` (a heartbeat)."""
        sequence = 0
        while True:
            sequence += 1
            yield replica_pb2.WatchReplicaStateResponse(
                sequence=sequence,
                reset=sequence == 1,
                in_flight_requests=self.in_flight,
                draining=self.draining,
            )
            await asyncio.sleep(self.state_interval_seconds)


async def serve_fake_replica(
    control: FakeReplicaControl,
    host: str = "127.0.0.1",
    port: int = 0,
    security: PeerSecurity | None = None,
) -> tuple[grpc.aio.Server, str]:
    """Starts a grpc.aio server with `control` and its health on `host:port` (0: any free
    port), with `security`'s credentials (plaintext by default); returns the server and its
    `host:port`. Stop it with `await server.stop(None)`."""
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(control, server)
    health_pb2_grpc.add_HealthServicer_to_server(control.health, server)
    bound = (security or PeerSecurity.plaintext()).add_port(server, f"{host}:{port}")
    await control._publish()
    await server.start()
    return server, f"{host}:{bound}"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The replica process's flags (strictly) and the fake's own; returns them and the
    engine's command line (after the first `--`)."""
    engine: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="fake-replica")
    ReplicaFlags.add_to(p)
    for name in ("--fake-ready-after", "--fake-die-after", "--fake-drain-seconds"):
        p.add_argument(name, type=float, default=0.0)
    p.add_argument("--fake-fail-starts", type=int, default=0)
    p.add_argument("--fake-state-file", type=Path)
    p.add_argument("--fake-in-flight", type=int, default=0)
    p.add_argument("--fake-spawn-child", action="store_true")
    p.add_argument("--fake-ignore-sigterm", action="store_true")
    opts = p.parse_args(argv)
    if (opts.transport == Transport.INPROC) == bool(engine):
        p.error("an engine command line after -- is given for http-completions / grpc only")
    if bool(opts.engine_address) != bool(engine):
        p.error("--engine-address goes with an engine command line")
    return opts, engine


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 0.2):
        return True
    return False


async def _serve(opts: argparse.Namespace, engine_argv: list[str]) -> int:
    spec = json_format.Parse(opts.spec_file.read_text(), nodeagent_pb2.ReplicaSpec())
    control = FakeReplicaControl(opts.replica_id, in_flight=opts.fake_in_flight)
    security = PeerSecurity(opts.tls_dir, opts.identity)
    server, address = await serve_fake_replica(control, opts.host, opts.port, security)
    if opts.metrics_port:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        from inferplane.runtime.service.metrics_http import ScrapedMetrics

        registry = CollectorRegistry()
        Gauge("inferplane_replica_fake_up", "1 while the fake replica serves", registry=registry)
        if opts.engine_metrics_url:  # a child engine's series, served with ours (as the real one)
            registry.register(ScrapedMetrics(opts.engine_metrics_url))
        else:
            Gauge("vllm:num_requests_running", "running", registry=registry)
        start_http_server(opts.metrics_port, addr=opts.metrics_host, registry=registry)
    child: subprocess.Popen[bytes] | None = None
    if engine_argv:
        # As the replica process does: its stdout is ours (the replica's log), it leads a
        # session of its own and dies with us (procguard, our pid as its parent).
        env = {**os.environ, procguard.PARENT_PID_ENV: str(os.getpid())}
        child = subprocess.Popen(
            engine_argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    elif opts.fake_spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(
        f"fake replica serving on {address} model={spec.served_model_name} "
        f"transport={opts.transport}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if opts.fake_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    started = time.monotonic()
    drained_at = 0.0
    code = 0
    while not stop.is_set():
        now = time.monotonic()
        if child is not None and engine_argv and child.poll() is not None:
            print(f"fake replica: engine exited with code {child.returncode}", flush=True)
            code = 1
            break
        if opts.fake_die_after and control.engine_ready and now - started >= opts.fake_die_after:
            print("fake replica dying as told", flush=True)
            os._exit(1)
        if (
            not control.engine_ready
            and now - started >= opts.fake_ready_after
            and (not opts.engine_address or _accepts(opts.engine_address))
        ):
            await control.set_ready(True)
            started = time.monotonic()  # --fake-die-after counts from ready
        if control.draining and control.in_flight:
            drained_at = drained_at or now
            if now - drained_at >= opts.fake_drain_seconds:
                control.in_flight = 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)
    if stop.is_set():  # SIGTERM: drain, give requests in flight the grace, then go
        await control.start_drain()
        deadline = time.monotonic() + opts.drain_grace_seconds
        while control.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    await server.stop(None)
    if child is not None and child.poll() is None:
        child.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(5)
    return code


def main(argv: list[str] | None = None) -> int:
    """Runs the fake replica process; returns its exit code."""
    opts, engine_argv = parse(sys.argv[1:] if argv is None else argv)
    if os.getpgrp() == os.getpid():
        procguard.guard_parent(poll_seconds=0.1, grace_seconds=1.0)
    if opts.fake_state_file is not None:
        count = int(opts.fake_state_file.read_text()) if opts.fake_state_file.exists() else 0
        opts.fake_state_file.write_text(str(count + 1))
        if count < opts.fake_fail_starts:
            print(f"fake replica failing start {count + 1}", flush=True)
            return 3
    return asyncio.run(_serve(opts, engine_argv))


if __name__ == "__main__":
    raise SystemExit(main())

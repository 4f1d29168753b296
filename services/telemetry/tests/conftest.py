"""Fixtures for the telemetry tests: the shared `FakeClock`, record builders, and a real
in-process telemetry server (grpc.aio on its own loop thread, loopback, free ports)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime import RunningServer
from inferplane.telemetry.app import TelemetryComponents, build_components
from inferplane.telemetry.settings import TelemetrySettings
from inferplane.testing.clock import EPOCH as CLOCK_EPOCH
from inferplane.testing.clock import FakeClock
from inferplane.testing.loop import LoopThread

EPOCH = CLOCK_EPOCH.timestamp()
"""Where the `clock` fixture starts, in Unix seconds (2026-01-01T00:00:00Z)."""


def record(
    *,
    request_id: str = "",
    source: str = "router",
    model: str = "kimi-tiny",
    deployment: str = "kimi-tiny",
    tenant: str = "acme",
    finished_at: float | None = None,
    ttft: float = 0.1,
    e2e: float = 1.0,
    itl: tuple[float, ...] = (),
    itl_mean: float = 0.0,
    queue: float = 0.0,
    completion_tokens: int = 10,
    error_code: str = "",
    tool_calls: int = 0,
    tool_calls_valid: int = 0,
    invalid_reasons: tuple[str, ...] = (),
    markers_leaked: int = 0,
) -> telemetry_pb2.RequestRecord:
    """A RequestRecord; `finished_at` (epoch seconds) sets start_time = finished_at - e2e."""
    rec = telemetry_pb2.RequestRecord(
        request_id=request_id,
        source=source,
        tenant=tenant,
        model=model,
        deployment=deployment,
        replica=f"{deployment}-0",
        queue_time_seconds=queue,
        time_to_first_token_seconds=ttft,
        inter_token_latency_mean_seconds=itl_mean,
        inter_token_latencies_seconds=list(itl),
        e2e_latency_seconds=e2e,
        prompt_tokens=20,
        cached_tokens=5,
        completion_tokens=completion_tokens,
        reasoning_tokens=3,
        finish_reason="error" if error_code else "stop",
        error_code=error_code,
        tool_calls=tool_calls,
        tool_calls_valid=tool_calls_valid,
        tool_call_invalid_reasons=list(invalid_reasons),
        markers_leaked=markers_leaked,
    )
    if finished_at is not None:
        stamp = timestamp_pb2.Timestamp()
        stamp.FromNanoseconds(round((finished_at - e2e) * 1e9))
        rec.start_time.CopyFrom(stamp)
    return rec


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclasses.dataclass
class Harness:
    """A running telemetry server (loops off: tests drive scrapes and evaluations)."""

    settings: TelemetrySettings
    clock: FakeClock
    components: TelemetryComponents
    loop: LoopThread
    server: RunningServer
    channel: grpc.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def stub(self) -> telemetry_pb2_grpc.TelemetryServiceStub:
        return telemetry_pb2_grpc.TelemetryServiceStub(self.channel)

    def send(self, *records: telemetry_pb2.RequestRecord) -> int:
        batch = telemetry_pb2.RecordRequestsRequest(records=list(records))
        return int(self.stub.RecordRequests(iter([batch]), timeout=5).accepted)

    def evaluate(self) -> Any:
        return self.loop.call(self.components.evaluator.evaluate)


def start_harness(clock: FakeClock, **overrides: Any) -> Harness:
    base: dict[str, Any] = {"port": 0, "metrics_port": 0, "json_logs": False}
    settings = TelemetrySettings(grace_period_seconds=0.5, **{**base, **overrides})
    loop = LoopThread()

    async def _start() -> tuple[TelemetryComponents, RunningServer]:
        # Built on the server's loop: grpc.aio and httpx bind to the loop they start on.
        components = build_components(settings, clock=clock, sleep=clock.sleep, run_loops=False)
        server = RunningServer(components.app(), settings)
        await server.start()
        return components, server

    components, server = loop.run(_start())
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return Harness(settings, clock, components, loop, server, channel)


def stop_harness(harness: Harness) -> None:
    harness.channel.close()
    harness.loop.run(harness.server.stop())
    harness.loop.close()


@pytest.fixture
def harness(clock: FakeClock) -> Iterator[Harness]:
    h = start_harness(clock)
    try:
        yield h
    finally:
        stop_harness(h)

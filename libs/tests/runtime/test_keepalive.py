"""HTTP/2 keepalive between our services: a client pinging at our keepalive interval keeps an
idle stream (a routing-table watch, an ADS stream) open instead of earning gRPC's GOAWAY
"too_many_pings", which fails the calls in flight."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferplane.edge._resources import UPSTREAM_KEEPALIVE
from inferplane.runtime import ServiceSettings, _server, grpc_options

pytestmark = pytest.mark.timeout(60)


async def _idle_watch_survives(server_options: list, client_options: list, seconds: float) -> str:  # type: ignore[type-arg]
    server = grpc.aio.server(options=server_options)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=client_options
        ) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            await call.read()  # the current status; then the stream stays idle
            deadline = time.monotonic() + seconds
            try:
                await asyncio.wait_for(call.read(), timeout=seconds)
            except TimeoutError:
                call.cancel()
                return "open"
            except grpc.aio.AioRpcError as exc:
                assert time.monotonic() < deadline
                return f"failed: {exc.details()}"
            return "unexpected message"
    finally:
        await server.stop(None)


@pytest.mark.anyio
async def test_idle_streams_survive_our_keepalive_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Scaled down 30x (30 s pings, 10 s accepted): a ping every second, accepted every 1/3 s.
    monkeypatch.setattr(_server, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(_server, "MIN_PING_INTERVAL_MS", 333)
    options = grpc_options(ServiceSettings())
    assert await _idle_watch_survives(options, options, 5.0) == "open"
    # Control: a server with gRPC's default ping policy cuts the same stream within seconds.
    default_server = [o for o in options if "min_ping_interval" not in o[0]]
    outcome = await _idle_watch_survives(default_server, options, 5.0)
    assert outcome.startswith("failed") and "ping" in outcome.lower()


def test_envoy_pings_no_faster_than_our_servers_accept() -> None:
    interval_ms = int(UPSTREAM_KEEPALIVE["interval"].removesuffix("s")) * 1000
    assert interval_ms >= _server.MIN_PING_INTERVAL_MS
    assert _server.KEEPALIVE_TIME_MS >= _server.MIN_PING_INTERVAL_MS


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"

"""`AuthUsageSink` against a small fake UsageService over real gRPC, and the router's metrics.

Invariants: `record()` never blocks or raises; reports wait (bounded, in order) while auth is
down and arrive once it is back; a refused batch is dropped and counted, never re-sent forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.features import RequestFeatures
from inferplane.router.metrics import AdmissionCollector, RouterMetrics
from inferplane.router.policies import default_registry
from inferplane.router.routes import RouteTable
from inferplane.router.usage import (
    AuthUsageSink,
    UsageRecord,
    UsageSinkSettings,
)
from inferplane.runtime.processes.ports import free_port
from inferplane.testing.clock import FakeClock
from inferplane.wire import headers

from .fakes import FakeScheduler, endpoints, route


class FakeUsageService(usage_pb2_grpc.UsageServiceServicer):  # type: ignore[misc]
    """Keeps every report; refuses calls without `token` when one is set."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.reports: list[usage_pb2.RequestUsage] = []
        self.calls = 0

    async def ReportUsage(self, request: Any, context: Any) -> usage_pb2.ReportUsageResponse:
        self.calls += 1
        if self.token and dict(context.invocation_metadata()).get(headers.INTERNAL_TOKEN) != (
            self.token
        ):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong internal token")
        self.reports.extend(request.usage)
        return usage_pb2.ReportUsageResponse()


async def _serve(servicer: FakeUsageService, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    usage_pb2_grpc.add_UsageServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


def _usage(i: int) -> UsageRecord:
    return UsageRecord("k1", f"req-{i}", "m", prompt_tokens=3, completion_tokens=i, end_time=5.0)


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_reports_wait_while_auth_is_down_and_arrive_in_order_when_it_is_back() -> None:
    async def scenario() -> None:
        port = free_port()
        waits: list[float] = []

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            await asyncio.sleep(0.01)

        registry = CollectorRegistry()
        sink = AuthUsageSink(
            UsageSinkSettings(
                target=f"127.0.0.1:{port}",
                internal_token="t0k",
                capacity=4,
                rpc_timeout_seconds=0.5,
                backoff_initial_seconds=0.2,
                backoff_max_seconds=1.0,
            ),
            registry,
            sleep=sleep,
        )
        await sink.start()
        try:
            for i in range(5):  # the fifth does not fit: dropped, counted, no exception
                sink.record(_usage(i))
            await _until(lambda: len(waits) >= 3)  # backing off while auth is down
            assert sink.pending == 4
            assert all(0 <= w <= 1.0 for w in waits)
            auth = FakeUsageService(token="t0k")
            server, _ = await _serve(auth, port)
            try:
                await _until(lambda: len(auth.reports) == 4 and sink.pending == 0)
            finally:
                await server.stop(0)
        finally:
            await sink.close(timeout_seconds=0.5)
        assert [r.request_id for r in auth.reports] == [f"req-{i}" for i in range(4)]
        assert auth.reports[3].prompt_tokens + auth.reports[3].completion_tokens == 6
        assert auth.reports[0].end_time.seconds == 5
        dropped = registry.get_sample_value(
            "inferplane_router_usage_reports_dropped_total", {"reason": "buffer_full"}
        )
        assert dropped == 1
        assert registry.get_sample_value("inferplane_router_usage_reports_sent_total") == 4

    asyncio.run(scenario())


def test_a_refused_batch_is_dropped_and_counted_not_retried() -> None:
    async def scenario() -> None:
        auth = FakeUsageService(token="right")
        server, port = await _serve(auth)
        registry = CollectorRegistry()
        sink = AuthUsageSink(
            UsageSinkSettings(target=f"127.0.0.1:{port}", internal_token="wrong"), registry
        )
        await sink.start()
        try:
            sink.record(_usage(1))
            sink.record(_usage(2))
            await _until(lambda: sink.pending == 0)
            await asyncio.sleep(0.05)
        finally:
            await sink.close()
            await server.stop(0)
        assert auth.reports == [] and auth.calls == 1
        rejected = registry.get_sample_value(
            "inferplane_router_usage_reports_dropped_total", {"reason": "rejected"}
        )
        assert rejected == 2

    asyncio.run(scenario())


def test_admission_metrics_show_queue_slots_breakers_and_fallbacks() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        admission = Admission(
            default_registry(),
            AdmissionSettings(breaker_failures=1, breaker_open_seconds=5),
            clock,
            FakeScheduler(clock),
        )
        r = route(2, cap=1)
        admission.apply(RouteTable.of([r]))
        registry = CollectorRegistry()
        metrics = RouterMetrics(registry)
        registry.register(AdmissionCollector(admission, clock.monotonic))
        features = RequestFeatures()
        first = await admission.acquire(r, features)
        second = await admission.acquire(r, features)
        waiting = asyncio.ensure_future(admission.acquire(r, features))
        await asyncio.sleep(0)
        first.failed()  # one transport failure opens r0's breaker (threshold 1)
        metrics.fallbacks_served.inc()

        def value(name: str, labels: dict[str, str]) -> float | None:
            return registry.get_sample_value(name, labels)

        assert value("inferplane_router_queued_requests", {"deployment": "d"}) == 1
        failed = first.endpoint.replica_id
        other = second.endpoint.replica_id
        assert {failed, other} == {e.replica_id for e in endpoints(2)}
        slots = {"deployment": "d", "replica": other}
        assert value("inferplane_router_in_flight_requests", slots) == 1
        open_ = {"deployment": "d", "replica": failed}
        assert value("inferplane_router_circuit_breaker_state", {**open_, "state": "open"}) == 1
        assert value("inferplane_router_circuit_breaker_state", {**open_, "state": "closed"}) == 0
        clock.advance(5)
        assert (
            value("inferplane_router_circuit_breaker_state", {**open_, "state": "half_open"}) == 1
        )
        assert value("inferplane_router_fallbacks_served_total", {}) == 1
        first.release()
        (await waiting).release()
        second.release()

    asyncio.run(scenario())

"""`AuthUsageSink` (the durable usage outbox) against a small fake UsageService over real
gRPC, and the router's metrics.

Invariants: `record()` never blocks or raises; every report is written to the outbox's file
before anything acknowledges it; reports wait there (in order) while auth is down and arrive
once it is back; a router killed after a conclusion delivers it from the file after its
restart, once (auth keeps one row per request id); a refused batch is dropped and counted,
never re-sent forever.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.features import RequestFeatures
from inferplane.router.metrics import AdmissionCollector, RouterMetrics
from inferplane.router.policies import default_registry
from inferplane.router.records import ConcludedRequest
from inferplane.router.routes import RouteTable
from inferplane.router.usage import AuthUsageSink, UsageSinkSettings
from inferplane.runtime.processes.ports import free_port
from inferplane.testing.clock import FakeClock
from inferplane.wire import headers

from .fakes import FakeScheduler, endpoints, route


class FakeUsageService(usage_pb2_grpc.UsageServiceServicer):  # type: ignore[misc]
    """Keeps every report (`reports`) and, as auth's ledger does, one row per request id
    (`rows`); refuses calls without `token` when one is set."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.reports: list[usage_pb2.RequestUsage] = []
        self.rows: dict[str, usage_pb2.RequestUsage] = {}
        self.calls = 0

    async def ReportUsage(self, request: Any, context: Any) -> usage_pb2.ReportUsageResponse:
        self.calls += 1
        if self.token and dict(context.invocation_metadata()).get(headers.INTERNAL_TOKEN) != (
            self.token
        ):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong internal token")
        self.reports.extend(request.usage)
        for usage in request.usage:
            self.rows.setdefault(usage.request_id, usage)
        return usage_pb2.ReportUsageResponse()


async def _serve(servicer: FakeUsageService, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    usage_pb2_grpc.add_UsageServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


def _usage(i: int) -> ConcludedRequest:
    return ConcludedRequest(
        request_id=f"req-{i}",
        key_id="k1",
        model="m",
        prompt_tokens=3,
        completion_tokens=i,
        end_time=5.0,
        api="chat",
    )


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _settings(port: int, **kw: Any) -> UsageSinkSettings:
    return UsageSinkSettings(
        target=f"127.0.0.1:{port}",
        rpc_timeout_seconds=0.5,
        backoff_initial_seconds=0.02,
        backoff_max_seconds=0.1,
        **kw,
    )


def test_while_auth_is_down_the_outbox_grows_on_disk_and_drains_in_order_when_it_is_back(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        port = free_port()
        registry = CollectorRegistry()
        sink = AuthUsageSink(
            _settings(port, internal_token="t0k"), registry, spool_path=tmp_path / "outbox.db"
        )
        await sink.start()
        try:
            positions = [sink.record(_usage(i)) for i in range(50)]
            assert positions == list(range(1, 51))
            await asyncio.wait_for(sink.durable(50), 1.0)  # on disk within a few ms
            assert sink.spooled == 50 and sink.pending == 0
            await asyncio.sleep(0.2)  # auth still down: the sender backs off, keeps them
            assert sink.spooled == 50
            gauge = "inferplane_router_usage_reports_buffered"
            assert registry.get_sample_value(gauge) == 50
            auth = FakeUsageService(token="t0k")
            server, _ = await _serve(auth, port)
            try:
                await _until(lambda: sink.spooled == 0)
            finally:
                await server.stop(0)
        finally:
            await sink.close(timeout_seconds=0.5)
        assert [r.request_id for r in auth.reports] == [f"req-{i}" for i in range(50)]
        assert auth.reports[3].prompt_tokens + auth.reports[3].completion_tokens == 6
        assert auth.reports[0].end_time.seconds == 5 and auth.reports[0].api == "chat"
        assert registry.get_sample_value("inferplane_router_usage_reports_sent_total") == 50

    asyncio.run(scenario())


def test_a_router_killed_after_concluding_delivers_from_the_outbox_after_restart_once(
    tmp_path: Path,
) -> None:
    """The first process concludes 20 requests; auth acknowledges the first batch but the
    process dies before it removed it from the file (its send is cut right after auth's
    answer), and before it sent the rest. The next process on the same file delivers all of
    them: auth has each request once (it drops the re-sent copies by request id)."""

    async def scenario() -> None:
        auth = FakeUsageService()
        server, port = await _serve(auth)
        path = tmp_path / "outbox.db"
        try:
            first = AuthUsageSink(
                _settings(port, batch_size=8), CollectorRegistry(), spool_path=path
            )
            acknowledged = asyncio.Event()
            real_send = first._send

            async def send_then_die(batch: list[usage_pb2.RequestUsage]) -> None:
                await real_send(batch)  # auth has it ...
                acknowledged.set()
                await asyncio.Event().wait()  # ... and the process dies before the trim

            first._outbox._send_batch = send_then_die
            for i in range(20):
                first.record(_usage(i))
            await first.start()
            await asyncio.wait_for(first.durable(20), 1.0)
            await asyncio.wait_for(acknowledged.wait(), 2.0)
            # SIGKILL: nothing runs any more; the SQLite file is all that is left.
            for task in (first._outbox._writer, first._outbox._sender):
                assert task is not None
                task.cancel()
            assert len(auth.reports) == 8

            second = AuthUsageSink(_settings(port), CollectorRegistry(), spool_path=path)
            assert second.spooled == 20  # the acknowledged batch was never trimmed
            await second.start()
            try:
                await _until(lambda: second.spooled == 0)
            finally:
                await second.close(timeout_seconds=0.5)
        finally:
            await server.stop(0)
        assert len(auth.reports) == 28  # the first batch twice on the wire ...
        assert sorted(auth.rows) == sorted(f"req-{i}" for i in range(20))  # ... once in the ledger

    asyncio.run(scenario())


class StalledUsageService(FakeUsageService):
    """Auth that takes every call and never answers (a stalled database, say)."""

    async def ReportUsage(self, request: Any, context: Any) -> usage_pb2.ReportUsageResponse:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_a_stalled_auth_delays_neither_record_nor_durability(tmp_path: Path) -> None:
    """With auth taking calls and never answering, `record` returns at once and the report
    is durable within the flush interval: what the picker's conclusion (and a replica's
    acknowledged report) depend on never waits for auth."""

    async def scenario() -> None:
        auth = StalledUsageService()
        server, port = await _serve(auth)
        sink = AuthUsageSink(
            UsageSinkSettings(target=f"127.0.0.1:{port}", rpc_timeout_seconds=30.0),
            CollectorRegistry(),
            spool_path=tmp_path / "outbox.db",
        )
        await sink.start()
        try:
            sink.record(_usage(0))
            await _until(lambda: auth.calls == 1)  # the first batch hangs in auth
            loop = asyncio.get_running_loop()
            started = loop.time()
            position = sink.record(_usage(1))
            recorded = loop.time() - started
            await asyncio.wait_for(sink.durable(position), 1.0)
            durable = loop.time() - started
            assert recorded < 0.01 and durable < 0.5, (recorded, durable)
            assert sink.spooled == 2  # both wait for auth's answer, on disk
        finally:
            await sink.close(timeout_seconds=0.1)
            await server.stop(0)

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
            await _until(lambda: auth.calls == 1 and sink.spooled == 0 and sink.pending == 0)
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

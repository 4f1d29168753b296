"""RecordSink under telemetry outages: buffered while down, delivered in order and once when
back, bounded with a dropped counter, never raising on the request path.

The telemetry side is a small hand-written fake servicer on a real grpc.aio server bound to a
loopback port that the test stops and restarts; time moves through an injected clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime.processes.ports import free_port
from inferplane.telemetry_client import RecordSink, SinkSettings
from inferplane.testing.clock import FakeClock


class FakeTelemetry(telemetry_pb2_grpc.TelemetryServiceServicer):  # type: ignore[misc]
    """Keeps the request ids it received; fails the next calls with `fail_with` codes."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.fail_with: list[grpc.StatusCode] = []
        self.calls = 0

    async def RecordRequests(
        self, request_iterator: AsyncIterator[telemetry_pb2.RecordRequestsRequest], context: Any
    ) -> telemetry_pb2.RecordRequestsResponse:
        self.calls += 1
        batches = [batch async for batch in request_iterator]
        if self.fail_with:
            await context.abort(self.fail_with.pop(0), "told to fail")
        ids = [r.request_id for b in batches for r in b.records]
        self.received += ids
        return telemetry_pb2.RecordRequestsResponse(accepted=len(ids))


class Telemetry:
    """A stoppable, restartable server on a fixed loopback port."""

    def __init__(self, fake: FakeTelemetry) -> None:
        self.fake = fake
        self.port = free_port()
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(self.fake, self.server)
        assert self.server.add_insecure_port(f"127.0.0.1:{self.port}") == self.port
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


def rec(i: int) -> telemetry_pb2.RequestRecord:
    return telemetry_pb2.RequestRecord(request_id=f"r{i}", source="router", model="m")


def dropped(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value(
        "inferplane_telemetry_records_dropped_total", {"reason": reason}
    )
    return value or 0.0


async def eventually(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Waits for a network-side effect (the loop keeps running), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def run(
    body: Callable[[Telemetry, RecordSink, CollectorRegistry, FakeClock], Awaitable[None]],
    **settings: Any,
) -> None:
    async def main() -> None:
        telemetry = Telemetry(FakeTelemetry())
        clock = FakeClock()
        registry = CollectorRegistry()
        sink = RecordSink(
            SinkSettings(
                target=f"127.0.0.1:{telemetry.port}",
                **{
                    "capacity": 100,
                    "batch_size": 10,
                    "flush_interval_seconds": 1.0,
                    "backoff_initial_seconds": 0.01,
                    "backoff_max_seconds": 0.2,
                    "rpc_timeout_seconds": 2.0,
                    **settings,
                },
            ),
            registry,
            clock=clock,
            sleep=clock.sleep,
        )
        await sink.start()
        try:
            await body(telemetry, sink, registry, clock)
        finally:
            await sink.close(timeout_seconds=1)
            await telemetry.stop()

    asyncio.run(main())


def test_outage_buffers_then_delivers_everything_once_in_order() -> None:
    """Telemetry down → records wait (sender backs off); telemetry back → every record arrives,
    in order, none twice, nothing dropped."""

    async def body(
        t: Telemetry, sink: RecordSink, registry: CollectorRegistry, clock: FakeClock
    ) -> None:
        for i in range(55):
            sink.record(rec(i))
        await eventually(lambda: len(clock.slept) >= 3, "backoff while telemetry is down")
        assert sink.pending == 55
        await t.start()
        # The fake counts a batch before its answer reaches the sink: wait for both.
        await eventually(
            lambda: len(t.fake.received) == 55 and sink.pending == 0, "all records delivered"
        )
        assert t.fake.received == [f"r{i}" for i in range(55)]
        assert sink.pending == 0
        assert dropped(registry, "buffer_full") == 0
        assert registry.get_sample_value("inferplane_telemetry_records_sent_total") == 55
        # The telemetry service restarts again: the next records wait and then arrive.
        await t.stop()
        for i in range(55, 70):
            sink.record(rec(i))
        clock.advance(2)  # the partial batch is due
        await eventually(lambda: t.fake.calls >= 0 and len(clock.slept) >= 6, "backoff again")
        await t.start()
        await eventually(lambda: len(t.fake.received) == 70, "records after the 2nd restart")
        assert t.fake.received == [f"r{i}" for i in range(70)]

    run(body)


def test_failed_batch_goes_back_to_the_front() -> None:
    """A call that fails (UNAVAILABLE, DEADLINE_EXCEEDED) re-sends the same records first."""

    async def body(
        t: Telemetry, sink: RecordSink, registry: CollectorRegistry, clock: FakeClock
    ) -> None:
        t.fake.fail_with = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED]
        await t.start()
        for i in range(25):
            sink.record(rec(i))
        clock.advance(2)
        await eventually(lambda: len(t.fake.received) == 25, "delivery after two failures")
        assert t.fake.received == [f"r{i}" for i in range(25)]
        assert t.fake.calls >= 5

    run(body)


def test_overflow_drops_the_newest_and_counts_them() -> None:
    """With telemetry down past the buffer, records beyond capacity are dropped and counted;
    the ones kept still arrive."""

    async def body(
        t: Telemetry, sink: RecordSink, registry: CollectorRegistry, clock: FakeClock
    ) -> None:
        for i in range(35):
            sink.record(rec(i))
        assert sink.pending == 20
        assert dropped(registry, "buffer_full") == 15
        await t.start()
        await eventually(lambda: len(t.fake.received) == 20, "the kept records")
        assert t.fake.received == [f"r{i}" for i in range(20)]

    run(body, capacity=20, batch_size=5)


def test_rejected_batches_are_dropped_not_retried_and_bad_input_never_raises() -> None:
    async def body(
        t: Telemetry, sink: RecordSink, registry: CollectorRegistry, clock: FakeClock
    ) -> None:
        t.fake.fail_with = [grpc.StatusCode.INVALID_ARGUMENT]
        await t.start()
        for i in range(20):
            sink.record(rec(i))
        sink.record(None)  # type: ignore[arg-type]
        sink.record("not a record")  # type: ignore[arg-type]
        await eventually(lambda: len(t.fake.received) == 10, "the second batch")
        assert t.fake.received == [f"r{i}" for i in range(10, 20)]
        assert dropped(registry, "rejected") == 10
        assert dropped(registry, "invalid") == 2

    run(body)


def test_close_delivers_what_is_buffered() -> None:
    async def main() -> None:
        telemetry = Telemetry(FakeTelemetry())
        await telemetry.start()
        sink = RecordSink(
            SinkSettings(target=f"127.0.0.1:{telemetry.port}", flush_interval_seconds=3600),
            CollectorRegistry(),
        )
        await sink.start()
        for i in range(3):
            sink.record(rec(i))
        await sink.close()
        assert telemetry.fake.received == ["r0", "r1", "r2"]
        await telemetry.stop()

    asyncio.run(main())

"""`OutcomeReporter` against a small fake `OutcomeService` (the router's) over real gRPC on
loopback: batching per picker address, what a batch carries, and what an unreachable picker
costs the request path."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.router.v1 import outcome_pb2, outcome_pb2_grpc
from inferplane.routing_client import OutcomeReporter, OutcomeReporterSettings
from inferplane.wire import ResponseSummary


class FakeOutcomeService(outcome_pb2_grpc.OutcomeServiceServicer):  # type: ignore[misc]
    """Records every `ReportOutcomes` batch as (request id, summary) pairs."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, dict[str, str]]]] = []

    async def ReportOutcomes(
        self, request: outcome_pb2.ReportOutcomesRequest, context: Any
    ) -> outcome_pb2.ReportOutcomesResponse:
        self.batches.append([(o.request_id, dict(o.summary)) for o in request.outcomes])
        return outcome_pb2.ReportOutcomesResponse(matched=len(request.outcomes))


async def _picker() -> tuple[FakeOutcomeService, grpc.aio.Server, str]:
    fake = FakeOutcomeService()
    server = grpc.aio.server()
    outcome_pb2_grpc.add_OutcomeServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return fake, server, f"127.0.0.1:{port}"


def _summary(tokens: int, finish: str = "stop") -> ResponseSummary:
    return ResponseSummary(
        replica_id="r1",
        prompt_tokens=7,
        completion_tokens=tokens,
        finish_reason=finish,
        ttft_seconds=0.012,
    )


def _value(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


async def _until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_reports_reach_each_picker_batched_with_their_ids_and_summaries() -> None:
    """Each picker gets the reports of the requests it picked, in one batch per flush over its
    own channel, each outcome carrying the request id and exactly the summary's trailer keys
    and values (what the router parses with `ResponseSummary.from_metadata`); the metrics count
    them once for all addresses."""

    async def scenario() -> None:
        a, server_a, address_a = await _picker()
        b, server_b, address_b = await _picker()
        registry = CollectorRegistry()
        reporter = OutcomeReporter(registry)
        await reporter.start()
        try:
            for n in range(3):
                reporter.report(address_a, f"a-{n}", _summary(n + 1))
            reporter.report(address_b, "b-0", _summary(9, "length"))
            reporter.report(
                address_b, "b-1", ResponseSummary(replica_id="r1", finish_reason="abort")
            )
            await _until(lambda: a.batches and b.batches and reporter.pending == 0)
        finally:
            await reporter.close()
            await server_a.stop(0)
            await server_b.stop(0)
        assert a.batches == [[(f"a-{n}", dict(_summary(n + 1).to_metadata())) for n in range(3)]]
        assert b.batches == [
            [
                ("b-0", dict(_summary(9, "length").to_metadata())),
                ("b-1", {"x-inferplane-replica": "r1", "x-inferplane-finish-reason": "abort"}),
            ]
        ]
        assert ResponseSummary.from_metadata(b.batches[0][0][1]) == _summary(9, "length")
        assert set(reporter.addresses) == {address_a, address_b}
        assert _value(registry, "inferplane_replica_outcomes_sent_total") == 5
        assert _value(registry, "inferplane_replica_outcomes_buffered") == 0

    asyncio.run(scenario())


def test_reports_before_start_are_sent_once_started() -> None:
    """A report made before `start()` (a request racing the composition root) is kept and
    delivered once the reporter starts."""

    async def scenario() -> None:
        fake, server, address = await _picker()
        reporter = OutcomeReporter(CollectorRegistry())
        reporter.report(address, "early", _summary(2))
        await reporter.start()
        try:
            await _until(lambda: fake.batches and reporter.pending == 0)
        finally:
            await reporter.close()
            await server.stop(0)
        assert [[rid for rid, _ in batch] for batch in fake.batches] == [["early"]]

    asyncio.run(scenario())


def test_an_unreachable_picker_drops_beyond_capacity_without_blocking() -> None:
    """A picker that is gone never slows the request path: `report()` returns at once, the
    address holds at most `capacity` outcomes and the newest beyond it are dropped and counted
    (buffer_full); what is left at close is counted as dropped too, and so is a report after
    close. Reports without an address or request id are dropped as invalid, never sent."""

    async def scenario() -> None:
        with socket_bound() as address:  # a port nothing serves
            registry = CollectorRegistry()
            reporter = OutcomeReporter(
                registry,
                OutcomeReporterSettings(capacity=3, backoff_initial_seconds=0.01),
            )
            await reporter.start()
            started = time.perf_counter()
            for n in range(10):
                reporter.report(address, f"r-{n}", _summary(n))
            elapsed = time.perf_counter() - started
            reporter.report("", "r-x", _summary(1))
            reporter.report(address, "", _summary(1))
            await asyncio.sleep(0.2)  # the sender tries and fails meanwhile
            assert elapsed < 0.05
            assert reporter.pending == 3
            assert _value(registry, "inferplane_replica_outcomes_buffered") == 3
            dropped = "inferplane_replica_outcomes_dropped_total"
            assert _value(registry, dropped, {"reason": "buffer_full"}) == 7
            assert _value(registry, dropped, {"reason": "invalid"}) == 2
            await reporter.close(timeout_seconds=0.5)
            assert _value(registry, dropped, {"reason": "buffer_full"}) == 10
            assert _value(registry, "inferplane_replica_outcomes_sent_total") == 0
            reporter.report(address, "late", _summary(1))
            assert reporter.pending == 0
            assert _value(registry, dropped, {"reason": "closed"}) == 1

    asyncio.run(scenario())


def test_close_flushes_what_is_buffered() -> None:
    """`close()` delivers what the last requests reported (the replica closes the reporter
    after its server stopped), even before the flush interval elapsed."""

    async def scenario() -> None:
        fake, server, address = await _picker()
        reporter = OutcomeReporter(
            CollectorRegistry(), OutcomeReporterSettings(flush_interval_seconds=60.0)
        )
        await reporter.start()
        reporter.report(address, "last", _summary(3))
        await asyncio.sleep(0.05)  # the sink starts; the interval keeps the item buffered
        assert not fake.batches
        await reporter.close()
        await server.stop(0)
        assert [[rid for rid, _ in batch] for batch in fake.batches] == [["last"]]

    asyncio.run(scenario())


class socket_bound:
    """A loopback `host:port` bound but never listening: connections to it are refused."""

    def __enter__(self) -> str:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

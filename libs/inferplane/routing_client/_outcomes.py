"""`OutcomeReporter`: a replica's non-blocking hand-off of finished requests' summaries to the
endpoint picker (the router) that picked them, `inferplane.router.v1.OutcomeService`.

The picker reads a request's `ResponseSummary` from the response trailers Envoy shows it, but
those are lost when the client closes its connection right after `data: [DONE]` (Envoy cancels
the picker's side stream). The replica therefore also reports the summary to the picker named
in the request's `x-inferplane-picker` header (`inferplane.wire.headers.PICKER`), matched there by
`x-request-id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry

from inferplane.api.router.v1 import outcome_pb2, outcome_pb2_grpc
from inferplane.runtime.delivery.batching import (
    BatchingSettings,
    BatchMetrics,
    GrpcSink,
    GrpcSinkSettings,
    Sleep,
)
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.runtime.time.clock import Clock
from inferplane.wire import ResponseSummary

__all__ = ["OutcomeMetrics", "OutcomeReporter", "OutcomeReporterSettings"]

log = structlog.get_logger("inferplane.routing_client.outcomes")

_Item = tuple[str, ResponseSummary]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeReporterSettings(BatchingSettings):
    """How an `OutcomeReporter` buffers and sends, per picker address (`BatchingSettings`).

    A picker waits only a short while for a report after a stream ended without trailers, so
    batches are small and go after 20 ms at most; `capacity` bounds each address's buffer
    (a picker that is gone costs at most that much memory, the rest is dropped and counted).

    Attributes:
        rpc_timeout_seconds: the deadline of one `ReportOutcomes` call.
        max_addresses: distinct picker addresses served at most (routers are few); reports to
            further ones are dropped (`reason="address_limit"`).
        security: the identity the replica presents to the pickers (plaintext by default).
    """

    capacity: int = 2_000
    batch_size: int = 64
    flush_interval_seconds: float = 0.02
    backoff_initial_seconds: float = 0.1
    backoff_max_seconds: float = 5.0
    rpc_timeout_seconds: float = 2.0
    max_addresses: int = 64
    security: PeerSecurity = dataclasses.field(default_factory=PeerSecurity.plaintext)

    def for_address(self, address: str) -> GrpcSinkSettings:
        """One address's sink settings."""
        return GrpcSinkSettings(
            target=address,
            capacity=self.capacity,
            batch_size=self.batch_size,
            flush_interval_seconds=self.flush_interval_seconds,
            backoff_initial_seconds=self.backoff_initial_seconds,
            backoff_max_seconds=self.backoff_max_seconds,
            rpc_timeout_seconds=self.rpc_timeout_seconds,
            security=self.security,
        )


class OutcomeMetrics(BatchMetrics):
    """`inferplane_replica_outcomes_{sent_total,dropped_total{reason},buffered}`, one set for
    all picker addresses (`buffered` is their sum, read at scrape time)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(
            registry,
            "inferplane_replica_outcomes",
            sent_help="Request outcomes delivered to the endpoint pickers that picked them.",
            dropped_help="Request outcomes dropped before reaching their picker: buffer_full "
            "(the picker's buffer was full: unreachable too long, or left at close), rejected "
            "(the picker refused the batch), invalid (no address or request id), address_limit "
            "(too many distinct picker addresses), closed (reported after close).",
            buffered_help="Request outcomes waiting in the buffers or in flight.",
            reasons=("buffer_full", "rejected", "invalid", "address_limit", "closed"),
        )


class _AddressSink(GrpcSink[_Item]):
    """Batches of one picker address over `ReportOutcomes`."""

    def __init__(
        self,
        settings: GrpcSinkSettings,
        metrics: OutcomeMetrics,
        *,
        clock: Clock | None,
        sleep: Sleep,
        channel_options: Sequence[tuple[str, Any]],
    ) -> None:
        super().__init__(
            settings,
            metrics,
            name=f"picker-outcomes:{settings.target}",
            clock=clock,
            sleep=sleep,
            channel_options=channel_options,
        )
        self._stub: Any = None
        self.address = settings.target
        self.started = False

    def put(self, item: _Item) -> None:
        self._put(item)

    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = outcome_pb2_grpc.OutcomeServiceStub(channel)

    async def _send(self, batch: list[_Item]) -> None:
        request = outcome_pb2.ReportOutcomesRequest(
            outcomes=[
                outcome_pb2.Outcome(request_id=request_id, summary=dict(summary.to_metadata()))
                for request_id, summary in batch
            ]
        )
        await self._stub.ReportOutcomes(request, timeout=self._settings.rpc_timeout_seconds)


class OutcomeReporter:
    """Reports finished requests' summaries to the pickers that picked them, in the background.

    `report()` is what the request path calls: it never blocks, never raises and never does
    I/O. Each picker address gets its own batching sink
    (`inferplane.runtime.delivery.batching`), made
    on its first report and kept (routers are few; at most `max_addresses`): batches of up to
    `batch_size` outcomes, a partial one after `flush_interval_seconds`, re-sent with backoff
    while the picker is unreachable, at most `capacity` outcomes held per address (the newest
    is dropped beyond, `reason="buffer_full"`). Pickers ignore ids they do not know or already
    concluded, so a late or repeated report is harmless.

    Args:
        registry: where `inferplane_replica_outcomes_*` are registered (once, all addresses).
        settings: batching per address.
        clock, sleep: the batchers' time sources (tests).
        channel_options: extra options for each picker's channel.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        settings: OutcomeReporterSettings | None = None,
        *,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._settings = settings or OutcomeReporterSettings()
        self.metrics = OutcomeMetrics(registry)
        self.metrics.buffered.set_function(lambda: float(self.pending))
        self._clock = clock
        self._sleep = sleep
        self._channel_options = tuple(channel_options)
        self._sinks: dict[str, _AddressSink] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def addresses(self) -> tuple[str, ...]:
        """The picker addresses reported to so far."""
        return tuple(self._sinks)

    @property
    def pending(self) -> int:
        """Outcomes buffered or in flight, all addresses."""
        return sum(sink.pending for sink in list(self._sinks.values()))

    def report(self, address: str, request_id: str, summary: ResponseSummary) -> None:
        """Queues one request's summary for the picker at `address` (`host:port`, from the
        request's `x-inferplane-picker`). Never blocks, never raises, no I/O; any thread."""
        try:
            if not address or not request_id:
                self.metrics.dropped.labels("invalid").inc()
                return
            if self._closed:
                self.metrics.dropped.labels("closed").inc()
                return
            sink = self._sinks.get(address) or self._sink(address)
            if sink is not None:
                sink.put((request_id, summary))
        except Exception:  # the request path must never see the reporter's problems
            with contextlib.suppress(Exception):
                log.exception("outcome_report_failed", picker=address, request_id=request_id)

    def _sink(self, address: str) -> _AddressSink | None:
        """The sink of a new address (made, and started on the loop once the reporter is), or
        None when the report is dropped."""
        with self._lock:
            if self._closed:  # closed meanwhile
                self.metrics.dropped.labels("closed").inc()
                return None
            sink = self._sinks.get(address)
            if sink is not None:
                return sink
            if len(self._sinks) >= self._settings.max_addresses:
                self.metrics.dropped.labels("address_limit").inc()
                log.warning("outcome_picker_address_limit", picker=address)
                return None
            sink = _AddressSink(
                self._settings.for_address(address),
                self.metrics,
                clock=self._clock,
                sleep=self._sleep,
                channel_options=self._channel_options,
            )
            self._sinks[address] = sink
            loop = self._loop
        if loop is not None:
            # Starting opens a channel: on the loop, not on the request path.
            loop.call_soon_threadsafe(self._start_soon, sink)
        return sink

    def _start_soon(self, sink: _AddressSink) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._start_sink(sink))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_sink(self, sink: _AddressSink) -> None:
        if sink.started:
            return
        sink.started = True
        try:
            await sink.start()
        except Exception:
            log.exception("outcome_sink_start_failed", picker=sink.address)

    async def start(self) -> None:
        """Binds the reporter to the running loop and starts the sinks of the addresses reported
        to before (later ones start on their first report). Idempotent."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            sinks = list(self._sinks.values())
        for sink in sinks:
            await self._start_sink(sink)

    async def close(self, timeout_seconds: float = 2.0) -> None:
        """Stops every sink after one last bounded attempt to deliver what is buffered (the
        rest is counted as dropped), in parallel. Reports after this are dropped (`closed`)."""
        with self._lock:
            self._closed = True
            sinks = list(self._sinks.values())
        await asyncio.gather(*self._starting, return_exceptions=True)
        # A sink that never started (closed before start) just counts its items as dropped.
        await asyncio.gather(
            *(sink.close(timeout_seconds) for sink in sinks), return_exceptions=True
        )

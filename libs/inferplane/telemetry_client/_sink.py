"""`RecordSink`: the request path's non-blocking hand-off of request records to telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime.delivery.batching import (
    RETRYABLE_CODES,
    BatchMetrics,
    GrpcSink,
    GrpcSinkSettings,
    Sleep,
)
from inferplane.runtime.time.clock import Clock

__all__ = ["RETRYABLE_CODES", "RecordSink", "SinkMetrics", "SinkSettings"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SinkSettings(GrpcSinkSettings):
    """How a `RecordSink` buffers and sends (`GrpcSinkSettings`; `target` is the telemetry
    service): batches of up to 500 records, a partial one after 1 s."""

    batch_size: int = 500
    flush_interval_seconds: float = 1.0


class SinkMetrics(BatchMetrics):
    """`inferplane_telemetry_records_{sent_total,dropped_total{reason},buffered}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(
            registry,
            "inferplane_telemetry_records",
            sent_help="Request records delivered to telemetry.",
            dropped_help="Request records dropped before reaching telemetry: buffer_full (the "
            "buffer was full: telemetry down too long), rejected (telemetry refused the "
            "batch), invalid (not a RequestRecord).",
            buffered_help="Request records waiting in the buffer or in flight.",
            reasons=("buffer_full", "rejected", "invalid"),
        )


class RecordSink(GrpcSink[telemetry_pb2.RequestRecord]):
    """Buffers request records and streams them to the telemetry service in the background.

    `record()` is what the request path calls: it never blocks, never raises and never does
    I/O. Batches go over `RecordRequests` with the guarantees of
    `inferplane.runtime.delivery.batching.Batcher`: bounded (`capacity`; the newest record is
    dropped
    and counted as `inferplane_telemetry_records_dropped_total{reason="buffer_full"}`), no
    loss across an outage shorter than the buffer (a failed batch is re-sent first, with
    backoff), a refused batch (INVALID_ARGUMENT and other non-retryable codes) dropped and
    counted as `reason="rejected"`. Telemetry drops copies by (source, request_id).
    """

    def __init__(
        self,
        settings: SinkSettings,
        registry: CollectorRegistry,
        *,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(
            settings,
            SinkMetrics(registry),
            name="telemetry-record-sink",
            clock=clock,
            sleep=sleep,
            channel_options=channel_options,
        )
        self._stub: Any = None

    def record(self, record: telemetry_pb2.RequestRecord) -> None:
        """Queues one record for telemetry. Never blocks, never raises; any thread."""
        if isinstance(record, telemetry_pb2.RequestRecord):
            self._put(record)
        else:
            with contextlib.suppress(Exception):
                self.metrics.dropped.labels("invalid").inc()

    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)

    async def _send(self, batch: list[telemetry_pb2.RequestRecord]) -> None:
        request = telemetry_pb2.RecordRequestsRequest(records=batch)
        await self._stub.RecordRequests(iter([request]), timeout=self._settings.rpc_timeout_seconds)

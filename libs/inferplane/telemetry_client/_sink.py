"""`RecordSink`: the request path's non-blocking hand-off of request records to telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime.batching import (
    RETRYABLE_CODES,
    Batcher,
    BatchingSettings,
    BatchMetrics,
    Clock,
    Sleep,
    SystemClock,
    reconnecting_channel,
)

__all__ = ["RETRYABLE_CODES", "Clock", "RecordSink", "SinkMetrics", "SinkSettings", "SystemClock"]

log = structlog.get_logger("inferplane.telemetry_client")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SinkSettings(BatchingSettings):
    """How a `RecordSink` buffers and sends (`BatchingSettings` for the rest).

    Attributes:
        target: the telemetry service, `host:port`.
        batch_size: records per RecordRequests call.
        flush_interval_seconds: a partial batch is sent after this long.
        rpc_timeout_seconds: deadline of one RecordRequests call.
    """

    target: str
    batch_size: int = 500
    flush_interval_seconds: float = 1.0
    rpc_timeout_seconds: float = 5.0


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


class RecordSink:
    """Buffers request records and streams them to the telemetry service in the background.

    `record()` is what the request path calls: it never blocks, never raises and never does
    I/O. Batches go over `RecordRequests` with the guarantees of
    `inferplane.runtime.batching.Batcher`: bounded (`capacity`; the newest record is dropped
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
        self._settings = settings
        self._channel_options = channel_options
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._batcher: Batcher[telemetry_pb2.RequestRecord] = Batcher(
            self._send,
            settings,
            SinkMetrics(registry),
            name="telemetry-record-sink",
            clock=clock,
            sleep=sleep,
        )

    def record(self, record: telemetry_pb2.RequestRecord) -> None:
        """Queues one record for telemetry. Never blocks, never raises; any thread."""
        if isinstance(record, telemetry_pb2.RequestRecord):
            self._batcher.put(record)
        else:
            with contextlib.suppress(Exception):
                self._batcher.metrics.dropped.labels("invalid").inc()

    @property
    def pending(self) -> int:
        """Records buffered or in flight."""
        return self._batcher.pending

    async def start(self) -> None:
        """Opens the channel and starts the background sender on the running loop."""
        self._channel = reconnecting_channel(
            self._settings.target, self._settings.backoff_max_seconds, self._channel_options
        )
        self._stub = telemetry_pb2_grpc.TelemetryServiceStub(self._channel)
        await self._batcher.start()

    async def flush(self) -> int:
        """Sends everything buffered now, one attempt per batch; returns records delivered."""
        return await self._batcher.flush()

    async def close(self, timeout_seconds: float = 5.0) -> None:
        """Stops the sender after one last bounded attempt to deliver what is buffered; what is
        still undelivered then is counted as dropped."""
        await self._batcher.close(timeout_seconds)
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    async def _send(self, batch: list[telemetry_pb2.RequestRecord]) -> None:
        request = telemetry_pb2.RecordRequestsRequest(records=batch)
        await self._stub.RecordRequests(iter([request]), timeout=self._settings.rpc_timeout_seconds)

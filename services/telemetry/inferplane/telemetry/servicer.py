"""gRPC servicer of the telemetry service (proto ⇄ domain; errors are mapped by the runtime)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import timestamp_pb2

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.time.clock import Clock
from inferplane.telemetry.alerts import Alert, AlertBook
from inferplane.telemetry.domain import Sources
from inferplane.telemetry.ingest import Ingestor
from inferplane.telemetry.store import SampleStore
from inferplane.telemetry.summary import DEFAULT_PERCENTILES, summarize

MAX_WINDOW_SECONDS = 7 * 24 * 3600


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def _percentiles(values: list[tuple[float, float]]) -> list[telemetry_pb2.Percentile]:
    # No samples → no entries (request_count says why), never NaN on the wire.
    return [telemetry_pb2.Percentile(percentile=p, value=v) for p, v in values if not math.isnan(v)]


def alert_to_proto(alert: Alert) -> telemetry_pb2.Alert:
    message = telemetry_pb2.Alert(
        kind=alert.kind,
        deployment=alert.deployment,
        message=alert.message,
        value=alert.value,
        threshold=alert.threshold,
        start_time=_timestamp(alert.start_time),
    )
    if alert.end_time is not None:
        message.end_time.CopyFrom(_timestamp(alert.end_time))
    return message


class TelemetryService(telemetry_pb2_grpc.TelemetryServiceServicer):  # type: ignore[misc]
    """inferplane.telemetry.v1.TelemetryService."""

    def __init__(
        self,
        ingestor: Ingestor,
        store: SampleStore,
        book: AlertBook,
        clock: Clock,
        sources: Sources,
    ) -> None:
        self._ingestor = ingestor
        self._store = store
        self._book = book
        self._clock = clock
        self._sources = sources

    async def RecordRequests(
        self, request_iterator: AsyncIterator[telemetry_pb2.RecordRequestsRequest], context: Any
    ) -> telemetry_pb2.RecordRequestsResponse:
        """Stores each batch as it arrives; `accepted` counts records taken, including re-sent
        duplicates (already stored), so a sender can treat OK as "all delivered"."""
        accepted = 0
        async for batch in request_iterator:
            accepted += self._ingestor.ingest(batch.records)
        return telemetry_pb2.RecordRequestsResponse(accepted=accepted)

    async def QueryLatency(
        self, request: telemetry_pb2.QueryLatencyRequest, context: Any
    ) -> telemetry_pb2.QueryLatencyResponse:
        """Exact percentiles over the window's stored samples (see `summary.summarize`).

        Percentiles default to 50, 90, 99. A latency with no samples has no entries. With
        `revision`, only that profile revision's records count (a canary, issue 30).

        Raises:
            InvalidArgumentError: window_seconds is 0 or above 7 days, or a percentile is
                outside (0, 100].
        """
        if not 0 < request.window_seconds <= MAX_WINDOW_SECONDS:
            raise InvalidArgumentError(
                f"window_seconds must be in 1..{MAX_WINDOW_SECONDS}, got {request.window_seconds}",
                param="window_seconds",
            )
        ps = tuple(request.percentiles) or DEFAULT_PERCENTILES
        bad = [p for p in ps if not 0 < p <= 100]
        if bad:
            raise InvalidArgumentError(
                f"percentiles must be in (0, 100], got {bad[0]:g}", param="percentiles"
            )
        summary = summarize(
            self._store,
            now=self._clock.time(),
            window_seconds=float(request.window_seconds),
            sources=self._sources,
            ps=ps,
            model=request.model,
            deployment=request.deployment,
            tenant=request.tenant,
            revision=request.revision,
        )
        return telemetry_pb2.QueryLatencyResponse(
            request_count=summary.request_count,
            error_count=summary.error_count,
            time_to_first_token_seconds=_percentiles(summary.ttft),
            inter_token_latency_seconds=_percentiles(summary.itl),
            e2e_latency_seconds=_percentiles(summary.e2e),
            output_tokens_per_second=summary.output_tokens_per_second,
            tool_call_validity=summary.tool_call_validity,
        )

    async def ListAlerts(
        self, request: telemetry_pb2.ListAlertsRequest, context: Any
    ) -> telemetry_pb2.ListAlertsResponse:
        """Firing alerts, plus those resolved in the last hour when asked."""
        alerts = self._book.alerts(
            include_resolved=request.include_resolved, now=self._clock.time()
        )
        return telemetry_pb2.ListAlertsResponse(alerts=[alert_to_proto(a) for a in alerts])

"""The edge's own overhead per model, from its access log (`AccessLogService.StreamAccessLogs`).

The edge (Envoy) streams one HTTP access-log entry for every request its endpoint picker routed
as a model (`inferplane.edge`, `EdgeConfig.telemetry_endpoint`: the log's filter keeps entries
whose dynamic metadata carries `PICKER_NAMESPACE` / `PICKER_MODEL`). Each entry's
`common_properties` holds Envoy's timings, durations since the request's first byte; Envoy
1.40 fills every one used here for a request that reached a replica. The overhead is

    (time_to_last_upstream_tx_byte - time_to_last_rx_byte)            request leg
  + (time_to_first_downstream_tx_byte - time_to_first_upstream_rx_byte) response leg

that is, from the client's last request byte to the replica having the whole request (authz,
the Lua filters, the transcoder, the picker's exchange and its admission queue, connecting),
plus from the replica's first response byte to the client's (the transcoder and the response
filters). A leg that overlaps (the request forwarded before the client finished sending it)
counts 0. Entries without a model or without upstream timings (refused before reaching a
replica) are counted, not observed.

Who may call: `InternalCallerGuard` (telemetry's internal token when configured, else the
edge's certificate, else loopback): a forged entry would skew an alerting metric.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from inferplane.runtime.security.identity import peer_identity
from inferplane.runtime.security.internal import InternalCallerGuard
from inferplane.telemetry.domain import LabelLimiter
from inferplane.wire.headers import PICKER_MODEL, PICKER_NAMESPACE

#: Seconds: 0.1 ms to 50 ms, then 0.1 s and 0.25 s for a picker queue or a stalled edge.
OVERHEAD_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
)
#: Outcomes of `inferplane_edge_log_entries`.
OUTCOMES = ("observed", "no_model", "no_upstream")
_TIMINGS = (
    "time_to_last_rx_byte",
    "time_to_last_upstream_tx_byte",
    "time_to_first_upstream_rx_byte",
    "time_to_first_downstream_tx_byte",
)


def _seconds(common: accesslog_pb2.AccessLogCommon, field: str) -> float:
    value = getattr(common, field)
    return float(value.seconds) + float(value.nanos) / 1e9


def edge_overhead_seconds(common: accesslog_pb2.AccessLogCommon) -> float | None:
    """The edge's overhead (seconds, ≥ 0) of one access-log entry's `common_properties`, or
    None when a timing is missing (the request never reached a replica, or no response byte
    came back from it)."""
    if not all(common.HasField(field) for field in _TIMINGS):
        return None
    last_rx, upstream_tx, upstream_rx, downstream_tx = (_seconds(common, f) for f in _TIMINGS)
    return max(0.0, upstream_tx - last_rx) + max(0.0, downstream_tx - upstream_rx)


def routed_model(common: accesslog_pb2.AccessLogCommon) -> str:
    """The model the picker routed the request as (its dynamic metadata), "" when none."""
    namespace = common.metadata.filter_metadata.get(PICKER_NAMESPACE)
    if namespace is None:
        return ""
    value = namespace.fields.get(PICKER_MODEL)
    return value.string_value if value is not None else ""


class EdgeOverheadMetrics:
    """`inferplane_edge_overhead_seconds{model}` and `inferplane_edge_log_entries{outcome}`.

    The model label is capped at `max_models` distinct values (then `other`), although the
    picker already names only served models or `UNKNOWN_MODEL`.
    """

    def __init__(self, registry: CollectorRegistry, max_models: int = 50) -> None:
        self._models = LabelLimiter(max_models)
        self.overhead = Histogram(
            "inferplane_edge_overhead_seconds",
            "Seconds the edge (Envoy) added to a routed request: client's last request byte "
            "to the replica having the request, plus the replica's first response byte to the "
            "client's.",
            ["model"],
            registry=registry,
            buckets=OVERHEAD_BUCKETS,
        )
        self.entries = Counter(
            "inferplane_edge_log_entries",
            "Edge access-log entries received, by outcome: observed, no_model (not routed as a "
            "model), no_upstream (ended before a replica answered).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.entries.labels(outcome)

    def observe(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> float | None:
        """Observes one entry; returns the overhead observed (seconds) or None."""
        common = entry.common_properties
        model = routed_model(common)
        if not model:
            self.entries.labels("no_model").inc()
            return None
        overhead = edge_overhead_seconds(common)
        if overhead is None:
            self.entries.labels("no_upstream").inc()
            return None
        self.overhead.labels(self._models.admit((), model)).observe(overhead)
        self.entries.labels("observed").inc()
        return overhead


class EdgeOverheadService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """`AccessLogService.StreamAccessLogs`: the edge's HTTP entries → `EdgeOverheadMetrics`.

    Raises (to the caller, before reading a message): UnauthenticatedError /
    PermissionDeniedError from the guard.
    """

    def __init__(self, metrics: EdgeOverheadMetrics, guard: InternalCallerGuard) -> None:
        self._metrics = metrics
        self._guard = guard

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        self._guard.check(
            dict(context.invocation_metadata() or ()), context.peer(), peer_identity(context)
        )
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self._metrics.observe(entry)
        return als_pb2.StreamAccessLogsResponse()

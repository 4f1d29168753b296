"""Request records (proto) → samples (domain) → store + Prometheus metrics."""

from __future__ import annotations

from collections.abc import Iterable

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.runtime.time.clock import Clock
from inferplane.runtime.time.gaps import thin
from inferplane.telemetry.domain import Sources
from inferplane.telemetry.metrics import RecordMetrics
from inferplane.telemetry.store import Sample, SampleStore

_SOURCE_LABELS = {
    telemetry_pb2.RECORD_SOURCE_ROUTER: "router",
    telemetry_pb2.RECORD_SOURCE_REPLICA: "replica",
}
_LEGACY_SOURCES = {"node-agent": "replica"}
"""Source strings of older senders that name a source by another name: replica processes
before `RequestRecord.record_source` said "node-agent" (where the pipeline used to run)."""


def record_source(record: telemetry_pb2.RequestRecord) -> str:
    """The record's source label ("router", "replica", or an unknown sender's own string).

    `record_source` (the enum) wins when set; otherwise the deprecated `source` string of an
    older sender is read, "node-agent" meaning the replica (the proto's comment on `source`).
    """
    label = _SOURCE_LABELS.get(record.record_source)
    if label is not None:
        return label
    source = record.source
    return _LEGACY_SOURCES.get(source, source)


def sample_from_record(
    record: telemetry_pb2.RequestRecord, received_at: float, max_itl_gaps: int
) -> Sample:
    """The sample of one record; see `Sample.time` for how its time is chosen."""
    finished = received_at
    if record.HasField("start_time") and (record.start_time.seconds or record.start_time.nanos):
        stamped = record.start_time.ToNanoseconds() / 1e9 + max(0.0, record.e2e_latency_seconds)
        finished = min(stamped, received_at)
    if record.inter_token_latencies_seconds:
        itl = thin(record.inter_token_latencies_seconds, max_itl_gaps)
    elif record.inter_token_latency_mean_seconds > 0:
        itl = (record.inter_token_latency_mean_seconds,)
    else:
        itl = ()
    return Sample(
        time=finished,
        request_id=record.request_id,
        source=record_source(record),
        model=record.model,
        deployment=record.deployment,
        tenant=record.tenant,
        replica=record.replica,
        error_code=record.error_code,
        finish_reason=record.finish_reason,
        queue_time=record.queue_time_seconds,
        ttft=record.time_to_first_token_seconds,
        e2e=record.e2e_latency_seconds,
        itl=itl,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        completion_tokens=record.completion_tokens,
        reasoning_tokens=record.reasoning_tokens,
        tool_calls=record.tool_calls,
        tool_calls_valid=record.tool_calls_valid,
        tool_call_invalid_reasons=tuple(record.tool_call_invalid_reasons),
        markers_leaked=record.markers_leaked,
        revision=record.revision,
        adapter=record.adapter,
    )


class Ingestor:
    """Stores records and feeds the metrics; a re-sent record (same source and request id) is
    neither stored nor counted again."""

    def __init__(
        self,
        store: SampleStore,
        metrics: RecordMetrics,
        clock: Clock,
        sources: Sources,
        *,
        max_itl_gaps: int = 128,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._sources = sources
        self._max_itl_gaps = max_itl_gaps

    def ingest(self, records: Iterable[telemetry_pb2.RequestRecord]) -> int:
        """Ingests `records`; returns how many were taken (stored or known duplicates)."""
        now = self._clock.time()
        taken = 0
        for record in records:
            sample = sample_from_record(record, now, self._max_itl_gaps)
            stored = self._store.add(sample)
            self._metrics.observe_received(sample.source, stored)
            taken += 1
            if not stored:
                continue
            if self._sources.counts_request(sample.source):
                self._metrics.observe_request(sample)
            if self._sources.counts_tool_calls(sample.source):
                self._metrics.observe_parse(sample)
        return taken

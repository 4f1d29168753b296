"""The end of every request the router handled: one usage report and one telemetry record.

The endpoint picker (`picker/`) opens a `RequestTrace` when a request arrives and hands it
here exactly once when it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.router.records import STATUS_CANCELLED, STATUS_OK, RequestTrace
from inferplane.router.usage import UsageRecord, UsageSink
from inferplane.runtime.time.clock import Clock
from inferplane.wire import headers

log = structlog.get_logger("inferplane.router")

RecordSend = Callable[[telemetry_pb2.RequestRecord], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Reporter:
    """Opens traces and reports finished ones.

    Attributes:
        usage: where keyed requests' usage goes (auth, or a log line); never blocks.
        records: telemetry's record sink (`RecordSink.record`), or None for no records.
        clock: monotonic seconds; times the trace (arrival, end).
        wall_clock: Unix seconds; stamps the record's start and the usage report's end.
    """

    usage: UsageSink
    records: RecordSend | None
    clock: Clock
    wall_clock: Callable[[], float] = time.time

    def begin(self, model: str, stream: bool, metadata: Mapping[str, str]) -> RequestTrace:
        """A trace for a request that arrived now (`metadata`: the edge's headers)."""
        return RequestTrace.begin(
            model, stream, metadata, self.clock.monotonic(), self.wall_clock()
        )

    def finish(self, trace: RequestTrace, metadata: Mapping[str, str]) -> int:
        """The request ended: one usage report when it carried a key (tokens may be 0: the
        report also frees the key's concurrency slot in auth) and one telemetry record.
        Returns the usage report's position for `delivered` (0: none to wait for). Never
        raises: reporting must not fail a request."""
        key_id = metadata.get(headers.KEY_ID)
        usage = trace.usage
        position = 0
        if key_id:
            ttft, duration = trace.timings(self.clock.monotonic())
            if trace.status == STATUS_OK:
                status = "completed"
            else:
                status = "cancelled" if trace.status == STATUS_CANCELLED else "failed"
            position = self.usage.record(
                UsageRecord(
                    key_id=key_id,
                    request_id=metadata.get(headers.REQUEST_ID, ""),
                    model=trace.model,
                    prompt_tokens=usage.prompt_tokens if usage is not None else 0,
                    completion_tokens=usage.completion_tokens if usage is not None else 0,
                    ok=trace.status == STATUS_OK,
                    end_time=self.wall_clock(),
                    deployment=trace.deployment,
                    replica=trace.replica,
                    cached_tokens=(
                        usage.prompt_tokens_details.cached_tokens if usage is not None else 0
                    ),
                    reasoning_tokens=(
                        usage.completion_tokens_details.reasoning_tokens if usage is not None else 0
                    ),
                    ttft_seconds=ttft,
                    duration_seconds=duration,
                    gpu_seconds=trace.gpu_seconds,
                    status=status,
                    start_time=trace.start_wall,
                    api=trace.api,
                )
            )
        if self.records is not None:
            try:
                self.records(trace.to_record(self.clock.monotonic()))
            except Exception:  # telemetry must never fail a request
                log.exception("request_record_failed", request_id=trace.request_id)
        return position

    async def delivered(self, position: int, timeout_seconds: float) -> bool:
        """Waits (at most `timeout_seconds`) until the usage report at `position` (from
        `finish`) reached auth; True when it did or there was none. Never raises."""
        if not position:
            return True
        try:
            await asyncio.wait_for(self.usage.settled(position), timeout_seconds)
        except TimeoutError:
            return False
        return True

"""The end of every request the router handled: one `ConcludedRequest`, from which its usage
report and its telemetry record are derived.

The endpoint picker (`picker/`) opens a `RequestTrace` when a request arrives and concludes it
here exactly once when it ends (`finish`); a replica's report of a request this process never
saw (an orphan) is concluded by `finish_reported`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.router.records import ConcludedRequest, RequestTrace
from inferplane.router.usage import UsageSink
from inferplane.runtime.time.clock import Clock
from inferplane.wire import ResponseSummary

log = structlog.get_logger("inferplane.router")

RecordSend = Callable[[telemetry_pb2.RequestRecord], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Reporter:
    """Opens traces and concludes finished ones.

    Attributes:
        usage: where keyed requests' usage goes (the durable outbox to auth, or a log line);
            never blocks.
        records: telemetry's record sink (`RecordSink.record`), or None for no records.
        clock: monotonic seconds; times the trace (arrival, end).
        wall_clock: Unix seconds; stamps the request's start and end.
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

    def finish(
        self, trace: RequestTrace, *, model: str, provisional: bool = False, amends: bool = False
    ) -> int:
        """The request ended now: its `ConcludedRequest` (`model`: what usage groups it by,
        `headers.UNKNOWN_MODEL` for a name no route serves) goes to the usage outbox when it
        carried a key (tokens may be 0) and to telemetry as one record. `provisional`: how it
        ended was not heard (`ConcludedRequest.provisional`); `amends`: the replica's late
        report of a request concluded provisionally, whose usage replaces the provisional row
        (no second telemetry record: telemetry keeps one per request id). Returns the usage
        report's position for `durable` (0: none). Never raises: reporting must not fail a
        request."""
        try:
            concluded = trace.conclude(
                self.clock.monotonic(), self.wall_clock(), model=model, provisional=provisional
            )
        except Exception:
            log.exception("request_conclusion_failed", request_id=trace.request_id)
            return 0
        position = self.usage.record(concluded) if concluded.key_id else 0
        if self.records is not None and not amends:
            try:
                self.records(concluded.record())
            except Exception:  # telemetry must never fail a request
                log.exception("request_record_failed", request_id=trace.request_id)
        return position

    def finish_reported(self, request_id: str, summary: ResponseSummary) -> int:
        """A replica's report of a request this process never saw (its key, model and API are
        in the summary): its usage goes to the outbox (no record: the process that saw the
        request may have sent one). Returns the position for `durable` (0: no key)."""
        if not summary.key_id:
            return 0
        return self.usage.record(ConcludedRequest.reported(request_id, summary, self.wall_clock()))

    async def durable(self, position: int) -> None:
        """Returns once the usage report at `position` (from `finish`) is in the durable
        outbox (at once for 0)."""
        if position:
            await self.usage.durable(position)

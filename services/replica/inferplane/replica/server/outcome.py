"""A request's end (`End`, `Ending`), the facts handed to telemetry (`RequestOutcome`) and their
record (`RequestOutcome.to_record`, `record_sender`).

`RequestFacts.ending()` (`facts.py`) is the one place a request's end is classified; the
outcome carries that `Ending`, so its record says what the summary trailers and the picker
report said.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Callable

from google.protobuf import timestamp_pb2

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.parsers import ToolCallVerdict
from inferplane.runtime.time.gaps import thin

SOURCE = "replica"
"""The deprecated `RequestRecord.source` string of the replica's records, for telemetry
servers older than `record_source` (which wins when both are set)."""


class End(enum.Enum):
    """How a request ended (`facts.py` says when, and what each view reports)."""

    COMPLETED = "completed"
    FAILED_BEFORE_OUTPUT = "failed_before_output"
    FAILED_AFTER_OUTPUT = "failed_after_output"
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True, slots=True)
class Ending:
    """A request's end as every view reports it.

    Attributes:
        end: how it ended.
        finish_reason: what the trailers, the picker report and the record say ("stop",
            "length", "tool_calls", "error", "abort", or "" for a failure before output).
        error_code: OpenAI's error code of a failure ("" otherwise).
    """

    end: End
    finish_reason: str = ""
    error_code: str = ""

    @property
    def status(self) -> str:
        """ "ok" (COMPLETED), "cancelled" (CANCELLED) or "error" (a failure)."""
        if self.end is End.COMPLETED:
            return "ok"
        if self.end is End.CANCELLED:
            return "cancelled"
        return "error"


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to one inference request (one record per request, success or not).

    Attributes:
        request_id: the completion id (`chatcmpl-…` / `cmpl-…`), the embeddings request's
            (`embd-…`) or the speech request's (`audio-…`), also the engine request id; "" when
            the request failed before it got one.
        model: the served model name.
        replica_id: the replica that ran it.
        api: the API's name (`inferplane.wire.apis`).
        stream: True for the streaming methods.
        ending: how it ended (`status`, `finish_reason` and `error_code` read it).
        prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens: token counts
            (`reasoning_tokens`: output tokens fed to the parser while it was in reasoning).
        ttft_seconds: request arrival → first engine output (an embedding's: its result),
            None when there was none.
        itl_seconds: inter-token latency samples, one per token after the first engine output:
            an increment of n tokens after a gap g gives n samples of g / n (vLLM's stream
            interval and merged reads deliver several tokens per increment).
        e2e_seconds: request arrival → end.
        tool_call_verdicts: the verdict on every tool call of the response.
        marker_leaked: a format marker survived into the visible output (a parser bug signal).
        dropped_tool_calls: calls the model made although `tool_choice` was "none".
        request_header_id: the caller's `x-request-id`, "" when absent.
    """

    request_id: str
    model: str
    replica_id: str
    api: str
    stream: bool
    ending: Ending
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    ttft_seconds: float | None = None
    itl_seconds: tuple[float, ...] = ()
    e2e_seconds: float = 0.0
    tool_call_verdicts: tuple[ToolCallVerdict, ...] = ()
    marker_leaked: bool = False
    dropped_tool_calls: int = 0
    request_header_id: str = ""

    @property
    def status(self) -> str:
        """ "ok", "error" (an InferplaneError was returned) or "cancelled" (client gone or
        deadline)."""
        return self.ending.status

    @property
    def finish_reason(self) -> str:
        """The ending's finish reason ("stop", "length", "tool_calls", "error", "abort", "")."""
        return self.ending.finish_reason

    @property
    def error_code(self) -> str:
        """The OpenAI error code of a failure, else ""."""
        return self.ending.error_code

    @property
    def valid_tool_calls(self) -> int:
        """Calls whose verdict is valid (K2-Vendor-Verifier's schema accuracy numerator)."""
        return sum(1 for v in self.tool_call_verdicts if v.valid)

    def to_record(
        self, *, node: str, deployment: str, now: float, revision: str = ""
    ) -> telemetry_pb2.RequestRecord:
        """Telemetry's `RequestRecord` of this request, which ended at wall-clock `now`
        (seconds since the epoch), on `node`, for `deployment` ("": the model), served by the
        profile `revision` the replica runs (its spec's: a canary's tool-call validity is its
        revision's records, issue 30).

        The replica is the source of tool-call validity and leaked-marker facts (it parsed the
        output); latencies are measured from the request's arrival at the replica; the
        inter-token gaps are thinned to `inferplane.runtime.time.gaps.MAX_GAPS`.
        """
        start = timestamp_pb2.Timestamp()
        start.FromNanoseconds(int((now - self.e2e_seconds) * 1e9))
        invalid = [v.reason.value for v in self.tool_call_verdicts if not v.valid and v.reason]
        record = telemetry_pb2.RequestRecord(
            request_id=self.request_header_id or self.request_id,
            record_source=telemetry_pb2.RECORD_SOURCE_REPLICA,
            source=SOURCE,
            model=self.model,
            deployment=deployment or self.model,
            replica=self.replica_id,
            node=node,
            start_time=start,
            time_to_first_token_seconds=self.ttft_seconds or 0.0,
            e2e_latency_seconds=self.e2e_seconds,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens,
            finish_reason=self.ending.finish_reason,
            tool_calls=len(self.tool_call_verdicts),
            tool_calls_valid=self.valid_tool_calls,
            tool_call_invalid_reasons=invalid,
            markers_leaked=1 if self.marker_leaked else 0,
            error_code=self.ending.error_code,
            stream=self.stream,
            inter_token_latencies_seconds=thin(self.itl_seconds),
            api=self.api,
            revision=revision,
        )
        if self.itl_seconds:
            record.inter_token_latency_mean_seconds = statistics.fmean(self.itl_seconds)
        return record


OutcomeSink = Callable[[RequestOutcome], None]
"""Receives every `RequestOutcome`. Called from the event loop after the response is sent
(`loop.call_soon`), so it must be cheap (e.g. enqueue); exceptions are logged, never raised."""


def discard_outcome(_: RequestOutcome) -> None:
    """The default sink: no telemetry."""


def record_sender(
    send: Callable[[telemetry_pb2.RequestRecord], None],
    *,
    node: str,
    deployment_of: Callable[[str], str],
    wall_clock: Callable[[], float],
    revision: str = "",
) -> OutcomeSink:
    """An OutcomeSink that turns each outcome into its record (`deployment_of(replica_id)`,
    the replica's profile `revision`, ended at `wall_clock()`) and hands it to `send` (a
    `RecordSink.record`)."""

    def on_outcome(outcome: RequestOutcome) -> None:
        send(
            outcome.to_record(
                node=node,
                deployment=deployment_of(outcome.replica_id),
                now=wall_clock(),
                revision=revision,
            )
        )

    return on_outcome

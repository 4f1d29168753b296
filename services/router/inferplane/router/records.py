"""The router's view of one request (`RequestTrace`) → telemetry's `RequestRecord`.

Telemetry counts requests, status, latency and tokens from the router's records
(`request_source = "router"`, services/telemetry/README.md) and tool-call facts from the
node-agent's, so the router sends exactly one record per request it received: success,
error (before or after the first chunk, 429s and unknown models included) or cancel.

What the router measures, from the request's arrival at the router:
- queue time: time spent waiting for a slot in admission (every attempt summed);
- TTFT: until the first chunk with a choice (the node-agent emits its role chunk when the
  engine produced the first step, so this is the client's time to first token minus the
  edge's hop). Unary responses have no first token the router can see: TTFT stays 0 (unset);
- ITL: the gaps between consecutive chunks that carry text (content, reasoning, tool-call
  or completion text), evenly thinned to at most `MAX_GAPS`; their mean. That is what clients
  see: one token per chunk by default, several with a stream interval (then a gap spans them;
  the node-agent's own records count ITL per token);
- e2e: until the last chunk or the error.

As the endpoint picker (`picker.py`, data path v2) the router sees no chunk, only the
replica's `ResponseSummary` trailers (`on_summary`): usage and finish reason come from there,
TTFT is the time until the pick plus the replica's own TTFT (Envoy's hop to the replica is
not in it), there are no ITL gaps (the replica's own records carry them), and e2e ends when
the trailers arrive or the side stream closes.
"""

from __future__ import annotations

import dataclasses
import statistics
import uuid
from collections.abc import Mapping
from typing import Any

from google.protobuf import timestamp_pb2

from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.wire import ResponseSummary

SOURCE = "router"
MAX_GAPS = 128  # telemetry keeps at most this many inter-token gaps per record
STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_CANCELLED = "cancelled"


def carries_tokens(chunk: Any) -> bool:
    """Whether a streamed chat or completion chunk carries generated text."""
    for choice in chunk.choices:
        if "delta" in choice.DESCRIPTOR.fields_by_name:
            delta = choice.delta
            if delta.content or delta.reasoning_content or len(delta.tool_calls):
                return True
        elif choice.text:
            return True
    return False


def _finish_reason(chunk: Any) -> str:
    for choice in chunk.choices:
        if "finish_reason" not in choice.DESCRIPTOR.fields_by_name:
            continue
        value = choice.finish_reason
        if isinstance(value, str):
            if value:
                return value
        elif value.HasField("string_value"):  # google.protobuf.Value (completions)
            return str(value.string_value)
    return ""


def thin(gaps: list[float], limit: int = MAX_GAPS) -> list[float]:
    """At most `limit` gaps, evenly spaced over the input (keeps the distribution's shape)."""
    if len(gaps) <= limit:
        return gaps
    step = len(gaps) / limit
    return [gaps[int(i * step)] for i in range(limit)]


@dataclasses.dataclass(slots=True)
class RequestTrace:
    """What the router saw of one request; times are monotonic seconds except `start_wall`
    (Unix seconds). Filled by the servicer as the request moves; see `to_record`."""

    model: str
    stream: bool
    start: float
    start_wall: float
    request_id: str = ""
    tenant: str = ""
    key_id: str = ""
    deployment: str = ""
    replica: str = ""
    node: str = ""
    queue_seconds: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    gaps: list[float] = dataclasses.field(default_factory=list)
    usage: Any = None  # inferplane.inference.v1.Usage, once the replica said
    gpu_seconds: float = 0.0  # attributed by the replica (`ResponseSummary.gpu_seconds`)
    finish_reason: str = ""
    status: str = STATUS_OK
    error_code: str = ""

    @classmethod
    def begin(
        cls, model: str, stream: bool, metadata: Mapping[str, str], now: float, wall: float
    ) -> RequestTrace:
        return cls(
            model=model,
            stream=stream,
            start=now,
            start_wall=wall,
            request_id=metadata.get("x-request-id") or f"router-{uuid.uuid4().hex}",
            tenant=metadata.get("x-inferplane-tenant", ""),
            key_id=metadata.get("x-inferplane-key-id", ""),
        )

    def on_chunk(self, chunk: Any, now: float) -> None:
        """A streamed chunk reached the router."""
        if chunk.HasField("usage"):
            self.usage = chunk.usage
        if not len(chunk.choices):
            return
        if self.first_token is None:
            self.first_token = now
        if carries_tokens(chunk):
            if self.last_token is not None:
                self.gaps.append(now - self.last_token)
            self.last_token = now
        self.finish_reason = _finish_reason(chunk) or self.finish_reason

    def on_response(self, response: Any) -> None:
        """A unary response reached the router."""
        if response.HasField("usage"):
            self.usage = response.usage
        self.finish_reason = _finish_reason(response) or self.finish_reason

    def on_summary(self, summary: ResponseSummary, picked: float) -> None:
        """The replica's summary reached the endpoint picker; `picked` (monotonic seconds) is
        when the picker answered Envoy with the endpoint list."""
        if summary.prompt_tokens or summary.completion_tokens:
            self.usage = inference_pb2.Usage(
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                total_tokens=summary.prompt_tokens + summary.completion_tokens,
                prompt_tokens_details=inference_pb2.PromptTokensDetails(
                    cached_tokens=summary.cached_tokens
                ),
                completion_tokens_details=inference_pb2.CompletionTokensDetails(
                    reasoning_tokens=summary.reasoning_tokens
                ),
            )
        if summary.ttft_seconds > 0:
            self.first_token = picked + summary.ttft_seconds
        self.finish_reason = summary.finish_reason or self.finish_reason
        self.replica = summary.replica_id or self.replica
        self.gpu_seconds = summary.gpu_seconds or self.gpu_seconds

    def fail(self, code: str) -> None:
        self.status = STATUS_ERROR
        self.error_code = code or "internal_error"

    def cancel(self) -> None:
        """The client went away: finish_reason "abort" and no error code, as the node-agent
        reports it, so a client's cancel never counts against the error-rate SLO."""
        self.status = STATUS_CANCELLED
        self.error_code = ""

    def timings(self, now: float) -> tuple[float, float]:
        """(TTFT, end-to-end) seconds from arrival at the router, the request ended at
        monotonic `now` unless `end` was set; TTFT is 0 when no output came."""
        end = self.end if self.end is not None else now
        ttft = self.first_token - self.start if self.first_token is not None else 0.0
        return max(0.0, ttft), max(0.0, end - self.start)

    def to_record(self, now: float) -> telemetry_pb2.RequestRecord:
        """The record of this request, ended at monotonic `now` (unless `end` was set)."""
        ttft, e2e = self.timings(now)
        start = timestamp_pb2.Timestamp()
        start.FromNanoseconds(int(self.start_wall * 1e9))
        usage = self.usage
        finish = self.finish_reason
        if self.status == STATUS_CANCELLED:
            finish = "abort"
        elif self.status == STATUS_ERROR:
            finish = "error"
        record = telemetry_pb2.RequestRecord(
            request_id=self.request_id,
            source=SOURCE,
            tenant=self.tenant,
            key_id=self.key_id,
            model=self.model,
            deployment=self.deployment,
            replica=self.replica,
            node=self.node,
            start_time=start,
            queue_time_seconds=self.queue_seconds,
            time_to_first_token_seconds=ttft,
            e2e_latency_seconds=e2e,
            finish_reason=finish,
            error_code=self.error_code,
            stream=self.stream,
            inter_token_latencies_seconds=thin(self.gaps),
        )
        if self.gaps:
            record.inter_token_latency_mean_seconds = statistics.fmean(self.gaps)
            record.inter_token_latency_p99_seconds = _p99(self.gaps)
        if usage is not None:
            record.prompt_tokens = usage.prompt_tokens
            record.completion_tokens = usage.completion_tokens
            record.cached_tokens = usage.prompt_tokens_details.cached_tokens
            record.reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
        return record


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * (len(ordered) - 1) + 0.5))]

"""The replica process's spans: one request's `replica` span in the edge's trace, and its
stages `render`, `prefill`, `decode` and `parse`, one span each per request (never one per
token); its in-process vLLM engine continues the same trace.

The request's gRPC metadata carries Envoy's upstream span as `traceparent` (checked against a
real Envoy: libs/tests/edge/test_edge_tracing.py); the `replica` span (SERVER) is its child,
or a new trace's root, sampled at the process's ratio, for a caller that sent none. Its stages
are measured on the pipeline's clock while the request runs (`Generation`: the engine call,
the first and last output, the time spent detokenizing and parsing) and written once, when
the request ends:

- `render`: arrival → the engine call (admission, the chat template, tokenization);
- `prefill`: the engine call → its first output (queueing in the engine and prefill);
- `decode`: the first output → the last;
- `parse`: starts at the first output and lasts the request's total detokenize-and-parse
  time (`inferplane.parse_seconds`), an aggregate of every step, not an interval.

While a request is served, `CURRENT` holds its W3C headers: the inproc engine hands them to
vLLM (`AsyncLLM.generate(trace_headers=...)`, whose `llm_request` span becomes the `replica`
span's child when vLLM runs with `--otlp-traces-endpoint`), also when the request is not
sampled (vLLM, which samples every trace it starts, then records none).

With tracing off (`REPLICA_TRACING_OFF`) `begin` is one attribute test and returns None; a
request whose `traceparent` says "not sampled" gets no span (its `traceparent` is what the
engine is handed) and no per-step timing.
"""

from __future__ import annotations

import contextvars
import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog

from inferplane.runtime.time.clock import Clock, SystemClock
from inferplane.runtime.tracing import (
    DISABLED,
    REQUEST_ID_ATTRIBUTE,
    TRACEPARENT,
    Tracing,
    sampled,
)
from inferplane.wire.headers import REQUEST_ID

log = structlog.get_logger("inferplane.replica.tracing")

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from inferplane.replica.server.facts import RequestFacts
    from inferplane.replica.server.outcome import Ending


@dataclasses.dataclass(frozen=True, slots=True)
class TraceContext:
    """The request being served, as the next hop continues it.

    Attributes:
        headers: W3C headers naming its `replica` span (`traceparent`, maybe `tracestate`).
        recording: whether its trace is sampled (the stages are timed only then).
    """

    headers: Mapping[str, str]
    recording: bool


CURRENT: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar(
    "inferplane_replica_trace", default=None
)
"""The request this task serves (None: tracing off). grpc.aio runs each RPC, and the
generators it drives, in a task of its own."""


class RequestSpan:
    """One traced request: its `replica` span and the clocks to place its stages."""

    __slots__ = ("_offset_ns", "request_id", "span")

    def __init__(self, span: Span, offset_ns: int, request_id: str) -> None:
        self.span = span
        self.request_id = request_id
        self._offset_ns = offset_ns

    def ns(self, monotonic: float) -> int:
        """Unix nanoseconds of a time on the pipeline clock's `monotonic()`."""
        return self._offset_ns + int(monotonic * 1e9)


class ReplicaTracing:
    """The replica's span hooks over a process `Tracing` (default: off); `clock` is the
    pipeline's (its `monotonic()` places the stages)."""

    __slots__ = ("_clock", "enabled", "tracing")

    def __init__(self, tracing: Tracing = DISABLED, clock: Clock | None = None) -> None:
        self.tracing = tracing
        self.enabled = tracing.enabled
        self._clock = clock or SystemClock()

    def begin(self, context: Any, facts: RequestFacts) -> RequestSpan | None:
        """A request arrived (`facts.started`): starts its `replica` span under the request's
        `traceparent` and sets `CURRENT`. None when tracing is off (or failed: logged, the
        request goes on untraced)."""
        if not self.enabled:
            return None
        try:
            return self._begin(context, facts)
        except Exception:  # tracing never fails a request
            log.warning("trace_begin_failed", exc_info=True)
            return None

    def _begin(self, context: Any, facts: RequestFacts) -> RequestSpan | None:
        try:
            metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        except Exception:  # a context without metadata (tests)
            metadata = {}
        traceparent = metadata.get(TRACEPARENT)
        if traceparent is not None and sampled(traceparent) is False:
            # Not sampled (the edge's decision): no span; the engine is told the same.
            CURRENT.set(TraceContext({TRACEPARENT: traceparent}, False))
            return None
        offset_ns = time.time_ns() - int(self._clock.monotonic() * 1e9)
        request_id = metadata.get(REQUEST_ID, "")
        attributes: dict[str, str | bool] = {
            REQUEST_ID_ATTRIBUTE: request_id,
            "inferplane.api": facts.api,
            "inferplane.stream": facts.stream,
        }
        span = self.tracing.start(
            "replica",
            Tracing.extract(metadata),
            start_ns=offset_ns + int(facts.started * 1e9),
            attributes=attributes,
            server=True,
        )
        if span is None:
            return None
        CURRENT.set(TraceContext(Tracing.headers(span), span.is_recording()))
        return RequestSpan(span, offset_ns, request_id)

    def end(self, traced: RequestSpan | None, facts: RequestFacts, ending: Ending) -> None:
        """The request ended as `ending`: writes its stages (a generation's) and ends its
        `replica` span with the request's model, replica, tokens and ending (a failure is
        logged, never raised)."""
        if traced is None:
            if self.enabled:
                CURRENT.set(None)
            return
        CURRENT.set(None)
        try:
            self._end(traced, facts, ending)
        except Exception:  # tracing never fails a request
            log.warning("trace_end_failed", exc_info=True)

    def _end(self, traced: RequestSpan, facts: RequestFacts, ending: Ending) -> None:
        span = traced.span
        if not span.is_recording():
            span.end()
            return
        now = self._clock.monotonic()
        summary = facts.summary(ending)
        stage_attributes = {REQUEST_ID_ATTRIBUTE: traced.request_id}
        gen = facts.gen
        submitted = gen.submitted if gen is not None else None
        if gen is not None and submitted is not None:
            record = self.tracing.record
            record("render", span, traced.ns(facts.started), traced.ns(submitted), stage_attributes)
            first = facts.started + gen.ttft_seconds if gen.ttft_seconds is not None else None
            record("prefill", span, traced.ns(submitted), traced.ns(first or now), stage_attributes)
            if first is not None:
                last = gen.last_output if gen.last_output is not None else now
                record("decode", span, traced.ns(first), traced.ns(last), stage_attributes)
                parse_ns = int(gen.parse_seconds * 1e9)
                start = traced.ns(first)
                record(
                    "parse",
                    span,
                    start,
                    start + parse_ns,
                    {**stage_attributes, "inferplane.parse_seconds": gen.parse_seconds},
                )
        found: dict[str, str | int] = {
            "inferplane.model": facts.model,
            "inferplane.replica": facts.replica,
            "inferplane.prompt_tokens": summary.prompt_tokens,
            "inferplane.completion_tokens": summary.completion_tokens,
            "inferplane.cached_tokens": summary.cached_tokens,
            "inferplane.finish_reason": summary.finish_reason,
            "inferplane.error_code": summary.error_code,
        }
        span.set_attributes({k: v for k, v in found.items() if v not in ("", None)})
        span.end(end_time=traced.ns(now))


REPLICA_TRACING_OFF = ReplicaTracing()
"""The hooks with tracing off (what an `InferenceServicer` has until its process sets its own)."""

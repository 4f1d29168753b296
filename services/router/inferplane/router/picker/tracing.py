"""The endpoint picker's spans: `authn`, `pick` and `queue`, in the edge's trace.

Envoy's ext_proc filter opens the side stream under a span of its own, a child of the edge's
request span, and sends it as the stream's gRPC `traceparent` (checked against a real Envoy:
libs/tests/edge/test_edge_tracing.py). The picker's spans are children of that span; a
stream without it (a conformant gateway, a test) takes the request headers' `traceparent`,
else starts a trace at the router's sampling ratio:

- `authn`: the request-headers exchange (the key's authentication, the path check);
- `pick`: the body exchange (decode, route, admission, the endpoint list), with the model,
  deployment and picked replica as attributes;
- `queue`: the admission wait inside `pick` (a slot, or the queue until one frees).

Each carries the request id (`REQUEST_ID_ATTRIBUTE`). With tracing off (`PickerTracing()`),
each hook is one attribute test: no clock read, no SDK call; a request whose `traceparent`
says "not sampled" (99 % of them behind an edge sampling 1 %) costs a string test per hook
and no SDK call either.

The stream's parent lives in a context variable: grpc.aio runs each RPC, and the async
generators it drives, in a task of its own, so the value set when the stream opens is the
one every later message of that stream sees.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog

from inferplane.runtime.tracing import (
    DISABLED,
    REQUEST_ID_ATTRIBUTE,
    TRACEPARENT,
    Tracing,
    sampled,
)
from inferplane.wire import headers

log = structlog.get_logger("inferplane.router.picker.tracing")

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from inferplane.router.picker.state import Exchange

_SKIP: Any = object()
"""The request's `traceparent` says its trace is not sampled: no span, no SDK call."""
_STREAM_PARENT: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "inferplane_picker_stream_parent", default=None
)
_PICK_SPAN: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "inferplane_picker_pick_span", default=None
)


def _attributes(exchange: Exchange) -> dict[str, Any]:
    trace = exchange.trace
    found = {
        REQUEST_ID_ATTRIBUTE: exchange.request.metadata.get(headers.REQUEST_ID) or trace.request_id,
        "inferplane.model": trace.model,
        "inferplane.deployment": trace.deployment,
        "inferplane.replica": trace.replica,
        "inferplane.tenant": trace.tenant,
        "inferplane.error_code": trace.error_code,
    }
    return {k: v for k, v in found.items() if v}


class PickerTracing:
    """The picker's span hooks over a process `Tracing` (default: off)."""

    __slots__ = ("enabled", "tracing")

    def __init__(self, tracing: Tracing = DISABLED) -> None:
        self.tracing = tracing
        self.enabled = tracing.enabled

    def stream_opened(self, context: Any) -> None:
        """An ext_proc stream began: its gRPC metadata's `traceparent` (Envoy's ext_proc
        span) becomes the parent of this stream's spans."""
        if not self.enabled:
            return
        try:
            metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        except Exception:  # a context without metadata (tests): the request headers decide
            metadata = {}
        traceparent = metadata.get(TRACEPARENT)
        if traceparent is not None and sampled(traceparent) is False:
            _STREAM_PARENT.set(_SKIP)
        else:
            _STREAM_PARENT.set(Tracing.extract(metadata))
        _PICK_SPAN.set(None)

    def _parent(self, exchange: Exchange) -> Context | None:
        """The stream's parent, else the request headers' (`_SKIP`: not sampled)."""
        parent = _STREAM_PARENT.get()
        if parent is not None:
            return parent  # type: ignore[no-any-return]
        traceparent = exchange.request.metadata.get(TRACEPARENT)
        if traceparent is not None and sampled(traceparent) is False:
            return _SKIP  # type: ignore[no-any-return]
        return Tracing.extract(exchange.request.metadata)

    @contextlib.contextmanager
    def authn(self, exchange: Exchange) -> Iterator[None]:
        """Around the request-headers exchange: the `authn` span, written when it ends (the
        headers name the request and, for a gateway, its parent)."""
        if not self.enabled or _STREAM_PARENT.get() is _SKIP:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            with _never_raises("authn"):
                parent = self._parent(exchange)
                if parent is not _SKIP:
                    attributes = _attributes(exchange)
                    self.tracing.record("authn", parent, start, time.time_ns(), attributes)

    @contextlib.contextmanager
    def pick(self, exchange: Exchange) -> Iterator[None]:
        """Around the body exchange's decision: the `pick` span (the parent of `queue`)."""
        span = None
        with _never_raises("pick"):
            parent = self._parent(exchange) if self.enabled else _SKIP
            if parent is not _SKIP:
                span = self.tracing.start("pick", parent)
        if span is None:
            yield
            return
        _PICK_SPAN.set(span)
        try:
            yield
        finally:
            _PICK_SPAN.set(None)
            with _never_raises("pick"):
                attributes = _attributes(exchange)
                if exchange.pick.endpoints:
                    attributes["inferplane.endpoints"] = [
                        e.address for e in exchange.pick.endpoints
                    ]
                span.set_attributes(attributes)
                span.end()

    @contextlib.contextmanager
    def queue(self, exchange: Exchange) -> Iterator[None]:
        """Around admission: the `queue` span, under `pick` when one is open."""
        if not self.enabled or _STREAM_PARENT.get() is _SKIP:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            with _never_raises("queue"):
                parent: Span | Context | None = _PICK_SPAN.get() or self._parent(exchange)
                if parent is not _SKIP:
                    attributes = _attributes(exchange)
                    self.tracing.record("queue", parent, start, time.time_ns(), attributes)


@contextlib.contextmanager
def _never_raises(span: str) -> Iterator[None]:
    """Tracing never fails a request: a failure making `span` is logged and dropped."""
    try:
        yield
    except Exception:
        log.warning("trace_span_failed", span=span, exc_info=True)


PICKER_TRACING_OFF = PickerTracing()
"""The hooks with tracing off (what an `EndpointPicker` has until its app sets its own)."""

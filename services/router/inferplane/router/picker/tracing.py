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
each hook is one attribute test: no clock read, no SDK call.

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

from inferplane.runtime.tracing import DISABLED, REQUEST_ID_ATTRIBUTE, Tracing
from inferplane.wire import headers

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from inferplane.router.picker.state import Exchange

_STREAM_PARENT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
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
        _STREAM_PARENT.set(Tracing.extract(metadata))
        _PICK_SPAN.set(None)

    def _parent(self, exchange: Exchange) -> Context | Span | None:
        return _STREAM_PARENT.get() or Tracing.extract(exchange.request.metadata)

    @contextlib.contextmanager
    def authn(self, exchange: Exchange) -> Iterator[None]:
        """Around the request-headers exchange: the `authn` span, written when it ends (the
        headers name the request and, for a gateway, its parent)."""
        if not self.enabled:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            self.tracing.record(
                "authn", self._parent(exchange), start, time.time_ns(), _attributes(exchange)
            )

    @contextlib.contextmanager
    def pick(self, exchange: Exchange) -> Iterator[None]:
        """Around the body exchange's decision: the `pick` span (the parent of `queue`)."""
        if not self.enabled:
            yield
            return
        span = self.tracing.start("pick", self._parent(exchange))
        _PICK_SPAN.set(span)
        try:
            yield
        finally:
            _PICK_SPAN.set(None)
            if span is not None:
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
        if not self.enabled:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            parent = _PICK_SPAN.get() or self._parent(exchange)
            self.tracing.record("queue", parent, start, time.time_ns(), _attributes(exchange))


PICKER_TRACING_OFF = PickerTracing()
"""The hooks with tracing off (what an `EndpointPicker` has until its app sets its own)."""

"""`OtlpReceiver`: an OpenTelemetry collector for tests, OTLP/gRPC `TraceService/Export`
(opentelemetry-proto's generated code) on a loopback port, keeping every span it is sent.

    with OtlpReceiver() as receiver:          # serving on receiver.endpoint ("127.0.0.1:P")
        ... point services at receiver.endpoint ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 3, timeout_s=10)
        traces = receiver.traces()            # trace id (hex) → its spans

Each span becomes a `ReceivedSpan` (ids in hex, the exporting service's `service.name`,
attributes as plain values), whoever sent it: Envoy's OpenTelemetry tracer, the platform's
Python services, vLLM.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span.

    Attributes:
        service: its resource's `service.name`.
        name: the span's name.
        trace_id / span_id / parent_id: hex ids ("" parent: a root span).
        kind: OTLP's span kind number (2 SERVER, 3 CLIENT, 1 INTERNAL).
        start_ns / end_ns: Unix nanoseconds.
        attributes: its attributes, values as Python str / int / float / bool (lists for arrays).
    """

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def _value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        self._sink(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """An OTLP/gRPC trace receiver on `127.0.0.1` (a free port unless `port`), in threads of
    its own (usable from any test, with or without an event loop)."""

    def __init__(self, port: int = 0) -> None:
        self._lock = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self._add), self._server
        )
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.endpoint = f"127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self._lock.notify_all()

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """Waits until `done(spans)` holds, then returns the spans.

        Raises:
            TimeoutError: it did not hold within `timeout_s` (the message lists span names).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{s.service}:{s.name}" for s in self._spans})
                    raise TimeoutError(f"spans received: {len(self._spans)} {names}")
                self._lock.wait(left)
            return list(self._spans)

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """The spans received so far by trace id (hex)."""
        by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for span in self.spans:
            by_trace[span.trace_id].append(span)
        return dict(by_trace)

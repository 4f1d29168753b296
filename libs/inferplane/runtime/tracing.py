"""Platform tracing: one OpenTelemetry tracer per process, exported over OTLP/gRPC, or nothing.

Every hop of a request (the Envoy edge, the endpoint picker, the replica process and its
vLLM engine) continues one W3C trace (`traceparent`). The settings are the platform's, read
from each service's settings (`ServiceSettings.otlp_traces_endpoint` and
`trace_sampling_ratio`; the replica gets the node-agent's as flags), never from a
deployment profile:

- `otlp_traces_endpoint`: the collector's OTLP/gRPC address, `host:port` (an `http://`
  prefix is accepted and dropped; the connection is plaintext h2c). "" (the default): tracing
  is off, and `Tracing` is a no-op that never imports the SDK nor does any work per request.
- `trace_sampling_ratio`: the share of traces *started here* that are recorded (0..1;
  `DEFAULT_SAMPLING_RATIO`). The sampler is parent-based: a request whose `traceparent`
  says sampled (or not) is recorded (or not) whatever the ratio, so every hop of a trace
  agrees with the edge, which decides for client requests.

Spans carry the request id as `REQUEST_ID_ATTRIBUTE`. docs/tracing.md lists the spans.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from inferplane.runtime.service._errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

DEFAULT_SAMPLING_RATIO: Final = 0.01
"""The share of traces started by a process when its settings name none: 1 %."""

REQUEST_ID_ATTRIBUTE: Final = "inferplane.request_id"
"""The span attribute holding the request's id (Envoy's `x-request-id`, the one the access
log, the usage ledger and the request records carry)."""

TRACEPARENT: Final = "traceparent"
"""W3C Trace Context's header (and gRPC metadata key): `00-<trace id>-<span id>-<flags>`."""
TRACESTATE: Final = "tracestate"


def collector_address(endpoint: str) -> str:
    """`host:port` of an OTLP endpoint given as `host:port` or `http://host:port` ("" stays "").

    Raises:
        ConfigError: an `https://` endpoint (TLS to the collector is not supported), or no
            port.
    """
    text = endpoint.strip().rstrip("/")
    if not text:
        return ""
    if text.startswith("https://"):
        raise ConfigError(
            f"otlp_traces_endpoint {endpoint!r}: TLS to the collector is not supported"
        )
    text = text.removeprefix("http://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"otlp_traces_endpoint {endpoint!r} is not host:port")
    return text


def sampled(traceparent: str) -> bool | None:
    """Whether a W3C `traceparent` says its trace is sampled (its flags' lowest bit), without
    the SDK: a hop can skip an unsampled request at the cost of one string test. None when
    `traceparent` is malformed (not `version-traceid-spanid-flags` in hex)."""
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        return bool(int(parts[3], 16) & 1)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where a process sends its spans and how many traces it starts.

    Attributes:
        endpoint: the collector's OTLP/gRPC `host:port` ("": tracing off).
        sampling_ratio: share of root traces recorded, 0..1 (parent-based: see the module).
        service_name: the `service.name` resource attribute (`inferplane-router`, ...).

    Raises:
        ConfigError: a ratio outside 0..1 or a malformed endpoint.
    """

    endpoint: str = ""
    sampling_ratio: float = DEFAULT_SAMPLING_RATIO
    service_name: str = "inferplane"

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", collector_address(self.endpoint))
        if not 0.0 <= self.sampling_ratio <= 1.0:
            raise ConfigError(
                f"trace_sampling_ratio must be within 0..1, got {self.sampling_ratio}"
            )

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded and exported at all."""
        return bool(self.endpoint)

    @property
    def url(self) -> str:
        """The endpoint as an OTLP/gRPC exporter (and vLLM) takes it: `http://host:port`."""
        return f"http://{self.endpoint}" if self.endpoint else ""

    @classmethod
    def of(cls, settings: Any, service_name: str) -> TracingSettings:
        """From a service's settings (`ServiceSettings`: `otlp_traces_endpoint`,
        `trace_sampling_ratio`) for the service `service_name`."""
        return cls(
            endpoint=settings.otlp_traces_endpoint,
            sampling_ratio=settings.trace_sampling_ratio,
            service_name=service_name,
        )


class Tracing:
    """A process's tracer, or a no-op when `settings.enabled` is False.

    Disabled, `enabled` is False and nothing else should be called per request (callers
    test `enabled` first; the methods still work and return nothing). Enabled, spans go
    through a batching processor (a background thread; export never blocks a request) to
    `exporter` (default: OTLP/gRPC to `settings.endpoint`). The tracer provider is this
    object's own, never OpenTelemetry's global one (vLLM's in-process engine sets that).
    """

    def __init__(self, settings: TracingSettings, *, exporter: SpanExporter | None = None) -> None:
        self.settings = settings
        self.enabled = settings.enabled or exporter is not None
        self._provider: Any = None
        self._tracer: Tracer | None = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.url, insecure=True)
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sampling_ratio)),
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("inferplane")

    @property
    def tracer(self) -> Tracer | None:
        """The OpenTelemetry tracer (None when disabled)."""
        return self._tracer

    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context | None:
        """The remote parent named by W3C headers in `carrier` (lower-case keys:
        `traceparent`, `tracestate`); None when there is none or it is malformed."""
        if TRACEPARENT not in carrier:
            return None
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract(carrier)
        if not trace.get_current_span(context).get_span_context().is_valid:
            return None
        return context

    @staticmethod
    def headers(span: Span) -> dict[str, str]:
        """W3C headers naming `span` as the parent (`traceparent`, and `tracestate` when
        set), for the next hop (vLLM's `trace_headers`)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        return carrier

    def start(
        self,
        name: str,
        parent: Context | Span | None,
        *,
        start_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        server: bool = False,
    ) -> Span | None:
        """Starts span `name` under `parent` (an extracted context, a span, or None: a new
        trace, sampled at the settings' ratio) at `start_ns` (Unix nanoseconds, default now);
        the caller ends it (`span.end(end_time=ns)`). `server`: the span is the process's
        SERVER span of a request. None when disabled."""
        tracer = self._tracer
        if tracer is None:
            return None
        from opentelemetry import trace

        context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return tracer.start_span(
            name,
            context=context,  # type: ignore[arg-type]
            kind=trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL,
            attributes=dict(attributes or {}),
            start_time=start_ns if start_ns is not None else time.time_ns(),
        )

    def record(
        self,
        name: str,
        parent: Context | Span | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span | None:
        """A finished span `name` from `start_ns` to `end_ns` (Unix nanoseconds) under
        `parent`: a stage measured first and written once, off its hot path. None when
        disabled."""
        span = self.start(name, parent, start_ns=start_ns, attributes=attributes)
        if span is not None:
            span.end(end_time=max(end_ns, start_ns))
        return span

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Exports every finished span now (tests, shutdown); True when done in time."""
        if self._provider is None:
            return True
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Flushes and stops the exporter (idempotent; a no-op when disabled)."""
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is not None:
            provider.shutdown()


DISABLED: Final = Tracing(TracingSettings())
"""The no-op tracer (tracing off): what a component gets when it is given none."""

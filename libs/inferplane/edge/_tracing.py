"""The edge's traces: Envoy's OpenTelemetry tracer on the HttpConnectionManager, exporting
to the collector's cluster (`_clusters.OTLP_CLUSTER`, from `EdgeConfig.otlp_traces_endpoint`;
None: no tracing, no cluster).

With it, Envoy continues a client's W3C `traceparent` (its trace id and parent) or starts a
trace, and samples `EdgeConfig.trace_sampling_percent` of all requests (its own decision,
also for a client's sampled `traceparent`). A sampled request gets its ingress span, a child
span for the ext_proc stream to the picker (whose gRPC metadata carries that span as
`traceparent`) and an upstream span per attempt to a replica (`spawn_upstream_span`), whose
context the replica receives as the request's `traceparent`. Spans are exported over OTLP/gRPC. The
Python services continue the same trace (`inferplane.runtime.tracing`); docs/tracing.md.
"""

from __future__ import annotations

from inferplane.edge._base import TYPE_URL_PREFIX, Resource
from inferplane.edge._clusters import OTLP_CLUSTER
from inferplane.edge._config import EdgeConfig
from inferplane.runtime.tracing import REQUEST_ID_ATTRIBUTE
from inferplane.wire.headers import REQUEST_ID

#: The edge's `service.name` in its spans.
EDGE_SERVICE_NAME = "inferplane-edge"

_OTEL_CONFIG = TYPE_URL_PREFIX + "envoy.config.trace.v3.OpenTelemetryConfig"


def build_tracing(config: EdgeConfig) -> Resource | None:
    """The HttpConnectionManager's `tracing` (None when `config.otlp_traces_endpoint` is
    None): Envoy's OpenTelemetry tracer exporting to `OTLP_CLUSTER`, requests sampled at
    `config.trace_sampling_percent` (a client's `traceparent` gives the trace id and parent,
    not the decision: libs/tests/edge/test_edge_tracing.py), an upstream span per attempt,
    the request id as `REQUEST_ID_ATTRIBUTE`."""
    if config.otlp_traces_endpoint is None:
        return None
    return {
        "random_sampling": {"value": config.trace_sampling_percent},
        "spawn_upstream_span": True,
        "custom_tags": [
            {
                "tag": REQUEST_ID_ATTRIBUTE,
                "request_header": {"name": REQUEST_ID, "default_value": ""},
            }
        ],
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": _OTEL_CONFIG,
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": OTLP_CLUSTER},
                    "timeout": "1s",
                },
                "service_name": EDGE_SERVICE_NAME,
            },
        },
    }

"""Prometheus exposition of request records: histograms and counters in base units.

Names follow vLLM's and OpenTelemetry GenAI's where they exist (`time_to_first_token_seconds`,
`inter_token_latency_seconds`, `e2e_request_latency_seconds`, `queue_time_seconds`), prefixed
`inferplane_`. Every label value goes through a cap (`LabelLimiter`), so a client sending
10,000 distinct tenants, models or error codes cannot blow up the series count:

    series ≤ models × deployments/model × (tenants/deployment + 1) × per-metric label values
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Histogram

from inferplane.telemetry.domain import OTHER, LabelLimiter
from inferplane.telemetry.store import Sample

TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    60.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TOKEN_KINDS = ("prompt", "cached", "completion", "reasoning")
INVALID_REASONS = ("unknown_tool", "invalid_json", "schema_mismatch")
SOURCES = ("router", "replica")
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class LabelCaps:
    """Distinct label values kept before the rest fold into "other"."""

    models: int = 50
    deployments_per_model: int = 20
    tenants_per_deployment: int = 20
    error_codes: int = 10


class RecordMetrics:
    """The request-record metrics in the registry of the composition root.

    `observe_request` feeds latency, status and token metrics; `observe_parse` feeds tool-call
    and marker metrics (the service decides which source feeds which, so a request reported by
    both the router and the replica process is counted once).
    """

    def __init__(self, registry: CollectorRegistry, caps: LabelCaps | None = None) -> None:
        caps = caps or LabelCaps()
        self._models = LabelLimiter(caps.models)
        self._deployments = LabelLimiter(caps.deployments_per_model)
        self._tenants = LabelLimiter(caps.tenants_per_deployment)
        self._codes = LabelLimiter(caps.error_codes)
        md = ["model", "deployment"]
        mdt = [*md, "tenant"]
        self.ttft = Histogram(
            "inferplane_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token.",
            mdt,
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "inferplane_inter_token_latency_seconds",
            "Seconds between consecutive output tokens (each gap, or a request's mean gap).",
            mdt,
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "inferplane_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last byte.",
            mdt,
            registry=registry,
            buckets=E2E_BUCKETS,
        )
        self.queue = Histogram(
            "inferplane_queue_time_seconds",
            "Seconds a request waited in the router's admission queue.",
            mdt,
            registry=registry,
            buckets=QUEUE_BUCKETS,
        )
        self.requests = Counter(
            "inferplane_requests",
            'Requests finished, by status ("ok" or the OpenAI error code).',
            [*mdt, "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "inferplane_tokens",
            "Tokens by kind: prompt, cached (prompt tokens from the prefix cache), completion, "
            "reasoning (completion tokens that were reasoning).",
            [*mdt, "kind"],
            registry=registry,
        )
        self.tool_calls = Counter(
            "inferplane_tool_calls",
            "Tool calls emitted, by validity against the request's tools and invalid reason.",
            [*md, "validity", "reason"],
            registry=registry,
        )
        self.markers_leaked = Counter(
            "inferplane_markers_leaked",
            "Parser markers found in content or reasoning (must stay 0).",
            md,
            registry=registry,
        )
        self.received = Counter(
            "inferplane_telemetry_records_received",
            "Request records received, by source and outcome (stored, duplicate).",
            ["source", "outcome"],
            registry=registry,
        )

    def labels(self, sample: Sample) -> tuple[str, str, str]:
        """Capped (model, deployment, tenant) label values of `sample`."""
        model = self._models.admit((), sample.model or UNKNOWN)
        deployment = self._deployments.admit((model,), sample.deployment or UNKNOWN)
        tenant = self._tenants.admit((model, deployment), sample.tenant or UNKNOWN)
        return model, deployment, tenant

    def observe_received(self, source: str, stored: bool) -> None:
        self.received.labels(
            source if source in SOURCES else OTHER, "stored" if stored else "duplicate"
        ).inc()

    def observe_request(self, sample: Sample) -> None:
        """Latency histograms, requests by status and tokens by kind."""
        labels = self.labels(sample)
        status = self._codes.admit((), sample.error_code or "error") if sample.failed else "ok"
        self.requests.labels(*labels, status).inc()
        if sample.ttft > 0:
            self.ttft.labels(*labels).observe(sample.ttft)
        if sample.e2e > 0:
            self.e2e.labels(*labels).observe(sample.e2e)
        self.queue.labels(*labels).observe(max(0.0, sample.queue_time))
        itl = self.itl.labels(*labels)
        for gap in sample.itl:
            itl.observe(gap)
        counts = (
            sample.prompt_tokens,
            sample.cached_tokens,
            sample.completion_tokens,
            sample.reasoning_tokens,
        )
        for kind, count in zip(TOKEN_KINDS, counts, strict=True):
            if count:
                self.tokens.labels(*labels, kind).inc(count)

    def observe_parse(self, sample: Sample) -> None:
        """Tool calls by validity and reason, and leaked markers."""
        model, deployment, _ = self.labels(sample)
        if sample.tool_calls_valid:
            self.tool_calls.labels(model, deployment, "valid", "none").inc(sample.tool_calls_valid)
        invalid = max(0, sample.tool_calls - sample.tool_calls_valid)
        reasons = list(sample.tool_call_invalid_reasons[:invalid])
        reasons += [UNKNOWN] * (invalid - len(reasons))
        for reason in reasons:
            label = reason if reason in INVALID_REASONS else OTHER
            self.tool_calls.labels(model, deployment, "invalid", label).inc()
        if sample.markers_leaked:
            self.markers_leaked.labels(model, deployment).inc(sample.markers_leaked)
        else:
            # Expose the zero so dashboards and alerts see "0", not "no data".
            self.markers_leaked.labels(model, deployment)

"""Window summaries of stored samples: exact percentiles, counts and rates."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from inferplane.telemetry.domain import Sources, percentiles
from inferplane.telemetry.store import Query, SampleStore

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """Numbers over one window (seconds, tokens/s, ratios).

    Percentile lists are `[(p, seconds)]` in the order asked, NaN where there were no samples.
    ITL percentiles are over every inter-token gap the senders kept (a request's mean gap when
    it kept none), so long responses weigh more, as with vLLM's per-token histogram.
    """

    window_seconds: float
    request_count: int
    error_count: int
    ttft: list[tuple[float, float]]
    itl: list[tuple[float, float]]
    e2e: list[tuple[float, float]]
    completion_tokens: int
    tool_calls: int
    tool_calls_valid: int

    @property
    def output_tokens_per_second(self) -> float:
        return self.completion_tokens / self.window_seconds if self.window_seconds > 0 else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.request_count / self.window_seconds if self.window_seconds > 0 else 0.0

    @property
    def error_rate(self) -> float:
        return self.error_count / self.request_count if self.request_count else 0.0

    @property
    def tool_call_validity(self) -> float:
        """Valid / emitted tool calls; 1 when none were emitted (nothing was wrong)."""
        return self.tool_calls_valid / self.tool_calls if self.tool_calls else 1.0

    def value(self, metric: str, p: float) -> float:
        """The `p` percentile of "ttft", "itl" or "e2e" (it must have been asked for)."""
        values: list[tuple[float, float]] = getattr(self, metric)
        return dict(values)[p]


def summarize(
    store: SampleStore,
    *,
    now: float,
    window_seconds: float,
    sources: Sources,
    ps: Sequence[float] = DEFAULT_PERCENTILES,
    model: str = "",
    deployment: str = "",
    tenant: str = "",
    revision: str = "",
) -> Summary:
    """Summarizes samples that finished in (now - window, now] matching the filters
    (`revision`: only the records of that profile revision, router's and replica's alike: a
    canary against its stable revision, issue 30).

    Requests, errors, latency and tokens come from `sources.request`'s records; tool calls from
    `sources.tool_call`'s (see `Sources`).

    Raises:
        ValueError: a percentile outside (0, 100].
    """
    base = Query(
        since=now - window_seconds,
        until=now,
        model=model,
        deployment=deployment,
        tenant=tenant,
        revision=revision,
    )
    requests = [s for s in store.select(base) if sources.counts_request(s.source)]
    parses = (s for s in store.select(base) if sources.counts_tool_calls(s.source))
    tool_calls = valid = 0
    for sample in parses:
        tool_calls += sample.tool_calls
        valid += min(sample.tool_calls_valid, sample.tool_calls)
    return Summary(
        window_seconds=window_seconds,
        request_count=len(requests),
        error_count=sum(1 for s in requests if s.failed),
        ttft=percentiles((s.ttft for s in requests if s.ttft > 0), ps),
        itl=percentiles((gap for s in requests for gap in s.itl), ps),
        e2e=percentiles((s.e2e for s in requests if s.e2e > 0), ps),
        completion_tokens=sum(s.completion_tokens for s in requests),
        tool_calls=tool_calls,
        tool_calls_valid=valid,
    )

"""Telemetry domain: values and the pure math (percentiles, counter rates, drift).

Everything here is plain Python without gRPC or Prometheus, so the rules are testable with
hand-made numbers and times.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

OTHER = "other"
"""Label value that absorbs distinct values beyond a cardinality cap."""


# -- percentiles -----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0 < p ≤ 100) of ascending `sorted_values`, exact.

    Linear interpolation between the closest ranks (Hyndman & Fan 1996, definition 7; numpy's
    default `method="linear"`): with n values and h = (n - 1)·p/100, the result is
    v[⌊h⌋] + (h - ⌊h⌋)·(v[⌊h⌋+1] - v[⌊h⌋]). So p100 is the maximum and p50 of [1, 2] is 1.5.
    Returns NaN for no values.

    Raises:
        ValueError: p outside (0, 100].
    """
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    h = (n - 1) * p / 100.0
    low = math.floor(h)
    high = min(low + 1, n - 1)
    return sorted_values[low] + (h - low) * (sorted_values[high] - sorted_values[low])


def percentiles(values: Iterable[float], ps: Sequence[float]) -> list[tuple[float, float]]:
    """`[(p, value)]` for each p in `ps`, over `values` (any order); NaN values when empty."""
    ordered = sorted(values)
    return [(p, percentile(ordered, p)) for p in ps]


# -- counters scraped from engines -----------------------------------------------------------


def counter_increase(points: Sequence[tuple[float, float]]) -> float:
    """Increase of a monotonic counter over time-ordered `(t, value)` points.

    A value lower than its predecessor is a counter reset (the engine restarted): the increase
    across it is the new value, as Prometheus's `increase()` assumes (a reset counter restarts
    from 0). Fewer than two points → 0.
    """
    total = 0.0
    for (_, before), (_, after) in itertools.pairwise(points):
        total += after - before if after >= before else after
    return total


def counter_rate(points: Sequence[tuple[float, float]]) -> float:
    """Per-second rate of a counter: `counter_increase / (t_last - t_first)`; 0 when undefined."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return 0.0
    return counter_increase(points) / (points[-1][0] - points[0][0])


def ratio_or(numerator: float, denominator: float, default: float) -> float:
    """numerator / denominator, or `default` when the denominator is 0."""
    return numerator / denominator if denominator > 0 else default


# -- p99 drift -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DriftPolicy:
    """How p99 drift is judged (units: seconds, ratios).

    The lesson behind it: a 10% rise of p99 over an hour caught KV-cache fragmentation 6–8
    hours before it became an outage (issue 7), while averages hid it.

    Attributes:
        current_window_seconds: the current p99 is over samples in (now - current, now].
        baseline_window_seconds: length of the trailing baseline window (see `drift`).
        threshold: relative rise that fires, e.g. 0.10 for ≥ 10%.
        min_samples: fewer samples in the current window → no judgement.
        min_baseline_points: fewer p99 snapshots in the baseline window → no judgement.
    """

    current_window_seconds: float = 3600.0
    baseline_window_seconds: float = 6 * 3600.0
    threshold: float = 0.10
    min_samples: int = 50
    min_baseline_points: int = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Drift:
    """A drift judgement: current p99, baseline p99 and the relative change (seconds, ratio)."""

    current: float
    baseline: float

    @property
    def change(self) -> float:
        return (self.current - self.baseline) / self.baseline if self.baseline > 0 else 0.0


def baseline_p99(
    snapshots: Sequence[tuple[float, float]], now: float, policy: DriftPolicy
) -> float | None:
    """The trailing baseline of a p99 at `now`, from `(t, p99)` snapshots.

    Each snapshot is the one-hour p99 (over `current_window_seconds`) as it was evaluated at
    time t. The baseline is the MEDIAN of the snapshots with
    `now - current - baseline_window < t ≤ now - current`, i.e. of the hourly p99s seen during
    the `baseline_window` (default 6 h) that ends where the current hour begins, so the current
    hour's samples never count in their own baseline and one bad hour in the baseline cannot
    move it much. None when fewer than `min_baseline_points` snapshots qualify.
    """
    end = now - policy.current_window_seconds
    start = end - policy.baseline_window_seconds
    values = sorted(v for t, v in snapshots if start < t <= end and not math.isnan(v))
    if len(values) < policy.min_baseline_points:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def drift(
    current_p99: float,
    sample_count: int,
    snapshots: Sequence[tuple[float, float]],
    now: float,
    policy: DriftPolicy,
) -> Drift | None:
    """The drift of `current_p99` against `baseline_p99(snapshots, now, policy)`.

    None when there are too few samples or baseline points to judge. The alert fires when
    `Drift.change >= policy.threshold`.
    """
    if sample_count < policy.min_samples or math.isnan(current_p99):
        return None
    base = baseline_p99(snapshots, now, policy)
    if base is None or base <= 0:
        return None
    return Drift(current=current_p99, baseline=base)


# -- which sender owns which numbers --------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Sources:
    """Which record source feeds which numbers, so a request reported by both the router and
    the replica process counts once. Empty means any source.

    Attributes:
        request: feeds request counts, status, latency and tokens (default "router": the
            client's view, including admission queue, retries and router-side failures).
        tool_call: feeds tool-call validity and leaked markers (default "replica": the replica
            process parses and validates the output; `ingest.record_source` reads an older
            replica's "node-agent" as "replica").
    """

    request: str = "router"
    tool_call: str = "replica"

    def counts_request(self, source: str) -> bool:
        return not self.request or source == self.request

    def counts_tool_calls(self, source: str) -> bool:
        return not self.tool_call or source == self.tool_call


# -- SLO targets -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SloTargets:
    """One deployment's SLO targets.

    Attributes:
        ttft_p99_seconds: TTFT p99 must stay at or below this.
        itl_p99_seconds: ITL p99 must stay at or below this.
        max_error_rate: failed requests / requests must stay at or below this (0..1).
        min_tool_call_validity: valid tool calls / tool calls must stay at or above this (0..1).
        normal_load_requests_per_second: load up to which any preemption is an alert; 0 means
            every load is normal (any preemption alerts). Preemptions above it are capacity
            signals for the autoscaler, not incidents.
        min_requests: fewer requests in the window → error-rate and SLO-latency alerts wait.
    """

    ttft_p99_seconds: float = 2.0
    itl_p99_seconds: float = 0.2
    max_error_rate: float = 0.01
    min_tool_call_validity: float = 0.99
    normal_load_requests_per_second: float = 0.0
    min_requests: int = 20

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


# -- label cardinality -----------------------------------------------------------------------


class LabelLimiter:
    """Caps the distinct values of one label under each parent key; overflow becomes "other".

    Values seen first keep their own series for the life of the process (a series never moves
    to "other" once it exists); the `cap + 1`-th distinct value under a parent and every later
    new one map to `OTHER`. Parents must themselves be capped values (e.g. a deployment that
    went through its own limiter), so memory stays bounded by the product of the caps.
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._seen: dict[tuple[str, ...], set[str]] = {}

    def admit(self, parent: tuple[str, ...], value: str) -> str:
        """`value` when it is (or can become) one of the parent's first `cap` values, else OTHER."""
        seen = self._seen.setdefault(parent, set())
        if value in seen:
            return value
        if len(seen) < self._cap:
            seen.add(value)
            return value
        return OTHER

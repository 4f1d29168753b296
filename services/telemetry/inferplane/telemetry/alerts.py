"""SLO and drift alerts: pure condition rules, an evaluator over the store and engine stats,
and the alert book that turns conditions into firing/resolved alerts with start/end times.

Kinds (one alert per kind and deployment):

| kind | fires when |
|---|---|
| `ttft_p99_drift`, `itl_p99_drift` | the last hour's p99 ≥ 10% above its trailing baseline |
| `ttft_p99`, `itl_p99` | the p99 over the SLO window is above the deployment's target |
| `error_rate` | failed / requests over the SLO window is above the target |
| `tool_call_validity` | valid / emitted tool calls over the SLO window is below the target |
| `preemptions` | the engines preempted at all over the engine window while the load was normal |

The drift baseline is defined in `domain.baseline_p99`. A rule that cannot judge (too few
samples) reads as "not firing": like Prometheus, an alert resolves when its data goes away.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable

from inferplane.runtime.time.clock import Clock
from inferplane.telemetry.domain import DriftPolicy, SloTargets, Sources, drift
from inferplane.telemetry.engines import DeploymentEngineStats
from inferplane.telemetry.store import SampleStore
from inferplane.telemetry.summary import summarize


@dataclasses.dataclass(frozen=True, slots=True)
class Condition:
    """One rule's verdict for one deployment at one evaluation."""

    kind: str
    deployment: str
    firing: bool
    value: float
    threshold: float
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Alert:
    """An alert; `end_time` is None while firing (epoch seconds)."""

    kind: str
    deployment: str
    message: str
    value: float
    threshold: float
    start_time: float
    end_time: float | None = None

    @property
    def firing(self) -> bool:
        return self.end_time is None


# -- rules (pure) ----------------------------------------------------------------------------


def drift_condition(
    kind: str,
    deployment: str,
    current_p99: float,
    samples: int,
    snapshots: Iterable[tuple[float, float]],
    now: float,
    policy: DriftPolicy,
) -> Condition:
    """`kind` drift: fires when the relative rise of p99 over its baseline ≥ the threshold."""
    verdict = drift(current_p99, samples, list(snapshots), now, policy)
    if verdict is None:
        return Condition(kind, deployment, False, 0.0, policy.threshold, "not enough data")
    return Condition(
        kind,
        deployment,
        verdict.change >= policy.threshold,
        verdict.change,
        policy.threshold,
        f"{kind.removesuffix('_drift')} of {deployment} is {verdict.current * 1000:.1f} ms over "
        f"the last {policy.current_window_seconds / 3600:g} h, {verdict.change:+.1%} against "
        f"its baseline {verdict.baseline * 1000:.1f} ms",
    )


def above_condition(
    kind: str, deployment: str, value: float, target: float, enough: bool, what: str
) -> Condition:
    """Fires when `value` > `target` and there was enough data."""
    firing = enough and not math.isnan(value) and value > target
    return Condition(
        kind,
        deployment,
        firing,
        value,
        target,
        f"{what} of {deployment} is {value:.4g}, above the target {target:.4g}",
    )


def below_condition(
    kind: str, deployment: str, value: float, target: float, enough: bool, what: str
) -> Condition:
    """Fires when `value` < `target` and there was enough data."""
    firing = enough and value < target
    return Condition(
        kind,
        deployment,
        firing,
        value,
        target,
        f"{what} of {deployment} is {value:.4g}, below the target {target:.4g}",
    )


def preemption_condition(
    deployment: str,
    stats: DeploymentEngineStats | None,
    requests_per_second: float,
    targets: SloTargets,
) -> Condition:
    """Fires on any preemption over the engine window while load ≤ the normal load (0: always).

    Preemptions should be zero under normal load (issue 7): they mean the KV cache ran out and
    a request's blocks were taken back and recomputed, which shows up as p99 spikes that
    averages hide.
    """
    count = stats.preemptions if stats is not None else 0.0
    normal = (
        targets.normal_load_requests_per_second <= 0
        or requests_per_second <= targets.normal_load_requests_per_second
    )
    return Condition(
        "preemptions",
        deployment,
        count > 0 and normal,
        count,
        0.0,
        f"{deployment} preempted {count:g} requests' KV cache at {requests_per_second:.2f} "
        "requests/s (normal load)",
    )


# -- the book --------------------------------------------------------------------------------


class AlertBook:
    """Firing and recently resolved alerts, keyed by (kind, deployment).

    A firing condition opens an alert (start = now) or refreshes its value and message; a
    condition not firing, or absent from an evaluation, resolves an open alert (end = now).
    Resolved alerts are kept `keep_resolved_seconds` (1 h), then forgotten.
    """

    def __init__(self, keep_resolved_seconds: float = 3600.0) -> None:
        self._keep = keep_resolved_seconds
        self._open: dict[tuple[str, str], Alert] = {}
        self._resolved: deque[Alert] = deque()

    def update(self, conditions: Iterable[Condition], now: float) -> None:
        firing: set[tuple[str, str]] = set()
        for cond in conditions:
            if not cond.firing:
                continue
            key = (cond.kind, cond.deployment)
            firing.add(key)
            start = self._open[key].start_time if key in self._open else now
            self._open[key] = Alert(
                cond.kind, cond.deployment, cond.message, cond.value, cond.threshold, start
            )
        for key in [k for k in self._open if k not in firing]:
            self._resolved.append(dataclasses.replace(self._open.pop(key), end_time=now))
        while self._resolved and (self._resolved[0].end_time or 0.0) < now - self._keep:
            self._resolved.popleft()

    def alerts(self, *, include_resolved: bool, now: float) -> list[Alert]:
        """Firing alerts (oldest first), then resolved ones from the last hour (newest first)."""
        result = sorted(self._open.values(), key=lambda a: (a.start_time, a.kind, a.deployment))
        if include_resolved:
            result += [
                a for a in reversed(self._resolved) if (a.end_time or 0.0) >= now - self._keep
            ]
        return result


# -- the evaluator ---------------------------------------------------------------------------


class Evaluator:
    """Runs every rule for every deployment seen in the store or the engine targets.

    Each `evaluate()` also records the current one-hour p99s as snapshots (kept for the
    current + baseline windows), which later evaluations use as their drift baseline. Call it
    at a steady interval (`evaluation_interval_seconds`); `min_baseline_points` in the drift
    policy is in evaluations.
    """

    def __init__(
        self,
        store: SampleStore,
        clock: Clock,
        *,
        slo: Callable[[str], SloTargets],
        engine_stats: Callable[[], dict[str, DeploymentEngineStats]] = dict,
        sources: Sources | None = None,
        drift_policy: DriftPolicy | None = None,
        slo_window_seconds: float = 300.0,
        book: AlertBook | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._slo = slo
        self._engine_stats = engine_stats
        self._sources = sources or Sources()
        self._policy = drift_policy or DriftPolicy()
        self._slo_window = slo_window_seconds
        self.book = book or AlertBook()
        self._snapshots: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def snapshots(self, deployment: str, metric: str) -> list[tuple[float, float]]:
        """The recorded `(t, p99)` snapshots of "ttft" or "itl" for a deployment."""
        return list(self._snapshots.get((deployment, metric), ()))

    def evaluate(self) -> list[Condition]:
        """Evaluates every rule now, updates the book, returns the verdicts."""
        now = self._clock.time()
        self._store.prune(now)
        engines = self._engine_stats()
        deployments = {d for _, d in self._store.deployments()} | set(engines)
        conditions: list[Condition] = []
        for deployment in sorted(deployments):
            conditions += self._evaluate(deployment, engines.get(deployment), now)
        self.book.update(conditions, now)
        return conditions

    def _evaluate(
        self, deployment: str, engine: DeploymentEngineStats | None, now: float
    ) -> list[Condition]:
        targets = self._slo(deployment)
        policy = self._policy
        hour = summarize(
            self._store,
            now=now,
            window_seconds=policy.current_window_seconds,
            sources=self._sources,
            ps=(99.0,),
            deployment=deployment,
        )
        recent = summarize(
            self._store,
            now=now,
            window_seconds=self._slo_window,
            sources=self._sources,
            ps=(99.0,),
            deployment=deployment,
        )
        out: list[Condition] = []
        horizon = now - policy.current_window_seconds - policy.baseline_window_seconds
        for metric in ("ttft", "itl"):
            p99 = hour.value(metric, 99.0)
            history = self._snapshots.setdefault((deployment, metric), deque())
            out.append(
                drift_condition(
                    f"{metric}_p99_drift", deployment, p99, hour.request_count, history, now, policy
                )
            )
            if not math.isnan(p99) and hour.request_count >= policy.min_samples:
                history.append((now, p99))
            while history and history[0][0] <= horizon:
                history.popleft()
        enough = recent.request_count >= targets.min_requests
        out.append(
            above_condition(
                "ttft_p99",
                deployment,
                recent.value("ttft", 99.0),
                targets.ttft_p99_seconds,
                enough,
                "TTFT p99 (s)",
            )
        )
        out.append(
            above_condition(
                "itl_p99",
                deployment,
                recent.value("itl", 99.0),
                targets.itl_p99_seconds,
                enough,
                "ITL p99 (s)",
            )
        )
        out.append(
            above_condition(
                "error_rate",
                deployment,
                recent.error_rate,
                targets.max_error_rate,
                enough,
                "error rate",
            )
        )
        out.append(
            below_condition(
                "tool_call_validity",
                deployment,
                recent.tool_call_validity,
                targets.min_tool_call_validity,
                recent.tool_calls >= targets.min_requests,
                "tool-call validity",
            )
        )
        out.append(preemption_condition(deployment, engine, recent.requests_per_second, targets))
        return out

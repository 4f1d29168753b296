"""Alerts: p99 drift against the trailing baseline, SLO breaches, preemptions under normal
load; firing/resolved with start and end times, all on an injected clock."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from inferplane.telemetry.alerts import AlertBook, Condition, Evaluator
from inferplane.telemetry.domain import DriftPolicy, SloTargets, Sources
from inferplane.telemetry.engines import DeploymentEngineStats
from inferplane.telemetry.ingest import Ingestor
from inferplane.telemetry.metrics import RecordMetrics
from inferplane.telemetry.store import SampleStore
from inferplane.testing.clock import FakeClock

from .conftest import record

MINUTE = 60.0
HOUR = 3600.0


class World:
    """A store, an ingestor and an evaluator on a fake clock, with settable engine stats."""

    def __init__(self, clock: FakeClock, targets: SloTargets | None = None) -> None:
        self.clock = clock
        self.store = SampleStore(max_records=200_000, retention_seconds=2 * HOUR)
        self.ingestor = Ingestor(
            self.store, RecordMetrics(CollectorRegistry()), clock, Sources(request="", tool_call="")
        )
        self.engines: dict[str, DeploymentEngineStats] = {}
        self.targets = targets or SloTargets(min_requests=5)
        self.evaluator = Evaluator(
            self.store,
            clock,
            slo=lambda _d: self.targets,
            engine_stats=lambda: self.engines,
            sources=Sources(request="", tool_call=""),
            drift_policy=DriftPolicy(min_samples=20, min_baseline_points=3),
        )
        self.count = 0

    def traffic(self, minutes: int, ttft: float, per_minute: int = 10, **kw: object) -> None:
        """Requests finishing through each minute, then one evaluation per minute."""
        for _ in range(minutes):
            for i in range(per_minute):
                self.count += 1
                self.ingestor.ingest(
                    [
                        record(
                            request_id=f"r{self.count}",
                            ttft=ttft,
                            e2e=0.5,
                            finished_at=self.clock.time() + i * MINUTE / per_minute,
                            **kw,  # type: ignore[arg-type]
                        )
                    ]
                )
            self.clock.advance(MINUTE)
            self.evaluator.evaluate()

    def firing(self) -> set[str]:
        return {
            a.kind
            for a in self.evaluator.book.alerts(include_resolved=False, now=self.clock.time())
        }


def test_ttft_p99_drift_fires_after_ten_percent_over_an_hour_and_resolves(clock: FakeClock) -> None:
    """A 15% TTFT rise fires drift once the hour's p99 is ≥ 10% above the 6-hour baseline,
    and resolves (with an end time) once the hour is back to normal."""
    world = World(clock)
    world.traffic(3 * 60, ttft=0.200)  # 3 h of steady traffic: the baseline
    assert "ttft_p99_drift" not in world.firing()
    start = clock.time()
    world.traffic(20, ttft=0.230)  # p99 over the last hour is now 0.23 (+15%)
    assert "ttft_p99_drift" in world.firing()
    alert = next(
        a
        for a in world.evaluator.book.alerts(include_resolved=False, now=clock.time())
        if a.kind == "ttft_p99_drift"
    )
    assert start < alert.start_time <= start + 20 * MINUTE
    assert alert.value >= 0.10 and alert.threshold == 0.10
    assert "+15.0%" in alert.message
    world.traffic(61, ttft=0.200)  # the slow minutes leave the hour window
    assert "ttft_p99_drift" not in world.firing()
    resolved = [
        a
        for a in world.evaluator.book.alerts(include_resolved=True, now=clock.time())
        if a.kind == "ttft_p99_drift"
    ]
    assert resolved and resolved[0].end_time is not None
    assert resolved[0].end_time > resolved[0].start_time


def test_small_drift_does_not_fire(clock: FakeClock) -> None:
    world = World(clock)
    world.traffic(2 * 60, ttft=0.200)
    world.traffic(70, ttft=0.215)  # +7.5%
    assert "ttft_p99_drift" not in world.firing()


def test_slo_breaches_fire(clock: FakeClock) -> None:
    """Error rate above target and tool-call validity below target fire as their kinds."""
    world = World(
        clock,
        SloTargets(
            min_requests=5, max_error_rate=0.05, min_tool_call_validity=0.9, ttft_p99_seconds=1.0
        ),
    )
    world.traffic(2, ttft=0.1, tool_calls=2, tool_calls_valid=2)
    assert world.firing() == set()
    world.traffic(2, ttft=1.5, error_code="server_error", tool_calls=2, tool_calls_valid=1)
    assert {"error_rate", "tool_call_validity", "ttft_p99"} <= world.firing()


def _stats(preemptions: float) -> DeploymentEngineStats:
    return DeploymentEngineStats("kimi-tiny", 1, 1, 0.5, 1, 0, preemptions, preemptions / 300, 0.9)


def test_any_preemption_under_normal_load_fires(clock: FakeClock) -> None:
    world = World(clock, SloTargets(min_requests=5, normal_load_requests_per_second=1.0))
    world.engines = {"kimi-tiny": _stats(0)}
    world.traffic(1, ttft=0.1)
    assert "preemptions" not in world.firing()
    world.engines = {"kimi-tiny": _stats(1)}
    world.traffic(1, ttft=0.1)  # 10 requests/minute ≪ 1/s: normal load
    assert "preemptions" in world.firing()
    world.engines = {"kimi-tiny": _stats(4)}
    world.traffic(1, ttft=0.1, per_minute=600)  # 10/s over the 5-min window: overload
    assert "preemptions" not in world.firing()


def test_alert_book_keeps_start_time_and_forgets_old_resolutions() -> None:
    book = AlertBook(keep_resolved_seconds=100)
    cond = Condition("error_rate", "d", True, 0.5, 0.01, "bad")
    book.update([cond], now=10)
    book.update([cond], now=20)
    [alert] = book.alerts(include_resolved=False, now=20)
    assert (alert.start_time, alert.end_time) == (10, None)
    book.update([], now=30)
    assert book.alerts(include_resolved=False, now=30) == []
    [resolved] = book.alerts(include_resolved=True, now=30)
    assert (resolved.start_time, resolved.end_time) == (10, 30)
    book.update([], now=200)
    assert book.alerts(include_resolved=True, now=200) == []

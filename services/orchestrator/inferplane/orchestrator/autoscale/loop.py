"""`Autoscaler`: the leader's autoscaling loop (one event loop, like the reconcile loop).

Every `interval_seconds`, and at once when a router reports a request held for a cold start
(`wake`), for each deployment with autoscaling enabled: read its signals (the routers' demand
from the routing hub, TTFT p99 from telemetry through `release.gate.LatencyReader` at most every
`ttft_interval_seconds`, ready replicas from the release logic), ask the `Policy`, and when it
asks for another count write it with the decision through `Catalogue.autoscale` (one fenced
transaction; a scale-up bounded by what placement can place). The reconcile loop then starts
replicas, or retires them through the drain path (draining in the routing table, DrainReplica,
StopReplica), exactly as for an operator's change of `replicas`. Deployments without
autoscaling are never touched.

The status each autoscaled deployment shows (`DeploymentStatus.autoscaler`) and the metrics
(`inferplane_autoscaler_desired_replicas`, `inferplane_autoscaler_decisions_total`,
`inferplane_autoscaler_signal`) are the last tick's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from datetime import datetime

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from inferplane.orchestrator.autoscale.demand import DemandAggregate
from inferplane.orchestrator.autoscale.model import HOLD, AutoscalerStatus, Signals
from inferplane.orchestrator.autoscale.policy import DEFAULT_GRACE_SECONDS, Policy
from inferplane.orchestrator.catalog.model import Deployment
from inferplane.orchestrator.catalog.service import DeploymentStatus
from inferplane.orchestrator.control import ControlPlane
from inferplane.orchestrator.release.gate import LatencyReader
from inferplane.orchestrator.ticker import Ticker
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.orchestrator.autoscale")

#: The signals exported as `inferplane_autoscaler_signal{deployment,signal}`.
SIGNAL_NAMES = tuple(f.name for f in dataclasses.fields(Signals))


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    """Timings of the loop (seconds): a tick every `interval_seconds`; queued or engine-waiting
    requests count as pressure after `grace_seconds`; TTFT p99 is read over
    `ttft_window_seconds`, at most every `ttft_interval_seconds` per deployment."""

    interval_seconds: float = 2.0
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    ttft_window_seconds: float = 60.0
    ttft_interval_seconds: float = 15.0


class AutoscalerMetrics:
    """The autoscaler's Prometheus metrics on `registry` (label `deployment`: catalogue ids,
    bounded by the catalogue; a deleted deployment's series are removed)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge(
            "inferplane_autoscaler_desired_replicas",
            "Replicas the autoscaler asks for (the signals' count within the bounds).",
            ["deployment"],
            registry=registry,
        )
        self.decisions = Counter(
            "inferplane_autoscaler_decisions_total",
            "Autoscaler decisions that changed a deployment's replicas.",
            ["deployment", "decision"],
            registry=registry,
        )
        self.signal = Gauge(
            "inferplane_autoscaler_signal",
            "The signals of the autoscaler's last tick (AutoscalerSignals field names).",
            ["deployment", "signal"],
            registry=registry,
        )
        self._known: set[str] = set()

    def observe(self, deployment_id: str, desired: int, signals: Signals) -> None:
        self._known.add(deployment_id)
        self.desired.labels(deployment_id).set(desired)
        for name in SIGNAL_NAMES:
            self.signal.labels(deployment_id, name).set(getattr(signals, name))

    def remove(self, deployment_id: str) -> None:
        if deployment_id not in self._known:
            return
        self._known.discard(deployment_id)
        with contextlib.suppress(KeyError):
            self.desired.remove(deployment_id)
        for name in SIGNAL_NAMES:
            with contextlib.suppress(KeyError):
                self.signal.remove(deployment_id, name)


class Autoscaler:
    """See the module docstring.

    Args:
        control: the catalogue (read deployments, `autoscale` writes).
        demand: a deployment's aggregated router demand (`RoutingHub.demand`).
        ready: a deployment's ready replicas (`Reconciler.ready_replicas`).
        latency: TTFT p99 source; None: no TTFT signal.
        clock: `monotonic()` times the policy's windows, `now()` the decisions.
        metrics: None: no metrics.
    """

    def __init__(
        self,
        control: ControlPlane,
        demand: Callable[[str], DemandAggregate],
        ready: Callable[[str], int],
        *,
        clock: Clock,
        settings: AutoscaleSettings | None = None,
        latency: LatencyReader | None = None,
        metrics: AutoscalerMetrics | None = None,
    ) -> None:
        self._control = control
        self._demand = demand
        self._ready = ready
        self._clock = clock
        self._settings = settings or AutoscaleSettings()
        self._latency = latency
        self._metrics = metrics
        self._policy = Policy(grace_seconds=self._settings.grace_seconds)
        self._status: dict[str, AutoscalerStatus] = {}
        self._ttft: dict[str, tuple[float, float]] = {}  # deployment -> (read at, p99)
        self._ticker = Ticker(self.tick, self._settings.interval_seconds, "autoscale_failed", log)

    async def run(self) -> None:
        """Ticks until cancelled; a failing tick is logged and retried on the next one."""
        await self._ticker.run()

    def wake(self) -> None:
        """Asks for a tick soon (thread-safe): a router holds a request for a cold start."""
        self._ticker.wake()

    async def tick(self) -> None:
        """One pass over every deployment (module docstring); TTFT readings are fetched for
        all of them at once (a slow telemetry costs one timeout per tick, not one each)."""
        autoscaled = [d for d in self._control.deployments() if d.autoscaled]
        ttfts = await asyncio.gather(*(self._ttft_p99(d) for d in autoscaled))
        for deployment, ttft in zip(autoscaled, ttfts, strict=True):
            await self._one(deployment, ttft)
        seen = {d.deployment_id for d in autoscaled}
        for deployment_id in [k for k in self._status if k not in seen]:
            self._forget(deployment_id)

    def reset(self) -> None:
        """Forgets every deployment's windows, status and metrics (leadership lost: a new
        term starts its windows and idle timers over)."""
        for deployment_id in list(self._status):
            self._forget(deployment_id)
        self._policy = Policy(grace_seconds=self._settings.grace_seconds)

    async def _one(self, d: Deployment, ttft_p99_seconds: float) -> None:
        aggregate = self._demand(d.deployment_id)
        signals = Signals(
            queued_requests=aggregate.queued_requests,
            max_queue_wait_seconds=aggregate.max_queue_wait_seconds,
            queue_rejections_per_second=aggregate.queue_rejections_per_second,
            in_flight_requests=aggregate.in_flight_requests,
            engine_waiting_requests=aggregate.engine_waiting_requests,
            kv_usage=aggregate.kv_usage,
            ttft_p99_seconds=ttft_p99_seconds,
            cold_waiting_requests=aggregate.cold_waiting_requests,
            idle_seconds=aggregate.idle_seconds,
            ready_replicas=self._ready(d.deployment_id),
        )
        rec = self._policy.decide(d, signals, self._clock.monotonic())
        applied, short = d.replicas, ""
        if rec.replicas != d.replicas:
            applied, short = await asyncio.to_thread(
                self._control.autoscale,
                d.deployment_id,
                rec.replicas,
                rec.decision,
                rec.reason,
                signals,
            )
        previous = self._status.get(d.deployment_id)
        changed_at: datetime | None = previous.last_change_time if previous else None
        if applied != d.replicas:
            kind, reason, changed_at = rec.decision, rec.reason, self._clock.now()
            if self._metrics is not None:
                self._metrics.decisions.labels(d.deployment_id, kind).inc()
        else:
            kind = HOLD
            reason = rec.reason if rec.decision == HOLD else f"signals ask for {rec.desired}: "
            if rec.decision != HOLD:
                reason += rec.reason + (f"; {short}" if short else "")
        self._status[d.deployment_id] = AutoscalerStatus(
            desired_replicas=rec.desired,
            last_decision=kind,
            reason=reason,
            last_change_time=changed_at,
            signals=signals,
        )
        if self._metrics is not None:
            self._metrics.observe(d.deployment_id, rec.desired, signals)

    async def _ttft_p99(self, d: Deployment) -> float:
        """The deployment's TTFT p99 (0: unknown, or no SLO set), read at most every
        `ttft_interval_seconds`."""
        if self._latency is None or d.profile.ttft_slo_seconds <= 0:
            return 0.0
        now = self._clock.monotonic()
        cached = self._ttft.get(d.deployment_id)
        if cached is not None and now - cached[0] < self._settings.ttft_interval_seconds:
            return cached[1]
        reading = await self._latency.read(d.deployment_id, self._settings.ttft_window_seconds)
        value = reading.ttft_p99_seconds if reading is not None else 0.0
        if reading is None:
            log.warning("autoscale_ttft_unreadable", deployment=d.deployment_id)
        self._ttft[d.deployment_id] = (now, value)
        return value

    def _forget(self, deployment_id: str) -> None:
        self._status.pop(deployment_id, None)
        self._ttft.pop(deployment_id, None)
        self._policy.forget(deployment_id)
        if self._metrics is not None:
            self._metrics.remove(deployment_id)

    def status(self, deployment: Deployment, base: DeploymentStatus) -> DeploymentStatus:
        """`base` with the autoscaler's view (a status provider); unchanged when autoscaling
        is off. Before the first tick: the current count, decision "hold"."""
        if not deployment.autoscaled:
            return base
        status = self._status.get(deployment.deployment_id) or AutoscalerStatus(
            deployment.replicas, HOLD, "no tick yet", None, Signals()
        )
        if deployment.replicas == 0 and base.ready_replicas == 0:
            base = dataclasses.replace(
                base,
                phase="Available",
                message="scaled to zero: a request starts a replica (held by the router up "
                f"to {deployment.autoscaling.effective_cold_start_budget_seconds} s)",
            )
        return dataclasses.replace(base, autoscaler=status)

"""The autoscaling rule, pure: a deployment, its signals and the time in; the replicas to ask
for, the decision and its reason out. Times are monotonic seconds from the caller's clock.

Up, at once (no cooldown), when any signal asks for more:
- proportional: ceil((in flight + queued + cold waiting) / target per replica), the target
  being `autoscaling.target_in_flight_per_replica` (0: 0.8 × `max_num_seqs`);
- pressure, one replica more than now, and only once every replica asked for is ready (a
  replica still starting absorbs it; without this a queue that lasts a cold start would add
  one replica per tick): requests queued at a router for longer than `grace_seconds`, queue
  429s, requests waiting in the engines' own queues for longer than `grace_seconds`, KV
  usage above `max_kv_usage`, TTFT p99 above the profile's `ttft_slo_seconds`;
- from zero: any request held, queued or in flight → at least 1.
The result is bounded by `max_replicas` (free capacity is the catalogue's bound: it asks only
for replicas placement can place).

Down, only after every tick of a whole `scale_down_window_seconds` asked for fewer than now,
to the most any of those ticks asked for (so a load that swings above and below the target
faster than the window keeps the replicas it needed at its peak: no down/up churn), never
below `max(min_replicas, 1)`; the catalogue applies it through the drain path.

To zero, only with `scale_to_zero`: once no router saw a request for `idle_seconds_before_zero`
and nothing is in flight, queued or held. At zero, the deployment stays there until a request
is held, queued or in flight.
"""

from __future__ import annotations

import dataclasses
import math

from inferplane.orchestrator.autoscale.model import (
    HOLD,
    SCALE_DOWN,
    SCALE_FROM_ZERO,
    SCALE_TO_ZERO,
    SCALE_UP,
    Signals,
)
from inferplane.orchestrator.catalog.model import Deployment

#: Queued requests (or engine-waiting ones) count as pressure once they waited this long.
DEFAULT_GRACE_SECONDS = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class Recommendation:
    """What one tick asks for: `desired` (the signals' count within the bounds), `replicas`
    (what to set now: `desired` when scaling up or to zero, the window's maximum when scaling
    down, else the current count), the decision kind and a sentence saying why."""

    desired: int
    replicas: int
    decision: str
    reason: str


@dataclasses.dataclass(slots=True)
class _Memory:
    below_since: float | None = None  # first tick of the current run of "fewer than now"
    below_max: int = 0  # the most any tick of that run asked for
    engine_waiting_since: float | None = None
    replicas: int = -1  # the count the run was measured against


class Policy:
    """The rule of the module docstring, with each deployment's window in memory.

    Args:
        grace_seconds: how long a router queue or engine queue may hold requests before it
            counts as pressure (≥ 0).
    """

    def __init__(self, *, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
        if grace_seconds < 0:
            raise ValueError("grace_seconds must be >= 0")
        self._grace = grace_seconds
        self._memory: dict[str, _Memory] = {}

    def forget(self, deployment_id: str) -> None:
        self._memory.pop(deployment_id, None)

    def decide(self, d: Deployment, s: Signals, now: float) -> Recommendation:
        """One tick for the autoscaled deployment `d` (its `replicas` is the current count)."""
        a = d.autoscaling
        memory = self._memory.setdefault(d.deployment_id, _Memory())
        current = d.replicas
        if memory.replicas != current:  # the count moved (this rule, or the bounds): restart
            memory.below_since, memory.replicas = None, current
        target = a.target_in_flight(d.profile.max_num_seqs)
        # Routers count a request held for a cold start among their queued ones too
        # (DeploymentDemand.queued_requests), so it is counted once: the larger of the two.
        demand = s.in_flight_requests + max(s.queued_requests, s.cold_waiting_requests)
        want = math.ceil(demand / target) if demand else 0
        reasons = []
        if want > current:
            reasons.append(f"{demand} requests in flight or waiting, target {target:g} per replica")
        pressure = self._pressure(d, s, memory, now)
        if pressure:
            reasons.extend(pressure)
            if current > 0 and s.ready_replicas >= current:
                want = max(want, current + 1)
            else:
                want = max(want, current)  # the replicas asked for are still starting
        if demand and want == 0:
            want = 1
        idle = (
            a.scale_to_zero
            and demand == 0
            and s.idle_seconds >= a.effective_idle_seconds_before_zero
        )
        if idle or (current == 0 and demand == 0 and a.scale_to_zero):
            desired = 0
        else:
            desired = min(max(want, d.replica_floor), d.max_replicas)
        if desired > current:
            memory.below_since = None
            kind = SCALE_FROM_ZERO if current == 0 else SCALE_UP
            why = "; ".join(reasons) or f"below the floor of {d.replica_floor}"
            if desired < want:
                why += f" (bounded by max_replicas {d.max_replicas})"
            return Recommendation(desired, desired, kind, why)
        if desired == current:
            memory.below_since = None
            return Recommendation(desired, current, HOLD, self._holding(d, s, demand, target))
        if desired == 0:
            memory.below_since = None
            return Recommendation(
                0,
                0,
                SCALE_TO_ZERO,
                f"no request for {s.idle_seconds:.0f} s (idle_seconds_before_zero "
                f"{a.effective_idle_seconds_before_zero})",
            )
        window = a.effective_scale_down_window_seconds
        if memory.below_since is None:
            memory.below_since, memory.below_max = now, desired
        memory.below_max = max(memory.below_max, desired)
        waited = now - memory.below_since
        if waited < window:
            return Recommendation(
                desired,
                current,
                HOLD,
                f"signals ask for {desired} (at most {memory.below_max} in the last "
                f"{waited:.0f} s); scale down after {window} s below {current}",
            )
        replicas = memory.below_max
        memory.below_since = None
        return Recommendation(
            desired,
            replicas,
            SCALE_DOWN,
            f"{demand} requests in flight or waiting, target {target:g} per replica: at most "
            f"{replicas} replicas needed for {window} s",
        )

    def _pressure(self, d: Deployment, s: Signals, memory: _Memory, now: float) -> list[str]:
        """The signals that ask for one replica more, each as a phrase."""
        found = []
        if s.queued_requests and s.max_queue_wait_seconds >= self._grace:
            found.append(
                f"{s.queued_requests} requests queued at the routers, the oldest for "
                f"{s.max_queue_wait_seconds:.1f} s"
            )
        if s.queue_rejections_per_second > 0:
            found.append(f"queue 429s at {s.queue_rejections_per_second:.2f}/s")
        if s.engine_waiting_requests:
            if memory.engine_waiting_since is None:
                memory.engine_waiting_since = now
            if now - memory.engine_waiting_since >= self._grace:
                found.append(f"{s.engine_waiting_requests} requests waiting in the engines")
        else:
            memory.engine_waiting_since = None
        limit = d.autoscaling.effective_max_kv_usage
        if s.kv_usage > limit:
            found.append(f"KV cache usage {s.kv_usage:.2f} > max_kv_usage {limit:g}")
        slo = d.profile.ttft_slo_seconds
        if slo > 0 and s.ttft_p99_seconds > slo:
            found.append(f"TTFT p99 {s.ttft_p99_seconds:.3f} s > ttft_slo_seconds {slo:g}")
        return found

    @staticmethod
    def _holding(d: Deployment, s: Signals, demand: int, target: float) -> str:
        if d.replicas == 0:
            return "scaled to zero: no request waiting"
        return (
            f"{demand} requests in flight or waiting for {d.replicas} replicas (target "
            f"{target:g} per replica, bounds {d.replica_floor}..{d.max_replicas})"
        )

"""The routers' demand, per deployment: each router's latest report (`DeploymentDemand` in its
lease renewals, every few seconds and at once when a request starts waiting for a cold
deployment) with its receive time, and the aggregate the autoscaler reads.

Aggregation over the routers whose last report is fresh (a router silent for longer than
`stale_after_seconds`, its lease plus margin, drops out): queued, in-flight, engine-waiting and
cold-waiting requests are summed; the longest queue wait and the fullest replica's KV usage
are maxed; the queue-429 counter becomes a rate per router from its last two reports (a
counter that went down, a restarted router, counts as 0), summed; the requests counter gives
the idle time: seconds since any router's counter moved or any router had a request in
flight, queued or held (or since the book first saw the deployment, when no router ever
did). Times are the injected clock's monotonic seconds. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from inferplane.runtime.time.clock import Clock


@dataclasses.dataclass(frozen=True, slots=True)
class RouterDemand:
    """One router's report for one deployment (mirrors `DeploymentDemand`; the counters
    `queue_rejections_total` and `requests_total` count since the router started)."""

    queued_requests: int = 0
    max_queue_wait_seconds: float = 0.0
    queue_rejections_total: int = 0
    in_flight_requests: int = 0
    engine_waiting_requests: int = 0
    kv_usage: float = 0.0
    cold_waiting_requests: int = 0
    requests_total: int = 0

    @property
    def busy(self) -> bool:
        """A request is in flight, queued or held for a cold start at this router."""
        return bool(self.in_flight_requests or self.queued_requests or self.cold_waiting_requests)


@dataclasses.dataclass(frozen=True, slots=True)
class DemandAggregate:
    """A deployment's demand over the routers with a fresh report (see the module docstring)."""

    routers: int = 0
    queued_requests: int = 0
    max_queue_wait_seconds: float = 0.0
    queue_rejections_per_second: float = 0.0
    in_flight_requests: int = 0
    engine_waiting_requests: int = 0
    kv_usage: float = 0.0
    cold_waiting_requests: int = 0
    idle_seconds: float = 0.0


@dataclasses.dataclass(slots=True)
class _Entry:
    demand: RouterDemand
    at: float
    rejections_per_second: float = 0.0


class DemandBook:
    """Each router's latest demand per deployment (module docstring).

    Args:
        clock: its `monotonic()` times the reports.
        stale_after_seconds: a router whose last report is older no longer counts (> 0).
    """

    def __init__(self, *, clock: Clock, stale_after_seconds: float) -> None:
        if stale_after_seconds <= 0:
            raise ValueError("stale_after_seconds must be > 0")
        self._clock = clock
        self._stale = stale_after_seconds
        self._entries: dict[str, dict[str, _Entry]] = {}  # deployment -> router -> entry
        self._active: dict[str, float] = {}  # deployment -> last time a request was seen
        self._first_seen: dict[str, float] = {}

    def record(self, router_id: str, demands: Iterable[tuple[str, RouterDemand]]) -> bool:
        """Takes one renewal's reports (deployment id, demand); returns whether any of them
        holds a request for a cold start (the autoscaler should look at once)."""
        now = self._clock.monotonic()
        cold = False
        for deployment_id, demand in demands:
            routers = self._entries.setdefault(deployment_id, {})
            previous = routers.get(router_id)
            entry = _Entry(demand, now)
            if previous is not None and now > previous.at:
                grown = demand.queue_rejections_total - previous.demand.queue_rejections_total
                entry.rejections_per_second = max(0, grown) / (now - previous.at)
                moved = demand.requests_total != previous.demand.requests_total
            else:
                moved = demand.requests_total > 0  # unknown since when: counts as now
            if moved or demand.busy:
                self._active[deployment_id] = now
            routers[router_id] = entry
            cold = cold or demand.cold_waiting_requests > 0
        return cold

    def quiet_since(self, deployment_id: str, since: float) -> bool:
        """Whether at least one router has a fresh report on the deployment and every such
        router's last report came at or after monotonic `since` with nothing in flight,
        queued or held (the LoRA adapters' drain, `catalog/adapters.py`)."""
        now = self._clock.monotonic()
        fresh = [
            e for e in self._entries.get(deployment_id, {}).values() if now - e.at <= self._stale
        ]
        return bool(fresh) and all(e.at >= since and not e.demand.busy for e in fresh)

    def forget(self, router_id: str) -> None:
        """Drops a router's reports (it released its lease)."""
        for routers in self._entries.values():
            routers.pop(router_id, None)

    def aggregate(self, deployment_id: str) -> DemandAggregate:
        """The deployment's demand now (silent routers dropped)."""
        now = self._clock.monotonic()
        first = self._first_seen.setdefault(deployment_id, now)
        routers = self._entries.get(deployment_id, {})
        for router_id in [r for r, e in routers.items() if now - e.at > self._stale]:
            del routers[router_id]
        fresh = list(routers.values())
        last = self._active.get(deployment_id, first)
        return DemandAggregate(
            routers=len(fresh),
            queued_requests=sum(e.demand.queued_requests for e in fresh),
            max_queue_wait_seconds=max((e.demand.max_queue_wait_seconds for e in fresh), default=0),
            queue_rejections_per_second=sum(e.rejections_per_second for e in fresh),
            in_flight_requests=sum(e.demand.in_flight_requests for e in fresh),
            engine_waiting_requests=sum(e.demand.engine_waiting_requests for e in fresh),
            kv_usage=max((e.demand.kv_usage for e in fresh), default=0.0),
            cold_waiting_requests=sum(e.demand.cold_waiting_requests for e in fresh),
            idle_seconds=max(0.0, now - last),
        )

    def drop(self, deployment_id: str) -> None:
        """Forgets a deleted deployment."""
        self._entries.pop(deployment_id, None)
        self._active.pop(deployment_id, None)
        self._first_seen.pop(deployment_id, None)

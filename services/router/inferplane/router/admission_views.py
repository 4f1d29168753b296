"""`AdmissionViews`: what admission's queues and demand look like from outside (the picker's
message-timer extension, the lease keeper's demand report, the metrics), read from the state
`admission.Admission` keeps. Nothing here changes that state; all on the event loop thread
except `refused`'s copy, which the metrics thread may read.
"""

from __future__ import annotations

from typing import Any

from inferplane.router.demand import DemandBook, DemandSnapshot
from inferplane.router.refusals import OVERLOAD_REASONS, REFUSAL_REASONS
from inferplane.router.routes import ModelRoute
from inferplane.router.slots import AdmissionSettings
from inferplane.runtime.time.clock import Clock


class AdmissionViews:
    """Read-only views of `Admission` (its base class; the attributes are Admission's)."""

    clock: Clock
    _settings: AdmissionSettings
    _deployments: dict[str, Any]  # deployment → admission's `_Deployment` (queue, replicas)
    _refused: dict[tuple[str, str], int]
    _demand: DemandBook

    def queue_length(self, deployment: str) -> int:
        """Requests waiting for a slot in `deployment` (a cancelled one counts until its task
        runs again, within the same loop iteration)."""
        d = self._deployments.get(deployment)
        return 0 if d is None else len(d.queue)

    def queued_flows(self, deployment: str) -> int:
        """Flows (API keys; keyless requests form one) with a request waiting in `deployment`."""
        d = self._deployments.get(deployment)
        return 0 if d is None else d.queue.flows

    def refused(self, deployment: str) -> dict[str, int]:
        """Refusals of `deployment`'s queue so far by reason, every one of `REFUSAL_REASONS`
        (429s, and the 503s of `cold_start`; a counter; restarts if the deployment leaves
        the table and comes back)."""
        refused = self._refused
        return {reason: refused.get((deployment, reason), 0) for reason in REFUSAL_REASONS}

    def cold_waiting(self, deployment: str) -> int:
        """Requests held for a cold start of `deployment` now (scale from zero)."""
        return self._demand.cold_waiting(deployment)

    def wait_seconds(self, route: ModelRoute) -> float:
        """The longest a request of `route` may wait for a slot now: the queue timeout, or
        the route's cold-start budget when it scales to zero and its deployment has no
        usable replica or still holds requests for one (the picker's message-timer
        extension)."""
        wait = self._settings.queue_timeout_seconds
        if route.scale_to_zero:
            d = self._deployments.get(route.deployment_key)
            if d is not None and (
                not d.replicas.usable or self._demand.cold_waiting(route.deployment_key)
            ):
                return max(wait, self._cold_budget(route))
        return wait

    def _cold_budget(self, route: ModelRoute) -> float:
        # The route's budget, at most what the edge's one timer extension can cover.
        return min(route.cold_start_budget, self._settings.max_cold_start_budget_seconds)

    def demand(self) -> list[DemandSnapshot]:
        """Each deployment's demand as this router sees it now (`demand.DemandSnapshot`;
        engine state is the lease keeper's to add). O(deployments)."""
        now = self.clock.monotonic()
        refused, out = self._refused, []
        for name, d in self._deployments.items():
            rejections = sum(refused.get((name, reason), 0) for reason in OVERLOAD_REASONS)
            out.append(
                self._demand.snapshot(
                    name,
                    now,
                    queued=len(d.queue),
                    rejections=rejections,
                    in_flight=d.replicas.total_in_flight,
                )
            )
        return out

"""What this router sees of each deployment's demand: the autoscaler's input (issue 29).

`DemandBook` keeps, per deployment, the counters and waits that admission alone knows:
requests received (a counter), requests waiting in the admission queue with the time each
started waiting (oldest first, for the longest current wait) and those held for a cold start
(the deployment had no ready replica). `Admission` writes it in O(1) per request; the lease
keeper (`leases.CapLease`) reads one `DemandSnapshot` per deployment at each renewal
(`Admission.demand`), so the cost of reporting grows with deployments, never with requests.

Counters restart from 0 when a deployment leaves this router's table and comes back (as a
Prometheus counter after a restart: a reader takes a decrease as a reset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class DemandSnapshot:
    """One deployment's demand as this router sees it now (`DeploymentDemand`'s router part).

    Attributes:
        deployment: the deployment id.
        queued_requests: requests waiting in the admission queue (cold-held ones included).
        max_queue_wait_seconds: the longest current wait among them, seconds (0: none).
        queue_rejections_total: queue 429s since the deployment entered the table (queue
            full, flow share, timeout): a counter.
        in_flight_requests: requests holding a slot on its replicas.
        cold_waiting_requests: requests held because it had no ready replica.
        requests_total: requests routed to it (a counter).
    """

    deployment: str
    queued_requests: int = 0
    max_queue_wait_seconds: float = 0.0
    queue_rejections_total: int = 0
    in_flight_requests: int = 0
    cold_waiting_requests: int = 0
    requests_total: int = 0


@dataclasses.dataclass(slots=True)
class _Book:
    requests_total: int = 0
    cold: int = 0
    # Waiter → monotonic time it started waiting; insertion order is time order, so the first
    # entry is the oldest still waiting (removal in O(1) whatever the fair queue's order).
    waiting: dict[Hashable, float] = dataclasses.field(default_factory=dict)


class DemandBook:
    """Per-deployment request counters and waits (single-threaded: the event loop's)."""

    def __init__(self) -> None:
        self._books: dict[str, _Book] = {}

    def _book(self, deployment: str) -> _Book:
        book = self._books.get(deployment)
        if book is None:
            book = self._books[deployment] = _Book()
        return book

    def received(self, deployment: str) -> None:
        """A request was routed to `deployment`."""
        self._book(deployment).requests_total += 1

    def wait(self, deployment: str, waiter: Hashable, since: float, *, cold: bool) -> bool:
        """`waiter` joined the deployment's queue at `since` (monotonic seconds), held for a
        cold start when `cold`. Returns whether it is the first request held cold now (the
        moment to tell the orchestrator at once)."""
        book = self._book(deployment)
        book.waiting[waiter] = since
        if cold:
            book.cold += 1
            return book.cold == 1
        return False

    def left(self, deployment: str, waiter: Hashable, *, cold: bool) -> None:
        """`waiter` left the queue (granted, refused, timed out or cancelled): once."""
        book = self._books.get(deployment)
        if book is None or book.waiting.pop(waiter, None) is None:
            return
        if cold:
            book.cold -= 1

    def cold_waiting(self, deployment: str) -> int:
        """Requests held for a cold start of `deployment` now."""
        book = self._books.get(deployment)
        return 0 if book is None else book.cold

    def keep(self, deployments: Iterable[str]) -> None:
        """Forgets the deployments not in `deployments` (they left the table)."""
        wanted = set(deployments)
        self._books = {name: b for name, b in self._books.items() if name in wanted}

    def snapshot(
        self,
        deployment: str,
        now: float,
        *,
        queued: int,
        rejections: int,
        in_flight: int,
    ) -> DemandSnapshot:
        """The deployment's demand at `now`, with what admission counts itself."""
        book = self._books.get(deployment)
        if book is None:
            return DemandSnapshot(deployment, queued, 0.0, rejections, in_flight, 0, 0)
        oldest = next(iter(book.waiting.values()), None)
        return DemandSnapshot(
            deployment,
            queued_requests=queued,
            max_queue_wait_seconds=0.0 if oldest is None else max(0.0, now - oldest),
            queue_rejections_total=rejections,
            in_flight_requests=in_flight,
            cold_waiting_requests=book.cold,
            requests_total=book.requests_total,
        )

"""`ShareLease`: this router's lease on its shares of the replicas' caps as admission keeps it,
with the shares it holds over while the orchestrator is away (issue 31; the bound and why no
cap is exceeded: `leases.py`'s docstring).

A lease of epoch E granted until `until` with hold `hold` lets the router admit on the shares
of E's tables until `until + hold`. A table of another epoch (an orchestrator restart, a new
leader, a standby's view) that comes meanwhile runs on E's last shares (`effective`) until a
lease of its own epoch is granted. No I/O; time is admission's monotonic clock.
"""

from __future__ import annotations

import dataclasses
import math

from inferplane.router.replicas import ReplicaKey
from inferplane.router.routes import RouteTable


@dataclasses.dataclass(slots=True)
class ShareLease:
    """The last lease granted and the shares of its epoch's latest table."""

    epoch: str = ""
    until: float = -math.inf  # monotonic seconds
    hold: float = 0.0  # seconds after `until`
    granted: dict[ReplicaKey, int] = dataclasses.field(default_factory=dict)
    since: float = math.inf  # a new epoch's table first ran on `granted` then

    def noted(self, table: RouteTable) -> None:
        """`table` is applied: a table of the lease's epoch carries its current shares."""
        if table.lease_epoch and table.lease_epoch == self.epoch:
            self.granted = table.shares() or {}

    def effective(self, table: RouteTable, now: float) -> RouteTable:
        """`table`, or, when it is of another epoch than the lease while the lease (or its
        hold) lasts, `table` with the lease's shares (a replica not in them: 0)."""
        if not (table.lease_epoch and self.epoch and table.lease_epoch != self.epoch):
            self.since = math.inf
            return table
        if now >= self.until + self.hold:
            self.since = math.inf
            return table
        self.since = min(self.since, now)
        granted = self.granted
        routes = [
            dataclasses.replace(
                route,
                endpoints=tuple(
                    e if e.share is None else dataclasses.replace(e, share=granted.get(e.key, 0))
                    for e in route.endpoints
                ),
            )
            for route in table.routes.values()
        ]
        return RouteTable.of(
            routes,
            table.version,
            self.epoch,
            router_count=table.router_count,
            router_rank=table.router_rank,
        )

    def admit_until(self, table: RouteTable | None, held_over: bool) -> float:
        """Until when the router may admit on what it applied of `table` (`held_over`: the
        lease's shares in place of the table's own): inf when caps are not shared."""
        if table is None or not table.lease_epoch:
            return math.inf
        if self.epoch == table.lease_epoch or held_over:
            return self.until + self.hold  # its lease, then its hold
        return -math.inf

    def held_over_seconds(self, now: float, held_over: bool) -> float:
        """Seconds since the router has admitted without a lease of its table (the lease ran
        out, or a new epoch's table came), 0 before; the caller checks it may admit."""
        since = min(self.until, self.since) if held_over else self.until
        return max(0.0, now - since)

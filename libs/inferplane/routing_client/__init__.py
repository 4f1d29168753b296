"""Clients of the routing plane. `RoutingTableWatch` follows the orchestrator's
`RoutingService.WatchRoutingTable` (reconnects with backoff, keeps the last table) and hands
each caller its own snapshot type: routers route with it; telemetry finds the engines to
scrape with it. `OutcomeReporter` is a replica's non-blocking hand-off of finished requests'
summaries to the endpoint picker that picked them (`inferplane.router.v1.OutcomeService`)."""

from inferplane.routing_client._outcomes import (
    OutcomeMetrics,
    OutcomeReporter,
    OutcomeReporterSettings,
)
from inferplane.routing_client._watch import RoutingTableWatch, Sleep

DEFAULT_COLD_START_BUDGET_SECONDS = 120
"""How long the picker holds a request for a deployment at zero when the catalogue's
`Autoscaling.cold_start_budget_seconds` (and so `ModelRoute.cold_start_budget_seconds`) is 0,
seconds: the orchestrator fills the route with it, a router reading a static routes file
applies it."""

__all__ = [
    "OutcomeMetrics",
    "OutcomeReporter",
    "OutcomeReporterSettings",
    "RoutingTableWatch",
    "Sleep",
]

"""Client side of the orchestrator's routing table: `RoutingTableWatch` follows
`RoutingService.WatchRoutingTable` (reconnects with backoff, keeps the last table) and hands
each caller its own snapshot type. Routers route with it; telemetry finds the engines to
scrape with it."""

from inferplane.routing_client._watch import RoutingTableWatch, Sleep

__all__ = ["RoutingTableWatch", "Sleep"]

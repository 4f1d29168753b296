"""The routing table routers watch: model (deployment id and each alias) → ready replicas.

Versions are content hashes (16 hex digits of SHA-256 over the deterministic serialization of
the routes a watcher sees), so a restarted orchestrator publishing the same table gives the same
version and watchers can skip it. A router's view (`router_view`) carries its shares of each
replica's cap (`inferplane.orchestrator.routing.shares`) and its lease epoch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import ADAPTER_READY, LoraAdapter

ReplicaKey = tuple[str, str]
"""A replica as the routers key it: (address, replica_id)."""


def table_version(routes: Sequence[pb.ModelRoute]) -> str:
    """Content hash of `routes` (their order matters; builders sort them by model)."""
    digest = hashlib.sha256()
    for route in routes:
        data = route.SerializeToString(deterministic=True)
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()[:16]


def revision_shares(stable: str, candidate: str, candidate_percent: int) -> list[pb.RevisionShare]:
    """A route's live-traffic split during a release (issue 30, `ModelRoute.revision_shares`):
    the stable revision 100 - p percent, the candidate p (0: the candidate is dark: only
    requests pinned to its revision reach it, while it qualifies). Shares sum to 100."""
    percent = max(0, min(100, candidate_percent))
    shares = [pb.RevisionShare(revision=stable, percent=100 - percent)]
    if percent:
        shares.append(pb.RevisionShare(revision=candidate, percent=percent))
    return shares


def make_table(routes: Iterable[pb.ModelRoute]) -> pb.WatchRoutingTableResponse:
    """A table with routes sorted by model and endpoints by replica id, versioned by content."""
    ordered = []
    for route in sorted(routes, key=lambda r: r.model):
        copy = pb.ModelRoute()
        copy.CopyFrom(route)
        endpoints = sorted(copy.endpoints, key=lambda e: (e.replica_id, e.node))
        del copy.endpoints[:]
        copy.endpoints.extend(endpoints)
        ordered.append(copy)
    return pb.WatchRoutingTableResponse(version=table_version(ordered), routes=ordered)


def filter_table(
    table: pb.WatchRoutingTableResponse, models: Sequence[str]
) -> pb.WatchRoutingTableResponse:
    """Only the routes of `models` (empty: all), re-versioned for that view."""
    if not models:
        return table
    wanted = set(models)
    routes = [r for r in table.routes if r.model in wanted]
    return pb.WatchRoutingTableResponse(version=table_version(routes), routes=routes)


def adapter_routes(
    routes: Sequence[pb.ModelRoute], adapters: Iterable[LoraAdapter]
) -> list[pb.ModelRoute]:
    """The routes of the LoRA adapters (issue 29) whose base deployment has a route in `routes`
    (the route named by the deployment id): one per model name (`{deployment}:{adapter}` and
    each alias), each a copy of the base's route (its endpoints, policy, limits, owner, scaling)
    with `model`, `adapter`, `adapter_source` and the adapter's `created` set. Adapters being
    deleted get none: a request for one is a 404 at once."""
    bases = {r.model: r for r in routes if r.model == r.deployment}
    out = []
    for adapter in adapters:
        base = bases.get(adapter.base_deployment)
        if base is None or adapter.phase != ADAPTER_READY:
            continue
        created = adapter.create_time
        for model in adapter.models:
            route = pb.ModelRoute()
            route.CopyFrom(base)
            route.model = model
            route.adapter = adapter.adapter_id
            route.adapter_source = adapter.source
            route.created = int(created.timestamp()) if created else base.created
            out.append(route)
    return out


def endpoint_key(endpoint: pb.RouteEndpoint) -> ReplicaKey:
    """The replica an endpoint is: (address, replica_id)."""
    return (endpoint.address, endpoint.replica_id)


def router_view(
    table: pb.WatchRoutingTableResponse,
    models: Sequence[str],
    shares: Mapping[ReplicaKey, int],
    epoch: str,
    *,
    standby: bool,
    router_count: int = 0,
    router_rank: int = 0,
) -> tuple[pb.WatchRoutingTableResponse, dict[ReplicaKey, int]]:
    """One router's view of `table`: the routes of `models` (empty: all), each endpoint's
    `max_concurrency_share` from `shares` (0 when absent), the lease `epoch`, whether the
    hub stands by, and how many routers share the per-key limits and this one's rank among
    them. The version covers the shares, the epoch, the standby flag and the count and rank,
    so a router whose lease was lost, or whose peers changed, sees a new table. Returns the
    view and the shares it shows."""
    base = filter_table(table, models)
    routes = []
    shown: dict[ReplicaKey, int] = {}
    for route in base.routes:
        copy = pb.ModelRoute()
        copy.CopyFrom(route)
        for endpoint in copy.endpoints:
            key = endpoint_key(endpoint)
            share = shown[key] = shares.get(key, 0)
            endpoint.max_concurrency_share = share
        routes.append(copy)
    version = table_version(routes)
    content = f"{version}/{epoch}/{'standby' if standby else 'leader'}"
    if router_count:
        content += f"/{router_rank}of{router_count}"
    version = hashlib.sha256(content.encode()).hexdigest()[:16]
    view = pb.WatchRoutingTableResponse(version=version, routes=routes)
    view.lease_epoch = epoch
    view.standby = standby
    view.router_count = router_count
    view.router_rank = router_rank
    return view, shown

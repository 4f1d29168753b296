"""Translation: the platform's edge (an `EdgeConfig` and the router instances) → an xDS snapshot,
built by `inferplane.edge.build_xds_resources` (the same builders as the static bootstrap, so
the pushed edge and the local stack's cannot drift apart)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.edge import EdgeConfig, Endpoint, build_xds_resources
from inferplane.orchestrator.xds.cache import Snapshot, SnapshotCache

log = structlog.get_logger("inferplane.orchestrator.xds")


class EdgeXds:
    """Publishes the edge's snapshot for `config.node_id`: `set_routers` when the router
    instances change (today: once, from settings), `set_replicas` whenever the routing table
    does (the replicas cluster's EDS hosts, which the endpoint picker's lists name)."""

    def __init__(self, cache: SnapshotCache, config: EdgeConfig) -> None:
        self._cache = cache
        self._config = config

    @property
    def config(self) -> EdgeConfig:
        return self._config

    async def set_routers(self, routers: Sequence[str | Endpoint]) -> Snapshot:
        """Routers (`host:port`) become the EDS endpoints of the router cluster.

        Raises: EdgeConfigError (no router, a bad address); InconsistentSnapshotError.
        """
        config = dataclasses.replace(self._config, router_endpoints=tuple(routers))
        snapshot = await self._publish(config)
        log.info("edge_routers_set", routers=[str(e) for e in config.router_endpoints])
        return snapshot

    async def set_replicas(self, replicas: Sequence[str | Endpoint]) -> Snapshot | None:
        """Replica processes (`host:port`, duplicates dropped, sorted) become the EDS hosts of
        the replicas cluster; returns None when they did not change.

        Every replica of the routing table is listed, draining ones too: Envoy keeps serving
        streams already running on a host that leaves EDS, but a draining replica must stay
        a valid target for the picks made just before it started to drain.

        Raises: EdgeConfigError (a bad address); InconsistentSnapshotError.
        """
        wanted = tuple(sorted({str(r) for r in replicas}))
        if wanted == tuple(str(e) for e in self._config.replica_endpoints):
            return None
        config = dataclasses.replace(self._config, replica_endpoints=wanted)
        snapshot = await self._publish(config)
        log.info("edge_replicas_set", replicas=list(wanted))
        return snapshot

    async def follow(self, tables: AsyncIterator[pb.WatchRoutingTableResponse]) -> None:
        """Keeps the replicas cluster equal to every endpoint of each routing table from
        `tables` (e.g. `RoutingHub.watch()`), until the iterator ends or the task is cancelled.
        A table that cannot be published is logged and skipped; the next one is tried."""
        async for table in tables:
            addresses = [e.address for r in table.routes for e in r.endpoints if e.address]
            try:
                await self.set_replicas(addresses)
            except Exception:
                log.exception("edge_replicas_failed", version=table.version)

    async def _publish(self, config: EdgeConfig) -> Snapshot:
        snapshot = Snapshot.of(build_xds_resources(config))
        await self._cache.set_snapshot(config.node_id, snapshot)
        self._config = config
        return snapshot

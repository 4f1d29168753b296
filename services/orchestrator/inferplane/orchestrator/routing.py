"""The routing table routers watch: model (deployment id and each alias) → ready replicas.

`RoutingHub` keeps the latest table and wakes watchers when its content changes. Versions are
content hashes (16 hex digits of SHA-256 over the deterministic serialization of the routes a
watcher sees), so a restarted orchestrator publishing the same table gives the same version and
watchers can skip it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterable, Sequence
from functools import partial

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb


def table_version(routes: Sequence[pb.ModelRoute]) -> str:
    """Content hash of `routes` (their order matters; builders sort them by model)."""
    digest = hashlib.sha256()
    for route in routes:
        data = route.SerializeToString(deterministic=True)
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()[:16]


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


class RoutingHub:
    """The latest routing table and its watchers (one event loop)."""

    def __init__(self) -> None:
        self._table = make_table(())
        self._changed = asyncio.Condition()

    @property
    def table(self) -> pb.WatchRoutingTableResponse:
        return self._table

    async def publish(self, table: pb.WatchRoutingTableResponse) -> bool:
        """Makes `table` current; returns whether its version differs from the last one."""
        if table.version == self._table.version:
            return False
        self._table = table
        async with self._changed:
            self._changed.notify_all()
        return True

    def _differs(self, models: Sequence[str], version: str) -> bool:
        return filter_table(self._table, models).version != version

    async def watch(
        self, models: Sequence[str] = ()
    ) -> AsyncIterator[pb.WatchRoutingTableResponse]:
        """The current table (filtered to `models`) at once, then every table whose filtered
        content changed. Runs until the consumer stops iterating."""
        sent = ""
        while True:
            view = filter_table(self._table, models)
            if view.version != sent:
                sent = view.version
                yield view
                continue
            async with self._changed:
                await self._changed.wait_for(partial(self._differs, models, sent))

"""Where the routing table comes from: a static YAML file, or the orchestrator's stream.

Both hand out immutable `RouteTable` snapshots: readers call `current()` (one attribute read),
and the source swaps the whole snapshot when a new table arrives, then tells its listeners.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable
from inferplane.routing_client import RoutingTableWatch, Sleep
from inferplane.runtime.security.identity import PeerSecurity

Listener = Callable[[RouteTable], None]


class RouteSource(Protocol):
    """A routing table that may change over time."""

    def current(self) -> RouteTable:
        """The latest snapshot (never None; empty before the first table)."""
        ...

    def subscribe(self, listener: Listener) -> None:
        """Calls `listener(table)` on the event loop after every swap."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StaticRouteSource:
    """A table read once (from `routes_file`) that never changes."""

    def __init__(self, table: RouteTable) -> None:
        self._table = table

    def current(self) -> RouteTable:
        return self._table

    def subscribe(self, listener: Listener) -> None:
        listener(self._table)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def table_from_proto(message: opb.WatchRoutingTableResponse) -> RouteTable:
    """The domain table of one WatchRoutingTable message (with this router's shares of the
    caps when the message has a `lease_epoch`)."""
    shared = bool(message.lease_epoch)
    return RouteTable.of(
        (
            ModelRoute(
                model=r.model,
                deployment=r.deployment or r.model,
                routing_policy=r.routing_policy,
                tokenizer=r.tokenizer,
                endpoints=tuple(
                    Endpoint(
                        address=e.address,
                        replica_id=e.replica_id,
                        draining=e.draining,
                        weight=e.weight or 1.0,
                        max_concurrency=e.max_concurrency,
                        node=e.node,
                        # No cap (0: each router's default) is not shared.
                        share=e.max_concurrency_share if shared and e.max_concurrency else None,
                        revision=e.revision,
                    )
                    for e in r.endpoints
                ),
                max_model_len=r.max_model_len,
                created=r.created,
                owned_by=r.owned_by or "inferplane",
                scale_to_zero=r.scale_to_zero,
                cold_start_budget_seconds=float(r.cold_start_budget_seconds),
                adapter=r.adapter,
                adapter_source=r.adapter_source,
                revision_shares=tuple((s.revision, s.percent) for s in r.revision_shares),
            )
            for r in message.routes
        ),
        version=message.version,
        lease_epoch=message.lease_epoch,
        router_count=message.router_count,
        router_rank=message.router_rank,
    )


class OrchestratorRouteSource(RoutingTableWatch[RouteTable]):
    """Follows `RoutingService.WatchRoutingTable` (`inferplane.routing_client`): full table
    first, then every change, as `RouteTable` snapshots.

    On a broken or refused stream it reconnects with exponential backoff and full jitter
    (`initial_backoff_seconds` doubling up to `max_backoff_seconds`, reset once a table
    arrives), and keeps serving the last table meanwhile: an orchestrator outage freezes
    routing, it does not empty it (but shared caps admit only under a lease: `CapLease`). A
    table that fails to apply (e.g. an unknown routing policy) is logged and skipped; the
    previous one stays.

    `router_id` (non-empty) asks for this router's view: its shares of the replicas' caps.
    """

    def __init__(
        self,
        address: str,
        *,
        options: Sequence[tuple[str, Any]] = (),
        models: Sequence[str] = (),
        initial_backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 15.0,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        security: PeerSecurity | None = None,
        router_id: str = "",
    ) -> None:
        super().__init__(
            address,
            table_from_proto,
            RouteTable.of([]),
            options=options,
            models=models,
            initial_backoff_seconds=initial_backoff_seconds,
            max_backoff_seconds=max_backoff_seconds,
            sleep=sleep,
            rng=rng,
            logger="inferplane.router.routes",
            security=security,
            router_id=router_id,
        )

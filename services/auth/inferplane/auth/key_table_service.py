"""`inferplane.auth.v1.KeyTableService`: streams the `KeyTableFeed` (`inferplane.auth.key_table`)
to each watching router (and each other region's auth: `inferplane.auth.peers`): its snapshot,
its merged changes, heartbeats; and answers `RegionMonthTokens`, this region's own month
totals, to the other regions' auths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.api.auth.v1 import key_table_pb2_grpc
from inferplane.auth.key_table import (
    MAX_HEARTBEAT_SECONDS,
    MIN_HEARTBEAT_SECONDS,
    KeyTableFeed,
    KeyTableMetrics,
)
from inferplane.auth.ledger import SqlUsageLedger
from inferplane.auth.peers import region_month_tokens
from inferplane.runtime.security.identity import peer_identity
from inferplane.runtime.security.internal import InternalCallerGuard
from inferplane.runtime.time.clock import Clock

if TYPE_CHECKING:
    import grpc

    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any


class KeyTableService(key_table_pb2_grpc.KeyTableServiceServicer):  # type: ignore[misc]
    """inferplane.auth.v1.KeyTableService: `WatchKeyTable` streams the `KeyTableFeed`.

    `RegionMonthTokens` answers from `ledger` (this region's own usage only) in `clock`'s
    month; `region` names this auth's region in the answer.

    Errors: UNAUTHENTICATED / PERMISSION_DENIED for a caller the guard refuses, UNAVAILABLE
    while the database cannot be read or auth is stopping, INVALID_ARGUMENT for more than
    `peers.MAX_MONTH_KEYS` key ids.
    """

    def __init__(
        self,
        feed: KeyTableFeed,
        guard: InternalCallerGuard,
        metrics: KeyTableMetrics,
        *,
        ledger: SqlUsageLedger,
        clock: Clock,
        region: str = "",
    ) -> None:
        self._feed = feed
        self._guard = guard
        self._metrics = metrics
        self._ledger = ledger
        self._clock = clock
        self._region = region

    async def RegionMonthTokens(
        self, request: kpb.RegionMonthTokensRequest, context: Context
    ) -> kpb.RegionMonthTokensResponse:
        self._guard.check(
            dict(context.invocation_metadata() or ()), context.peer() or "", peer_identity(context)
        )
        reply: kpb.RegionMonthTokensResponse = await region_month_tokens(
            self._ledger, self._clock, self._region, request
        )
        return reply

    async def WatchKeyTable(
        self, request: kpb.WatchKeyTableRequest, context: Context
    ) -> AsyncIterator[kpb.WatchKeyTableResponse]:
        self._guard.check(
            dict(context.invocation_metadata() or ()), context.peer() or "", peer_identity(context)
        )
        heartbeat = request.heartbeat_seconds or self._feed.settings.heartbeat_seconds
        heartbeat = min(max(heartbeat, MIN_HEARTBEAT_SECONDS), MAX_HEARTBEAT_SECONDS)
        watcher = await self._feed.attach(request.router_id, context.peer() or "")
        loop = asyncio.get_running_loop()
        revision = 0
        last_sent = loop.time()
        try:
            while True:
                await watcher.wait(last_sent + heartbeat - loop.time())
                if watcher.closed:
                    return
                message = self._feed.take(watcher)
                kind = "snapshot" if message is not None and message.snapshot else "change"
                if message is None:
                    if loop.time() - last_sent < heartbeat:
                        continue
                    message = self._feed.heartbeat()
                    kind = "heartbeat"
                    if message is None:  # the database is away: let the router see the age
                        last_sent = loop.time()
                        continue
                revision += 1
                message.revision = revision
                yield message
                watcher.sent_seq = max(watcher.sent_seq, watcher.taken_seq)
                last_sent = loop.time()
                self._metrics.updates.labels(kind).inc()
        finally:
            self._feed.detach(watcher)

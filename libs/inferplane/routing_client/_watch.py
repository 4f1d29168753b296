"""Following the orchestrator's routing table: `RoutingService.WatchRoutingTable` with
reconnects, converted to each caller's own snapshot type."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as opb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.runtime.security.identity import PeerSecurity

T = TypeVar("T")

Sleep = Callable[[float], Awaitable[Any]]


class RoutingTableWatch(Generic[T]):
    """Follows `RoutingService.WatchRoutingTable`: full table first, then every change.

    Each message is turned into a snapshot by `convert` (the router's `RouteTable`,
    telemetry's engine targets...); readers call `current()`, listeners are called with each
    new snapshot on the event loop.

    On a broken or refused stream it reconnects with exponential backoff and full jitter
    (`initial_backoff_seconds` doubling up to `max_backoff_seconds`, reset once a table
    arrives), and keeps the last snapshot meanwhile: an orchestrator outage freezes what the
    caller sees, it does not empty it. A message that fails to convert, or that a listener
    raises on, is logged and skipped; the previous snapshot stays current. `router_id` is
    the router's (its view carries its shares of the replicas' caps); others leave it empty.

    `address` may name several orchestrators on one database, comma-separated (one leads,
    the others stand by: `inferplane.orchestrator.leadership`). Each reconnect after a broken
    or refused stream goes to the next one. A router's stream (`router_id`) also moves on from
    a standby (its tables say `standby`: shares of 0, renewals refused) to find the leader; a
    standby's table is applied only while none was, so that a router starting while the
    leader is away still knows the models. Telemetry and operators read any of them.

    Attributes:
        received: set once the first snapshot from the orchestrator is current.
        connects: stream attempts so far.
    """

    def __init__(
        self,
        address: str,
        convert: Callable[[opb.WatchRoutingTableResponse], T],
        initial: T,
        *,
        options: Sequence[tuple[str, Any]] = (),
        models: Sequence[str] = (),
        initial_backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 15.0,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        logger: str = "inferplane.routing_client",
        security: PeerSecurity | None = None,
        router_id: str = "",
    ) -> None:
        self._addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self._index = 0
        self._router_id = router_id
        self._security = security or PeerSecurity.plaintext()
        self._convert = convert
        self._options = list(options)
        self._models = list(models)
        self._initial = initial_backoff_seconds
        self._max = max_backoff_seconds
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._log = structlog.get_logger(logger)
        self._current = initial
        self._listeners: list[Callable[[T], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self.received = asyncio.Event()
        self.connects = 0

    @property
    def address(self) -> str:
        """The orchestrator this watch follows now (host:port)."""
        return self._addresses[self._index]

    def _move_on(self) -> None:
        """The next orchestrator, for the next connect (one address: the same)."""
        self._index = (self._index + 1) % len(self._addresses)

    def current(self) -> T:
        """The latest snapshot (`initial` before the first table)."""
        return self._current

    def subscribe(self, listener: Callable[[T], None]) -> None:
        """Calls `listener(current())` now and `listener(snapshot)` before every swap; a
        listener that raises keeps the snapshot from becoming current."""
        self._listeners.append(listener)
        listener(self._current)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="routing-table-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    def _swap(self, message: opb.WatchRoutingTableResponse) -> None:
        snapshot = self._convert(message)
        for listener in self._listeners:
            listener(snapshot)  # raises before the swap when the snapshot cannot be applied
        self._current = snapshot
        self.received.set()

    async def _follow(self) -> None:
        backoff = self._initial
        seek_leader = bool(self._router_id) and len(self._addresses) > 1
        while True:
            self.connects += 1
            address = self.address
            if self._channel is None:
                self._channel = self._security.aio_channel(address, options=self._options)
            stub = orchestrator_pb2_grpc.RoutingServiceStub(self._channel)
            try:
                call = stub.WatchRoutingTable(
                    opb.WatchRoutingTableRequest(models=self._models, router_id=self._router_id)
                )
                async for message in call:
                    if seek_leader and message.standby:
                        if not self.received.is_set():
                            self._apply(message)
                        self._log.info("routing_table_standby", address=address)
                        call.cancel()
                        break
                    backoff = self._initial
                    self._apply(message)
                else:
                    self._log.warning("routing_table_stream_ended", address=address)
            except grpc.aio.AioRpcError as exc:
                self._log.warning(
                    "routing_table_stream_failed", address=address, code=exc.code().name
                )
            if len(self._addresses) > 1:
                self._move_on()
                channel, self._channel = self._channel, None
                if channel is not None:
                    await channel.close(None)
            delay = self._rng.uniform(0, backoff)
            backoff = min(backoff * 2, self._max)
            await self._sleep(delay)

    def _apply(self, message: opb.WatchRoutingTableResponse) -> None:
        try:
            self._swap(message)
        except Exception as exc:
            self._log.error("routing_table_rejected", version=message.version, error=str(exc))
        else:
            self._log.info("routing_table", version=message.version, models=len(message.routes))

"""Where the key table comes from: auth's `KeyTableService.WatchKeyTable`, followed for as
long as the router runs and applied to its `KeyTable` (`inferplane.router.keys`).

The watch asks for a heartbeat every `heartbeat_seconds` (1 s) and presents the same
identity and internal token as the router's usage reports to auth (`inferplane.router.usage`:
the `router` certificate under mutual TLS, `x-inferplane-internal-token` when set). Auth sends
the whole table first, then what changes, then heartbeats (services/auth/README.md, "The key
table"). A stream that fails, ends, breaks the revision order or stays quiet for
`idle_timeout_seconds` (3 heartbeats) is dropped and opened again on a new channel (behind a
Service, possibly to another auth instance) after a backoff with full jitter (0.1 s doubling
up to 2 s, reset by each snapshot). The table is kept meanwhile: known keys keep working;
once it is older than the table's `stale_after_seconds`, keys it does not know get 503.

Logs: `key_table_stale` once when the table goes stale (or was never received that long),
`key_table_fresh` once when it recovers. Metrics (read at scrape):
`inferplane_router_key_table_age_seconds` (since the last update from auth; +Inf before the
first) and `inferplane_router_key_table_keys` (secret hashes held).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Gauge

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.api.auth.v1 import key_table_pb2_grpc
from inferplane.router.keys import KeyTable
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.wire import headers

log = structlog.get_logger("inferplane.router.keys")

Sleep = Callable[[float], Awaitable[Any]]


class KeyTableMetrics:
    """`inferplane_router_key_table_age_seconds` and `inferplane_router_key_table_keys`."""

    def __init__(self, registry: CollectorRegistry, table: KeyTable) -> None:
        self.age = Gauge(
            "inferplane_router_key_table_age_seconds",
            "Seconds since the last update of the key table from auth (+Inf: none yet). "
            "Above the stale bound, keys the table does not know are refused with 503.",
            registry=registry,
        )
        self.age.set_function(lambda: _age(table))
        self.keys = Gauge(
            "inferplane_router_key_table_keys",
            "Secret hashes in the key table (current secrets and rotated ones in grace).",
            registry=registry,
        )
        self.keys.set_function(lambda: len(table))


def _age(table: KeyTable) -> float:
    age = table.age_seconds()
    return math.inf if age is None else age


class KeyTableWatch:
    """Follows auth's key table into `table` (module docstring).

    Attributes:
        received: set once the first snapshot is applied.
        connects: stream attempts so far.
        snapshots: snapshots applied so far (one per successful connect).
    """

    def __init__(
        self,
        address: str,
        table: KeyTable,
        *,
        router_id: str = "",
        internal_token: str = "",
        security: PeerSecurity | None = None,
        options: Sequence[tuple[str, Any]] = (),
        heartbeat_seconds: float = 1.0,
        idle_timeout_seconds: float | None = None,
        initial_backoff_seconds: float = 0.1,
        max_backoff_seconds: float = 2.0,
        check_seconds: float = 0.25,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._address = address
        self._table = table
        self._router_id = router_id
        self._metadata: tuple[tuple[str, str], ...] = (
            ((headers.INTERNAL_TOKEN, internal_token),) if internal_token else ()
        )
        self._security = security or PeerSecurity.plaintext()
        self._options = list(options)
        self._heartbeat = heartbeat_seconds
        self._idle = idle_timeout_seconds or max(1.0, 3 * heartbeat_seconds)
        self._initial = initial_backoff_seconds
        self._max = max_backoff_seconds
        self._check = check_seconds
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._tasks: list[asyncio.Task[None]] = []
        self._channel: grpc.aio.Channel | None = None
        self._stale_logged = False
        self._failing = False
        self.received = asyncio.Event()
        self.connects = 0
        self.snapshots = 0

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(), name="key-table-watch"),
            asyncio.create_task(self._watch_age(), name="key-table-age"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._close_channel()

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    async def _follow(self) -> None:
        backoff = self._initial
        while True:
            self.connects += 1
            if await self._stream():
                backoff = self._initial
            # A new channel for the next stream: behind a Service it may reach another auth.
            await self._close_channel()
            delay = self._rng.uniform(0, backoff)
            backoff = min(backoff * 2, self._max)
            await self._sleep(delay)

    async def _stream(self) -> bool:
        """One stream, followed until it breaks; True when it delivered a snapshot."""
        self._channel = self._security.aio_channel(self._address, options=self._options)
        stub = key_table_pb2_grpc.KeyTableServiceStub(self._channel)
        call = stub.WatchKeyTable(
            kpb.WatchKeyTableRequest(router_id=self._router_id, heartbeat_seconds=self._heartbeat),
            metadata=self._metadata,
        )
        expected = 1
        try:
            while True:
                try:
                    read = await asyncio.wait_for(call.read(), self._idle)
                except TimeoutError:
                    log.warning("key_table_stream_idle", address=self._address, seconds=self._idle)
                    break
                if not isinstance(read, kpb.WatchKeyTableResponse):  # grpc.aio.EOF
                    log.warning("key_table_stream_ended", address=self._address)
                    break
                message = read
                if (expected == 1 and not message.snapshot) or message.revision != expected:
                    log.warning(
                        "key_table_stream_out_of_order",
                        address=self._address,
                        revision=message.revision,
                        expected=expected,
                    )
                    break
                expected += 1
                self._table.apply(message)
                if message.snapshot:
                    self._failing = False
                    self.snapshots += 1
                    self.received.set()
                    log.info("key_table_snapshot", address=self._address, keys=len(self._table))
                self._check_age()
        except grpc.aio.AioRpcError as exc:
            # Said once per outage (the first failure after a stream that worked, or at
            # start); the retries after it at debug level.
            (log.debug if self._failing else log.warning)(
                "key_table_stream_failed", address=self._address, code=exc.code().name
            )
            self._failing = True
        finally:
            call.cancel()
        return expected > 1

    async def _watch_age(self) -> None:
        started = asyncio.get_running_loop().time()
        while True:
            waited = asyncio.get_running_loop().time() - started
            # Before the first snapshot: said once the stale bound has passed since start.
            self._check_age(waited >= self._table.stale_after_seconds)
            await asyncio.sleep(self._check)

    def _check_age(self, waited: bool = False) -> None:
        """Logs once when the table goes stale (or stays unreceived), once when it recovers."""
        stale = self._table.stale()
        if stale and not self._stale_logged and (self._table.received or waited):
            self._stale_logged = True
            log.warning(
                "key_table_stale",
                address=self._address,
                age_seconds=self._table.age_seconds(),
                note="keys the table does not know get 503 auth_unavailable",
            )
        elif not stale and self._stale_logged:
            self._stale_logged = False
            log.info("key_table_fresh", address=self._address, keys=len(self._table))

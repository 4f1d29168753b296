"""The router's subscription to every replica's engine state (issue 29).

For each replica in the routing table (by replica id, at its address) the router holds one
`ReplicaProcessService.WatchReplicaState` server stream (proto
`inferplane/nodeagent/v1/replica.proto`) and writes what it says into
`EngineStates` (KV capacity, the engine's queue, adapters, `kv_events`) and the `KvIndex`
(the KV blocks the engine stored and evicted, by content hash). Cost: one stream (and one
HTTP/2 connection) per replica per router; at 10,000 replicas, 10,000 streams per router
(memory per stream: services/router/README.md, "Precise prefix routing").

Streams start and stop as replicas enter and leave the table (`on_table`); a replica that
leaves has its state and blocks dropped. A stream is dialled with the router's identity
(mutual TLS) and checks the replica's certificate against the identity `node-agent` (replica
processes present their node-agent's), as the router's other replica-facing clients do
(`PeerSecurity.server_options`). A stream that fails, ends, skips a `sequence` or stays
quiet for `idle_timeout_seconds` (the replica heartbeats at least every second) loses what it
said: the replica's state and blocks are dropped (the policies then fall back to the
approximate table for it), and it is opened again on a new channel after a backoff with full
jitter (`initial_backoff_seconds` doubling to `max_backoff_seconds`, reset by each snapshot).

Each update: `reset` → the replica's blocks are replaced by `stored`; otherwise `removed`
are dropped, then `stored` added; `kv_events` false → its blocks are dropped (none are
trusted). No request ever waits on this: the decision path reads the results only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Gauge

from inferplane.api.nodeagent.v1 import replica_pb2 as rpb
from inferplane.api.nodeagent.v1 import replica_pb2_grpc
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.kvindex import KvIndex
from inferplane.router.routes import RouteTable
from inferplane.runtime.security.identity import NODE_AGENT, PeerSecurity

log = structlog.get_logger("inferplane.router.replica_watch")

Sleep = Callable[[float], Awaitable[Any]]
#: (address, replica id): one stream each.
WatchKey = tuple[str, str]


def state_of(replica_id: str, update: rpb.WatchReplicaStateResponse) -> EngineState:
    """The `EngineState` an update describes (stamped by `EngineStates.put`)."""
    return EngineState(
        replica_id=replica_id,
        block_size=update.block_size,
        total_kv_blocks=update.total_kv_blocks,
        free_kv_blocks=update.free_kv_blocks,
        running_requests=update.running_requests,
        waiting_requests=update.waiting_requests,
        in_flight_requests=update.in_flight_requests,
        loaded_adapters=frozenset(update.loaded_adapters),
        kv_events=update.kv_events,
        preemptions_total=update.preemptions_total,
        draining=update.draining,
    )


def apply_update(index: KvIndex, replica_id: str, update: rpb.WatchReplicaStateResponse) -> None:
    """Writes one update's blocks into `index` (module docstring's rules)."""
    if not update.kv_events:
        index.drop(replica_id)
        return
    stored = [h for s in update.stored for h in s.hashes]
    if update.reset:
        index.reset(replica_id, stored)
        return
    for s in update.removed:
        index.remove(replica_id, s.hashes)
    if stored:
        index.store(replica_id, stored)


class ReplicaWatch:
    """One `WatchReplicaState` stream per replica of the routing table (module docstring).

    Args:
        states: written on every update, dropped when a stream is lost.
        index: the KV block index, written likewise.
        security: the router's identity (plaintext when None).
        options: gRPC channel options.
        router_id: sent in the request (the replica logs it).
        idle_timeout_seconds: a stream quiet this long is dropped and reopened.
        initial_backoff_seconds / max_backoff_seconds: reconnect backoff (full jitter).
        registry: where `inferplane_router_replica_state_streams` and
            `inferplane_router_kv_index_entries` are registered (None: nowhere).

    Attributes:
        connects: stream attempts per key; gaps: sequence gaps seen (all streams).
    """

    def __init__(
        self,
        states: EngineStates,
        index: KvIndex,
        *,
        security: PeerSecurity | None = None,
        options: Sequence[tuple[str, Any]] = (),
        router_id: str = "",
        idle_timeout_seconds: float = 3.0,
        initial_backoff_seconds: float = 0.1,
        max_backoff_seconds: float = 5.0,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._states = states
        self._index = index
        self._security = security or PeerSecurity.plaintext()
        self._options = [*options, *self._security.server_options(NODE_AGENT)]
        self._router_id = router_id
        self._idle = idle_timeout_seconds
        self._initial = initial_backoff_seconds
        self._max = max_backoff_seconds
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._wanted: set[WatchKey] = set()
        self._tasks: dict[WatchKey, asyncio.Task[None]] = {}
        self._open: set[WatchKey] = set()
        self._open_ids: collections.Counter[str] = collections.Counter()
        self._running = False
        self.connects: dict[WatchKey, int] = {}
        self.gaps = 0
        if registry is not None:
            streams = Gauge(
                "inferplane_router_replica_state_streams",
                "WatchReplicaState streams this router holds open (one per replica).",
                registry=registry,
            )
            streams.set_function(lambda: len(self._open))
            entries = Gauge(
                "inferplane_router_kv_index_entries",
                "(KV block, replica) pairs in the router's KV index (precise prefix routing).",
                registry=registry,
            )
            entries.set_function(lambda: len(self._index))

    @property
    def watched(self) -> frozenset[WatchKey]:
        """The replicas with a stream task now."""
        return frozenset(self._tasks)

    @property
    def open_streams(self) -> int:
        """Streams that delivered their snapshot and are still open."""
        return len(self._open)

    def on_table(self, table: RouteTable) -> None:
        """Follows a new routing table: a stream for each new replica, none for those gone
        (their states and blocks dropped). Replicas without a replica id are not watched."""
        self._wanted = {e.key for r in table.routes.values() for e in r.endpoints if e.replica_id}
        if self._running:
            self._sync()

    async def start(self) -> None:
        self._running = True
        self._sync()

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _sync(self) -> None:
        for key in list(self._tasks):
            if key not in self._wanted:
                self._tasks.pop(key).cancel()
                self._forget(key)
        for key in self._wanted - self._tasks.keys():
            self._tasks[key] = asyncio.create_task(self._follow(key), name=f"replica-watch {key}")

    def _opened(self, key: WatchKey) -> None:
        if key not in self._open:
            self._open.add(key)
            self._open_ids[key[1]] += 1

    def _forget(self, key: WatchKey) -> None:
        if key in self._open:
            self._open.remove(key)
            self._open_ids[key[1]] -= 1
            if self._open_ids[key[1]] <= 0:
                del self._open_ids[key[1]]
        # A replica that moved (its id at a new address) keeps what its new stream said.
        if key[1] not in self._open_ids:
            self._states.drop(key[1])
            self._index.drop(key[1])

    async def _follow(self, key: WatchKey) -> None:
        backoff = self._initial
        me = asyncio.current_task()
        try:
            # Also ends if a cancellation was lost: the task left `_tasks` before its cancel.
            while self._tasks.get(key) is me:
                self.connects[key] = self.connects.get(key, 0) + 1
                if await self._stream(key):
                    backoff = self._initial
                self._forget(key)
                delay = self._rng.uniform(0, backoff)
                backoff = min(backoff * 2, self._max)
                await self._sleep(delay)
        finally:
            self._forget(key)

    async def _stream(self, key: WatchKey) -> bool:
        """One stream, followed until it breaks; True when it delivered a snapshot."""
        address, replica_id = key
        channel = self._security.aio_channel(address, options=self._options)
        call = None
        expected = 1
        try:
            stub = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
            call = stub.WatchReplicaState(rpb.WatchReplicaStateRequest(router_id=self._router_id))
            while True:
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                    # cancellation that arrives as the read completes (stop would hang).
                    async with asyncio.timeout(self._idle):
                        read = await call.read()
                except TimeoutError:
                    log.warning("replica_state_idle", address=address, replica=replica_id)
                    break
                if not isinstance(read, rpb.WatchReplicaStateResponse):  # grpc.aio.EOF
                    log.info("replica_state_ended", address=address, replica=replica_id)
                    break
                if read.sequence != expected or (expected == 1 and not read.reset):
                    self.gaps += 1
                    log.warning(
                        "replica_state_gap",
                        address=address,
                        replica=replica_id,
                        sequence=read.sequence,
                        expected=expected,
                    )
                    break
                expected += 1
                self._states.put(state_of(replica_id, read))
                apply_update(self._index, replica_id, read)
                self._opened(key)
        except grpc.aio.AioRpcError as exc:
            log.debug(
                "replica_state_failed", address=address, replica=replica_id, code=exc.code().name
            )
        finally:
            if call is not None:
                call.cancel()
            await channel.close(None)
        return expected > 1

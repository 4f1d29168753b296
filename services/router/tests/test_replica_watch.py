"""The replica state watch (`ReplicaWatch`) against small fake `WatchReplicaState` servers
over real gRPC on loopback: the snapshot and updates into `EngineStates` and the `KvIndex`,
a sequence gap or a stream end → the replica's blocks dropped and a new subscription, a
replica leaving the table → its stream closed and its state dropped."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from inferplane.api.nodeagent.v1 import replica_pb2 as rpb
from inferplane.api.nodeagent.v1 import replica_pb2_grpc
from inferplane.router.engine_state import EngineStates
from inferplane.router.kvindex import KvIndex
from inferplane.router.replica_watch import ReplicaWatch
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable

Script = Callable[[int], list[rpb.WatchReplicaStateResponse]]


def update(seq: int, *, reset: bool = False, stored=(), removed=(), **kw: Any):  # type: ignore[no-untyped-def]
    return rpb.WatchReplicaStateResponse(
        sequence=seq,
        reset=reset,
        block_size=128,
        total_kv_blocks=100,
        free_kv_blocks=90,
        kv_events=kw.pop("kv_events", True),
        stored=[rpb.KvBlockSet(hashes=list(stored))] if stored else [],
        removed=[rpb.KvBlockSet(hashes=list(removed))] if removed else [],
        **kw,
    )


class FakeReplica(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    """Each stream sends `script(n)` (n: the stream's number from 0), then holds (sending
    nothing) until `release` is set, then ends."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[rpb.WatchReplicaStateRequest] = []
        self.active = 0
        self.release = asyncio.Event()

    async def WatchReplicaState(
        self, request: rpb.WatchReplicaStateRequest, context: Any
    ) -> AsyncIterator[rpb.WatchReplicaStateResponse]:
        n = len(self.requests)
        self.requests.append(request)
        self.active += 1
        try:
            for message in self.script(n):
                yield message
            await self.release.wait()
        finally:
            self.active -= 1


async def serve(fake: FakeReplica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def table(*endpoints: Endpoint) -> RouteTable:
    return RouteTable.of([ModelRoute("m", tuple(endpoints), deployment="d")])


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def make(**kw: Any) -> tuple[EngineStates, KvIndex, ReplicaWatch]:
    states = EngineStates(time.monotonic)
    index = KvIndex()
    values: dict[str, Any] = {"initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.05}
    values.update(kw)
    return states, index, ReplicaWatch(states, index, router_id="router-1", **values)


def test_snapshot_then_updates_fill_states_and_the_index() -> None:
    def script(n: int) -> list[rpb.WatchReplicaStateResponse]:
        return [
            update(1, reset=True, stored=[1, 2, 3]),
            # Every update carries the whole state; blocks are the changes since the last.
            update(2, stored=[4], removed=[2], loaded_adapters=["fr"], waiting_requests=2),
        ]

    async def scenario() -> None:
        fake = FakeReplica(script)
        server, address = await serve(fake)
        registry = CollectorRegistry()
        states, index, watch = make(registry=registry)
        watch.on_table(table(Endpoint(address, "r0"), Endpoint("127.0.0.1:1", "")))
        await watch.start()
        await until(lambda: index.holders(4) == {"r0"})  # update 2 applied
        state = states.get("r0")
        assert state is not None
        assert (state.block_size, state.total_kv_blocks, state.free_kv_blocks) == (128, 100, 90)
        assert state.kv_events and state.waiting_requests == 2
        assert state.loaded_adapters == {"fr"}
        assert index.longest_prefix([1, 2, 3]) == {"r0": 1}  # block 2 was evicted
        assert index.holders(4) == {"r0"}
        assert fake.requests[0].router_id == "router-1"
        assert watch.watched == {(address, "r0")}  # no replica id: not watched
        assert registry.get_sample_value("inferplane_router_replica_state_streams") == 1
        assert registry.get_sample_value("inferplane_router_kv_index_entries") == 3
        await watch.stop()
        assert fake.active == 0 or await _closed(fake)
        await server.stop(None)

    asyncio.run(scenario())


async def _closed(fake: FakeReplica) -> bool:
    await until(lambda: fake.active == 0)
    return True


def test_a_gap_drops_the_blocks_and_resubscribes() -> None:
    def script(n: int) -> list[rpb.WatchReplicaStateResponse]:
        if n == 0:  # update 2 never comes
            return [update(1, reset=True, stored=[1, 2]), update(3, stored=[9])]
        return [update(1, reset=True, stored=[7])]

    async def scenario() -> None:
        fake = FakeReplica(script)
        server, address = await serve(fake)
        _states, index, watch = make()
        watch.on_table(table(Endpoint(address, "r0")))
        await watch.start()
        await until(lambda: len(fake.requests) == 2 and index.blocks("r0") == 1)
        assert index.holders(7) == {"r0"}
        assert index.holders(1) == frozenset() and index.holders(9) == frozenset()
        assert watch.gaps == 1
        await watch.stop()
        await server.stop(None)

    asyncio.run(scenario())


def test_a_stream_end_or_events_off_drop_the_blocks() -> None:
    def script(n: int) -> list[rpb.WatchReplicaStateResponse]:
        if n == 0:
            return [update(1, reset=True, stored=[1, 2])]
        return [update(1, reset=True, stored=[5]), update(2, kv_events=False)]

    async def scenario() -> None:
        fake = FakeReplica(script)
        server, address = await serve(fake)
        states, index, watch = make()
        watch.on_table(table(Endpoint(address, "r0")))
        await watch.start()
        await until(lambda: index.blocks("r0") == 2)
        fake.release.set()  # the first stream ends
        await until(lambda: len(fake.requests) >= 2)
        fake.release.clear()
        await until(lambda: (s := states.get("r0")) is not None and not s.kv_events)
        assert len(index) == 0  # events off: nothing of it is trusted
        await watch.stop()
        await server.stop(None)

    asyncio.run(scenario())


def test_a_replica_leaving_the_table_closes_its_stream_and_drops_its_state() -> None:
    def script(n: int) -> list[rpb.WatchReplicaStateResponse]:
        return [update(1, reset=True, stored=[1])]

    async def scenario() -> None:
        a, b = FakeReplica(script), FakeReplica(script)
        server_a, address_a = await serve(a)
        server_b, address_b = await serve(b)
        states, index, watch = make()
        await watch.start()
        watch.on_table(table(Endpoint(address_a, "ra"), Endpoint(address_b, "rb")))
        await until(lambda: index.holders(1) == {"ra", "rb"})
        watch.on_table(table(Endpoint(address_b, "rb")))
        await until(lambda: a.active == 0)
        assert states.get("ra") is None and states.get("rb") is not None
        assert index.holders(1) == {"rb"}
        assert watch.watched == {(address_b, "rb")}
        assert len(a.requests) == 1
        await watch.stop()
        await until(lambda: b.active == 0)
        for server in (server_a, server_b):
            await server.stop(None)

    asyncio.run(scenario())


def test_an_unreachable_replica_is_retried_with_backoff() -> None:
    async def scenario() -> None:
        states, _index, watch = make()
        with socket.socket() as sock:  # a port nothing listens on (bound then released)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        watch.on_table(table(Endpoint(f"127.0.0.1:{port}", "r0")))
        await watch.start()
        key = (f"127.0.0.1:{port}", "r0")
        await until(lambda: watch.connects.get(key, 0) >= 3)
        assert states.get("r0") is None and watch.open_streams == 0
        await watch.stop()

    asyncio.run(scenario())


class ChattyReplica(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    """A snapshot, then an update every millisecond, forever."""

    async def WatchReplicaState(
        self, request: rpb.WatchReplicaStateRequest, context: Any
    ) -> AsyncIterator[rpb.WatchReplicaStateResponse]:
        seq = 0
        while True:
            seq += 1
            yield update(seq, reset=seq == 1, stored=[seq])
            await asyncio.sleep(0.001)


def test_stop_returns_while_updates_keep_arriving() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(ChattyReplica(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        for _ in range(5):  # a cancellation arriving as a read completes must not be lost
            _, index, watch = make()
            watch.on_table(table(Endpoint(f"127.0.0.1:{port}", "r0")))
            await watch.start()
            await until(lambda: len(index) >= 20)  # noqa: B023 (awaited in this iteration)
            await asyncio.wait_for(watch.stop(), 5)
            assert watch.watched == frozenset() and len(index) == 0
        await server.stop(None)

    asyncio.run(scenario())

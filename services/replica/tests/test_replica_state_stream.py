"""`WatchReplicaState` (`server/state_stream.py`): one producer fanned out to several routers
(snapshot first, `sequence` per watcher, coalesced updates, heartbeats, a slow watcher cut
with a bounded queue), KV blocks as snapshot then deltas, the replica process serving it over
real gRPC with a scripted engine on the fake KV cache (`inferplane.testing.fake_kv`: waiting
when blocks are short, preemptions), and the identity policy (routers: this method only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest

from inferplane import kvblocks
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.replica.app import ReplicaProcess
from inferplane.replica.engines.base import EngineOutput, SamplingParams
from inferplane.replica.engines.engine_stats import EngineStats, SchedulerStatsSink
from inferplane.replica.engines.kv_events import KvBlockIndex, Removed, Stored
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.server.state_stream import (
    BEHIND_CODE,
    Admission,
    ReplicaStateStream,
    StateStreamCollector,
)
from inferplane.replica.settings import ReplicaSettings
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_spec,
    script,
)
from inferplane.replica_contract import ReplicaFlags
from inferplane.runtime import ResourceExhaustedError
from inferplane.runtime.security.identity import NODE_AGENT, ROUTER
from inferplane.testing.fake_kv import FakeKvCache
from inferplane.wire import completion_request_from_dict

BS = 4


class Source:
    """An engine reporting `stats` and `index` (`ReportsEngineState`)."""

    def __init__(self) -> None:
        self.stats = EngineStats(block_size=BS, total_kv_blocks=10, free_kv_blocks=10)
        self.kv_blocks: KvBlockIndex | None = KvBlockIndex(capacity=10, block_size=BS)

    def engine_stats(self) -> EngineStats:
        return self.stats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manual_stream(
    source: object, admission: Callable[[], Admission], clock: Clock, **kw: object
) -> ReplicaStateStream:
    """A stream whose producer never ticks by itself (the test calls `tick`)."""
    return ReplicaStateStream(
        lambda: source,
        admission,
        min_interval_seconds=3600,
        clock=clock,
        **kw,  # type: ignore[arg-type]
    )


async def take(
    watch: AsyncIterator[replica_pb2.WatchReplicaStateResponse],
) -> replica_pb2.WatchReplicaStateResponse:
    return await asyncio.wait_for(anext(watch), 2)


def test_watchers_get_a_snapshot_then_changes_and_heartbeats_each_with_its_own_sequence() -> None:
    async def scenario() -> None:
        source, clock = Source(), Clock()
        admission = Admission(in_flight_requests=0)
        adapters: list[str] = []
        stream = manual_stream(source, lambda: admission, clock, loaded_adapters=lambda: adapters)
        ids = list(range(2 * BS))
        assert source.kv_blocks is not None
        source.kv_blocks.apply([Stored([1, 2], None, ids, BS)])
        a = stream.watch("router-a")
        first = await take(a)
        assert (first.sequence, first.reset, first.kv_events) == (1, True, True)
        assert [(s.adapter, list(s.hashes)) for s in first.stored] == [
            ("", kvblocks.chain(ids, BS))
        ]
        assert (first.block_size, first.total_kv_blocks, first.free_kv_blocks) == (BS, 10, 10)

        # A change: one update for each watcher, the delta only.
        admission = Admission(in_flight_requests=2)
        source.stats = EngineStats(BS, 10, 6, running_requests=2)
        source.kv_blocks.apply([Removed([2])])
        assert stream.tick()
        update = await take(a)
        assert (update.sequence, update.reset, update.in_flight_requests) == (2, False, 2)
        assert (update.running_requests, update.free_kv_blocks) == (2, 6)
        assert [list(s.hashes) for s in update.removed] == [kvblocks.chain(ids, BS)[1:]]
        assert not update.stored

        # A second watcher starts from its own snapshot and sequence 1.
        b = stream.watch("router-b")
        first_b = await take(b)
        assert (first_b.sequence, first_b.reset) == (1, True)
        assert [list(s.hashes) for s in first_b.stored] == [kvblocks.chain(ids, BS)[:1]]

        # The stream's series: watchers, updates, the index's blocks and what it skipped.
        source.kv_blocks.apply([Stored([9], 8, ids[:BS], BS)])  # parent 8 was never seen
        samples = {
            (m.name, tuple(sample.labels.values())): sample.value
            for m in StateStreamCollector(stream).collect()
            for sample in m.samples
        }
        assert samples[("inferplane_replica_state_watchers", ())] == 2
        assert samples[("inferplane_replica_state_updates", ())] == 1
        assert samples[("inferplane_replica_kv_blocks_indexed", ())] == 1
        assert samples[("inferplane_replica_kv_blocks_skipped", ("unknown_parent",))] == 1

        # Nothing changed: nothing sent, until the heartbeat is due.
        assert not stream.tick()
        clock.now += 1.0
        assert stream.tick()
        beat_a, beat_b = await take(a), await take(b)
        assert (beat_a.sequence, beat_b.sequence) == (3, 2)
        assert not (beat_a.stored or beat_a.removed or beat_a.reset)
        assert beat_a.in_flight_requests == 2

        # Adapters and draining are changes too; every update lists every loaded adapter.
        adapters.append("sql")
        admission = Admission(in_flight_requests=2, draining=True)
        assert stream.tick()
        changed = await take(a)
        assert (list(changed.loaded_adapters), changed.draining) == (["sql"], True)
        await a.aclose()
        await b.aclose()
        assert stream.watchers == 0
        await stream.close()

    asyncio.run(scenario())


def test_a_watcher_that_falls_behind_is_cut_and_the_others_go_on() -> None:
    async def scenario() -> None:
        source, clock = Source(), Clock()
        in_flight = [0]
        stream = manual_stream(source, lambda: Admission(in_flight[0]), clock, max_queued=3)
        fast, slow = stream.watch("fast"), stream.watch("slow")
        await take(fast)
        await take(slow)
        for n in range(1, 6):
            in_flight[0] = n
            assert stream.tick()
            assert (await take(fast)).in_flight_requests == n
        assert stream.cut == 1
        with pytest.raises(ResourceExhaustedError) as err:
            await take(slow)
        assert err.value.code == BEHIND_CODE
        assert stream.watchers == 1
        # The router resubscribes: a fresh snapshot with the state now.
        again = stream.watch("slow")
        first = await take(again)
        assert (first.sequence, first.reset, first.in_flight_requests) == (1, True, 5)
        await stream.close()  # ends the streams of the watchers left
        with pytest.raises(StopAsyncIteration):
            await take(fast)

    asyncio.run(scenario())


def test_the_producer_coalesces_changes_and_sends_heartbeats_by_itself() -> None:
    async def scenario() -> None:
        source = Source()
        in_flight = [0]
        stream = ReplicaStateStream(
            lambda: source,
            lambda: Admission(in_flight[0]),
            min_interval_seconds=0.05,
            heartbeat_seconds=0.3,
        )
        watch = stream.watch("r")
        assert (await take(watch)).sequence == 1
        for n in range(1, 4):  # three changes within one interval: one update at most
            in_flight[0] = n
            await asyncio.sleep(0)
        update = await take(watch)
        assert update.in_flight_requests in (1, 2, 3)
        if update.in_flight_requests != 3:
            update = await take(watch)
        assert update.in_flight_requests == 3
        beat = await take(watch)  # nothing changes: a heartbeat
        assert beat.sequence == update.sequence + 1 and beat.in_flight_requests == 3
        await watch.aclose()
        await stream.close()

    asyncio.run(scenario())


def test_without_a_reporting_engine_the_stream_says_kv_events_false_and_zeros() -> None:
    async def scenario() -> None:
        stream = manual_stream(object(), lambda: Admission(1), Clock())
        first = await take(stream.watch("r"))
        assert (first.kv_events, first.total_kv_blocks, first.in_flight_requests) == (False, 0, 1)
        await stream.close()

    asyncio.run(scenario())


# -- the fake KV cache, and the replica process serving the stream --------------------------------


def test_the_fake_kv_cache_queues_what_does_not_fit_and_preempts_to_grow() -> None:
    async def scenario() -> None:
        kv = FakeKvCache(total_kv_blocks=4, block_size=BS)
        await kv.start("a", prompt_tokens=BS, max_tokens=2 * BS)  # 1 block
        await kv.start("b", prompt_tokens=2 * BS, max_tokens=BS)  # 2 blocks
        assert (kv.running_requests, kv.free_kv_blocks) == (2, 1)
        c = asyncio.ensure_future(kv.start("c", prompt_tokens=2 * BS, max_tokens=1))
        await asyncio.sleep(0)
        assert (kv.waiting_requests, c.done()) == (1, False)
        for _ in range(BS + 1):  # "a" grows into the free block, then needs a third
            await kv.step("a")
        assert kv.preemptions_total == 1  # "b", admitted last, made room
        assert (kv.running_requests, kv.waiting_requests) == (1, 2)
        kv.finish("a")
        await asyncio.wait_for(c, 1)  # "b" (head of the queue again) and "c" now run
        assert (kv.running_requests, kv.waiting_requests, kv.free_kv_blocks) == (2, 0, 0)
        with pytest.raises(ValueError):
            await kv.start("huge", prompt_tokens=4 * BS, max_tokens=1)

    asyncio.run(scenario())


class Host:
    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.dead = asyncio.Event()

    async def start(self) -> ScriptedEngine:
        return self.engine

    async def wait_dead(self) -> str:
        await self.dead.wait()
        return "dead"

    def check_soon(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def test_the_replica_process_streams_its_fake_engines_kv_capacity_over_grpc() -> None:
    """Routers see a replica with a fake engine the way H5's KV-fit admission needs it: block
    size, total and free blocks, the engine's running and waiting requests, in-flight and
    draining; two requests that do not both fit run one after the other."""
    settings = ReplicaSettings.of(ReplicaFlags(replica_id="r1"), kimi_tiny_spec())
    ids = list(range(7))

    def outputs(params: SamplingParams) -> Sequence[EngineOutput]:
        return script(ids, prompt_tokens=BS)

    async def scenario() -> None:
        assets = ModelAssetsCache()
        assets.put(kimi_tiny_assets(), "kimi_k2")
        kv = FakeKvCache(total_kv_blocks=4, block_size=BS)
        engine = ScriptedEngine(outputs, delay=0.05, kv=kv)
        process = ReplicaProcess(settings, Host(engine), assets=assets)
        assert process.server.app.peer_policy is not None
        policy = process.server.app.peer_policy
        service = "/inferplane.nodeagent.v1.ReplicaProcessService"
        assert policy.allowed(f"{service}/WatchReplicaState") == {ROUTER}
        assert ROUTER not in policy.allowed(f"{service}/GetReplicaLoad")
        assert NODE_AGENT in policy.allowed(f"{service}/StartReplicaDrain")
        stop = asyncio.Event()
        running = asyncio.ensure_future(process.run(stop))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{process.port}") as channel:
            control = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
            while not (
                await control.GetReplicaLoad(replica_pb2.GetReplicaLoadRequest())
            ).engine_ready:
                await asyncio.sleep(0.02)
            from inferplane.api.inference.v1 import inference_pb2 as pb
            from inferplane.api.inference.v1 import inference_pb2_grpc

            watch = control.WatchReplicaState(replica_pb2.WatchReplicaStateRequest(router_id="x"))
            first = await watch.read()
            assert (first.sequence, first.reset, first.block_size) == (1, True, BS)
            assert (first.total_kv_blocks, first.free_kv_blocks, first.kv_events) == (4, 4, False)
            inference = inference_pb2_grpc.InferenceServiceStub(channel)
            # The prompt is rendered by the pipeline; each request needs > 2 of the 4 blocks.
            request = completion_request_from_dict(
                {"model": "kimi-tiny", "prompt": [1] * (2 * BS + 1), "max_tokens": 7}
            )
            calls = [
                inference.CreateCompletion(pb.CreateCompletionRequest(request=request))
                for _ in range(2)
            ]
            seen: list[replica_pb2.WatchReplicaStateResponse] = []
            sequence = 1
            while True:
                update = await asyncio.wait_for(watch.read(), 5)
                assert update.sequence == sequence + 1
                sequence = update.sequence
                seen.append(update)
                if update.waiting_requests == 1 and update.running_requests == 1:
                    assert update.in_flight_requests == 2 and update.free_kv_blocks < 2
                    break
            for call in calls:
                await call
            while (update := await asyncio.wait_for(watch.read(), 5)).in_flight_requests:
                pass
            assert (update.running_requests, update.free_kv_blocks) == (0, 4)
            assert kv.preemptions_total == 0
            await control.StartReplicaDrain(replica_pb2.StartReplicaDrainRequest())
            while not (update := await asyncio.wait_for(watch.read(), 5)).draining:
                pass
            stop.set()
            assert await asyncio.wait_for(running, 20) == 0
            assert await watch.code() == grpc.StatusCode.OK  # ended by the shutdown

    asyncio.run(scenario())


def test_the_scheduler_stats_sink_turns_vllms_numbers_into_blocks() -> None:
    changes: list[int] = []
    sink = SchedulerStatsSink(lambda: changes.append(1))
    sink.configure(block_size=128, num_gpu_blocks=513)  # 512 usable: vLLM's null block
    sink.record(running=2, waiting=1, usage=0.25, preempted=0)
    assert sink.stats() == EngineStats(128, 512, 384, 2, 1, 0)
    sink.record(running=2, waiting=1, usage=0.25, preempted=0)  # nothing new
    assert len(changes) == 1
    sink.record(running=1, waiting=2, usage=1.0, preempted=3)
    sink.record(running=1, waiting=2, usage=1.0, preempted=1)
    assert sink.stats() == EngineStats(128, 512, 0, 1, 2, 4)
    assert len(changes) == 3

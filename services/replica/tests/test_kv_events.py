"""vLLM's KV events → content hashes (`engines/kv_events.py`): stored chains, removals,
clearing, unknown parents, adapters, untranslatable blocks, the capacity bound, plain msgpack
decoding of vLLM's wire format, and the ZeroMQ subscriber with a sequence gap filled from the
replay socket or, when it cannot be, turned into a reset. (vLLM's own publisher and classes:
`test_replica_state_e2e.py`.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from inferplane import kvblocks
from inferplane.replica.engines.kv_events import (
    BatchDecoder,
    Cleared,
    KvBlockIndex,
    KvEventSubscriber,
    Removed,
    Stored,
    engine_kv_events_args,
)
from inferplane.runtime.processes.ports import free_port

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def stored(hashes: Sequence[int], parent: int | None, ids: Sequence[int], **kw: Any) -> Stored:
    return Stored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=ids,
        **{"block_size": BS, **kw},
    )


def test_a_stored_chain_continued_in_a_later_event_has_the_prompts_content_hashes() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(3 * BS)
    index.apply([stored([11, 12], None, ids[: 2 * BS])])
    index.apply([stored([13], 12, ids[2 * BS :])])
    delta = index.take_delta()
    assert delta.stored == {"": kvblocks.chain(ids, BS)}
    assert not delta.reset and not delta.removed
    assert index.snapshot() == {"": kvblocks.chain(ids, BS)}
    assert not index.take_delta()  # taken


def test_removed_blocks_are_reported_by_content_and_a_store_then_evict_nets_out() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(2 * BS)
    first, second = kvblocks.chain(ids, BS)
    index.apply([stored([1, 2], None, ids)])
    index.take_delta()
    index.apply([Removed([2])])
    assert index.take_delta().removed == {"": [second]}
    # Stored and evicted within one interval: the router never needs to hear of it.
    index.apply([stored([2], 1, ids[BS:]), Removed([2])])
    assert not index.take_delta()
    # Evicted then stored again: the router's copy is still right.
    index.apply([Removed([1]), stored([1], None, ids[:BS])])
    assert not index.take_delta()
    assert index.snapshot() == {"": [first]}
    index.apply([Removed([99])])  # an engine hash never translated: nothing
    assert not index.take_delta()


def test_a_reported_prefix_hit_is_not_stored_twice() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(2 * BS)
    index.apply([stored([1, 2], None, ids)])
    index.take_delta()
    index.apply([stored([1, 2], None, ids)])  # vLLM's emit_cached_block_events
    assert not index.take_delta()
    index.apply([Removed([1]), Removed([2])])
    assert index.take_delta().removed == {"": kvblocks.chain(ids, BS)}
    assert len(index) == 0


def test_all_blocks_cleared_is_a_reset_then_what_was_stored_after_it() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(2 * BS)
    index.apply([stored([1], None, ids[:BS])])
    index.take_delta()
    index.apply([Cleared(), stored([5], None, ids[BS:])])
    delta = index.take_delta()
    assert delta.reset and delta.stored == {"": kvblocks.chain(ids[BS:], BS)}
    assert not delta.removed
    assert index.snapshot() == {"": kvblocks.chain(ids[BS:], BS)}


def test_an_unknown_parent_is_skipped_and_counted_and_so_are_its_children() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(3 * BS)
    index.apply([stored([2, 3], 1, ids[BS:])])
    assert not index.take_delta()
    assert index.counters.unknown_parent == 2
    index.apply([stored([4], 3, ids[:BS])])
    assert index.counters.unknown_parent == 3 and len(index) == 0


def test_blocks_under_an_adapter_are_salted_with_its_name_and_kept_apart() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(2 * BS)
    # vLLM's extra keys of a LoRA block start with the adapter's name: still translatable.
    index.apply([stored([7, 8], None, ids, lora_name="sql", extra_keys=[("sql",), ("sql",)])])
    index.apply([stored([1, 2], None, ids)])
    delta = index.take_delta()
    assert delta.stored == {"sql": kvblocks.chain(ids, BS, "sql"), "": kvblocks.chain(ids, BS)}
    assert kvblocks.chain(ids, BS, "sql") != kvblocks.chain(ids, BS)


def test_blocks_whose_hash_covers_more_than_tokens_are_not_claimed() -> None:
    index = KvBlockIndex(capacity=100)
    ids = tokens(2 * BS)
    # An image in the second block: vLLM's extra keys carry (mm identifier, offset).
    index.apply([stored([1, 2], None, ids, extra_keys=[None, (("img-1", 0),)])])
    assert index.take_delta().stored == {"": kvblocks.chain(ids[:BS], BS)}
    assert index.counters.untranslatable == 1
    index.apply([stored([9], None, tokens(8, 100), block_size=8)])  # another group's size
    assert index.counters.other_block_size == 1
    index.apply([Stored([3], None, ids[:BS], BS, medium="CPU")])  # an offloading tier
    assert len(index) == 1 and not index.take_delta()


def test_the_index_never_outgrows_its_capacity_and_reports_what_it_drops() -> None:
    index = KvBlockIndex(capacity=2)
    ids = tokens(3 * BS)
    hashes = kvblocks.chain(ids, BS)
    index.apply([stored([1, 2, 3], None, ids)])
    assert len(index) == 2 and index.counters.over_capacity == 1
    # The oldest went: stored and dropped in one interval nets out.
    assert index.take_delta().stored == {"": hashes[1:]}


def _payload(events: list[dict[str, Any]], ts: float = 1.0) -> bytes:
    """A batch as vLLM's publisher encodes it: an array-like EventBatch of tagged maps."""
    return msgspec.msgpack.encode([ts, events])


def _stored_map(hashes: list[int], parent: int | None, ids: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def test_plain_msgpack_decoding_reads_vllms_tagged_events_and_skips_unknown_ones() -> None:
    decoder = BatchDecoder(use_vllm=False)
    assert not decoder.typed
    ids = tokens(BS)
    ts, events = decoder.decode(
        _payload(
            [
                _stored_map([b"\x01" * 32], None, ids),  # vLLM's default: sha256 bytes
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
                {"type": "SomethingNew", "x": 1},
            ]
        )
    )
    assert ts == 1.0
    assert events == [
        Stored([b"\x01" * 32], None, ids, BS, None, None, 0, "GPU"),
        Removed([b"\x01" * 32], 0, "GPU"),
        Cleared(),
    ]
    with pytest.raises(ValueError):
        decoder.decode(msgspec.msgpack.encode({"not": "a batch"}))


def test_engine_arguments_publish_to_loopback_with_prefix_caching_on() -> None:
    args = engine_kv_events_args("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001")
    assert args[:2] == ["--enable-prefix-caching", "--kv-events-config"]
    config = msgspec.json.decode(args[2])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5000",
        "replay_endpoint": "tcp://127.0.0.1:5001",
    }


async def _publisher(endpoint: str, replay_port: int, batches: dict[int, bytes]) -> Any:
    """A PUB socket connected to the subscriber (as vLLM's connects to a host:port endpoint)
    and a ROUTER replay socket answering with `batches` from the asked sequence on."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")

    async def serve_replay() -> None:
        while True:
            client, _empty, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in batches if s >= first):
                await router.send_multipart(
                    (client, b"", b"", seq.to_bytes(8, "big"), batches[seq])
                )
            end = (-1).to_bytes(8, "big", signed=True)
            await router.send_multipart((client, b"", b"", end, b""))

    task = asyncio.ensure_future(serve_replay())
    return ctx, pub, router, task


async def _until(condition: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("replay_has_the_gap", [True, False])
def test_the_subscriber_fills_a_gap_from_replay_or_resets(replay_has_the_gap: bool) -> None:
    asyncio.run(_gap_scenario(replay_has_the_gap))


async def _gap_scenario(replay_has_the_gap: bool) -> None:
    index = KvBlockIndex(capacity=100)
    changes: list[int] = []
    subscriber = KvEventSubscriber(
        index,
        on_change=lambda: changes.append(1),
        decoder=BatchDecoder(use_vllm=False),
        replay_port=free_port(),
    )
    endpoint = subscriber.bind()
    assert endpoint.startswith("tcp://127.0.0.1:")
    ids = tokens(3 * BS)
    batches = {
        0: _payload([_stored_map([1], None, ids[:BS])]),
        1: _payload([_stored_map([2], 1, ids[BS : 2 * BS])]),
        2: _payload([_stored_map([3], 2, ids[2 * BS :])]),
    }
    replayable = dict(batches) if replay_has_the_gap else {2: batches[2]}
    ctx, pub, router, serving = await _publisher(endpoint, subscriber._replay_port, replayable)
    running = asyncio.ensure_future(subscriber.run())
    try:
        # A PUB learns of a subscription only as it sends: ping (a message the subscriber
        # ignores) until one arrives, as vLLM's first batches may be lost.
        async with asyncio.timeout(5):
            while subscriber.messages == 0:
                await pub.send(b"ping")
                await asyncio.sleep(0.02)
        await pub.send_multipart((b"", (0).to_bytes(8, "big"), batches[0]))
        await _until(lambda: subscriber.batches == 1)
        index.take_delta()
        await pub.send_multipart((b"", (2).to_bytes(8, "big"), batches[2]))  # 1 is lost
        await _until(lambda: subscriber._expected == 3)
        delta = index.take_delta()
        if replay_has_the_gap:
            assert not delta.reset
            assert delta.stored == {"": kvblocks.chain(ids, BS)[1:]}
            assert index.snapshot() == {"": kvblocks.chain(ids, BS)}
        else:
            # Batch 1 is gone for good: forget everything; batch 2's parent is then unknown.
            assert delta.reset and not delta.stored
            assert index.counters.lost == 1 and index.counters.unknown_parent == 1
        assert not subscriber.failed
    finally:
        running.cancel()
        serving.cancel()
        await asyncio.gather(running, serving, return_exceptions=True)
        subscriber.close()
        pub.close(0)
        router.close(0)
        ctx.term()

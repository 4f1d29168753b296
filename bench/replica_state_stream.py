"""What the replica's engine-state stream costs (issue 29; `WatchReplicaState`): the replica
process's CPU per translated KV block, per decoded KV event batch, per producer tick (nothing
changed, scalars changed, a delta of blocks) at 1, 3 and 10 watching routers, and per
snapshot of 10,000 cached blocks. In-process, no I/O; medians of `--rounds` rounds.

Run `.venv/bin/python bench/replica_state_stream.py [--rounds 7]` (~20 s). Last line
`replica_state_tick_us_3_watchers: X` (a tick that sends scalars to three routers).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import msgspec

from inferplane.replica.engines.engine_stats import EngineStats
from inferplane.replica.engines.kv_events import BatchDecoder, KvBlockIndex, Removed, Stored
from inferplane.replica.server.state_stream import Admission, ReplicaStateStream

BLOCK = 128  # vLLM's CPU block size


def median_us(work: Callable[[int], object], n: int, rounds: int) -> float:
    runs = []
    for r in range(rounds):
        start = time.perf_counter()
        for i in range(n):
            work(r * n + i)
        runs.append((time.perf_counter() - start) / n)
    return statistics.median(runs) * 1e6


class Engine:
    """An engine reporting numbers and a KV index."""

    def __init__(self) -> None:
        self.kv_blocks = KvBlockIndex(capacity=1 << 20, block_size=BLOCK)
        self.running = 0

    def engine_stats(self) -> EngineStats:
        return EngineStats(BLOCK, 10_000, 10_000 - self.running, self.running)


async def ticks(watchers: int, rounds: int) -> dict[str, float]:
    engine = Engine()
    now = [0.0]
    stream = ReplicaStateStream(
        lambda: engine,
        lambda: Admission(engine.running),
        min_interval_seconds=3600,  # the bench ticks by hand
        clock=lambda: now[0],
        max_queued=1 << 30,
    )
    watches = [stream.watch(f"router-{i}") for i in range(watchers)]
    for watch in watches:
        await anext(watch)
    tokens = list(range(BLOCK * 8))

    def idle(_i: int) -> None:
        stream.tick()

    def scalars(i: int) -> None:
        engine.running = i % 50 + 1
        stream.tick()

    def blocks(i: int) -> None:
        engine.kv_blocks.apply(
            [
                Stored([(i, j) for j in range(8)], None, tokens, BLOCK),
                Removed([(i - 1, j) for j in range(8)]),
            ]
        )
        engine.running = i % 50 + 1
        stream.tick()

    out = {
        "idle": median_us(idle, 3000, rounds),
        "scalars": median_us(scalars, 3000, rounds),
        "blocks": median_us(blocks, 1000, rounds),
    }
    for watch in watches:
        await watch.aclose()
    await stream.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds

    index = KvBlockIndex(capacity=1 << 30, block_size=BLOCK)
    tokens = list(range(BLOCK * 8))
    per_batch = median_us(
        lambda i: index.apply([Stored([i * 8 + j for j in range(8)], None, tokens, BLOCK)]),
        1000,
        rounds,
    )
    print(f"translate_us_per_stored_block: {per_batch / 8:.2f}  (128 tokens, BLAKE2b)")
    decoder = BatchDecoder(use_vllm=False)
    event = {
        "type": "BlockStored",
        "block_hashes": [b"h" * 32] * 8,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    payload = msgspec.msgpack.encode([1.0, [event]])
    decode = median_us(lambda _i: decoder.decode(payload), 1000, rounds)
    print(f"decode_us_per_batch_of_8_blocks: {decode:.2f}  (plain msgpack)")

    big = KvBlockIndex(capacity=1 << 20, block_size=BLOCK)
    for i in range(10_000 // 8):
        own = [i * len(tokens) + t for t in tokens]  # distinct prefixes
        big.apply([Stored([i * 8 + j for j in range(8)], None, own, BLOCK)])
    assert len(big.snapshot()[""]) == 10_000
    snapshot = median_us(lambda _i: big.snapshot(), 20, rounds)
    print(f"snapshot_us_10000_blocks: {snapshot:.0f}")

    result = {}
    for watchers in (1, 3, 10):
        figures = asyncio.run(ticks(watchers, rounds))
        result[watchers] = figures
        print(
            f"tick_us_{watchers}_watchers: nothing changed {figures['idle']:.1f}, "
            f"scalars changed {figures['scalars']:.1f}, "
            f"8 blocks stored + 8 removed {figures['blocks']:.1f}"
        )
    idle_share = result[3]["idle"] * 20 / 1e6 * 100
    print(f"idle_cpu_percent_3_watchers: {idle_share:.3f}  (20 ticks/s, nothing changing)")
    print(f"replica_state_tick_us_3_watchers: {result[3]['scalars']:.1f}")


if __name__ == "__main__":
    main()

"""`Outbox` on its own, over a real SQLite spool and a hand-written fake receiver.

Invariants: `put` never blocks or raises; an item is in the file (`durable`) within about one
flush interval, and the items put meanwhile share one append (one fsync); the receiver gets
every item once, in order, also when an outage outlasts what memory keeps (older items are read
back from the file); nothing is removed from the file before the receiver acknowledged it; a
refused batch is dropped and counted, not retried; an outbox without a file holds at most
`capacity` items.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from inferplane.runtime.delivery.batching import BatchMetrics
from inferplane.runtime.delivery.outbox import Outbox, OutboxSettings
from inferplane.runtime.delivery.spool import Spool


class Down(ConnectionError):
    """The receiver is unreachable (retryable)."""


class Refused(ValueError):
    """The receiver refused the batch (not retryable)."""


class Receiver:
    def __init__(self) -> None:
        self.up = True
        self.refuse_next = 0
        self.received: list[int] = []

    async def send(self, batch: list[int]) -> None:
        await asyncio.sleep(0)
        if not self.up:
            raise Down("receiver down")
        if self.refuse_next:
            self.refuse_next -= 1
            raise Refused("bad batch")
        self.received += batch


class CountingSpool(Spool[int]):
    """Counts the appends that wrote items (one transaction, one fsync each)."""

    appends = 0

    def append(self, items: Sequence[int], drop_through: int = 0) -> int:
        if items:
            self.appends += 1
        return super().append(items, drop_through)


def _spool(path: Path | None) -> CountingSpool:
    return CountingSpool(path, lambda i: str(i).encode(), lambda b: int(b.decode()))


def _outbox(
    spool: Spool[int], receiver: Receiver, registry: CollectorRegistry, **settings: float
) -> Outbox[int]:
    metrics = BatchMetrics(
        registry, "test_items", sent_help="s", dropped_help="d", buffered_help="b"
    )
    return Outbox(
        spool,
        receiver.send,
        OutboxSettings(
            **{
                "batch_size": 8,
                "flush_interval_seconds": 0.01,
                "backoff_initial_seconds": 0.005,
                "backoff_max_seconds": 0.02,
                **settings,
            }
        ),
        metrics,
        name="test",
        retryable=lambda exc: isinstance(exc, Down),
    )


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def test_items_put_within_one_interval_share_one_append_and_arrive_in_order(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        receiver, spool = Receiver(), _spool(tmp_path / "o.db")
        outbox = _outbox(spool, receiver, CollectorRegistry())
        await outbox.start()
        positions = [outbox.put(i) for i in range(30)]
        assert positions == list(range(1, 31))
        await asyncio.wait_for(outbox.durable(30), 1.0)
        assert spool.appends == 1  # one transaction for the 30
        await _until(lambda: receiver.received == list(range(30)))
        await outbox.close()

    asyncio.run(scenario())


def test_an_outage_longer_than_memory_reads_the_file_back_and_loses_nothing(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        receiver, spool = Receiver(), _spool(tmp_path / "o.db")
        receiver.up = False
        outbox = _outbox(spool, receiver, CollectorRegistry(), capacity=12)
        await outbox.start()
        for chunk in range(4):  # 40 items in all, memory keeps the newest 12
            for i in range(10):
                assert outbox.put(chunk * 10 + i)
            await outbox.durable((chunk + 1) * 10)
        await asyncio.sleep(0.05)
        assert receiver.received == [] and outbox.spooled == 40 and len(spool) == 40
        receiver.up = True
        await _until(lambda: outbox.spooled == 0)
        assert receiver.received == list(range(40))  # once each, in order
        await _until(lambda: len(spool) == 0)  # trimmed only after the acknowledgement
        await outbox.close()

    asyncio.run(scenario())


def test_what_a_previous_process_left_is_sent_first(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "o.db"
        left = _spool(path)
        left.append([100, 101, 102])
        left.close()
        receiver = Receiver()
        outbox = _outbox(_spool(path), receiver, CollectorRegistry())
        assert outbox.spooled == 3
        outbox.put(7)
        await outbox.start()
        await _until(lambda: receiver.received == [100, 101, 102, 7])
        await outbox.close()

    asyncio.run(scenario())


def test_a_refused_batch_is_dropped_and_counted() -> None:
    async def scenario() -> None:
        receiver, registry = Receiver(), CollectorRegistry()
        receiver.refuse_next = 1
        outbox = _outbox(_spool(None), receiver, registry)
        await outbox.start()
        await outbox.durable(outbox.put(1))
        await _until(lambda: outbox.spooled == 0)
        outbox.put(2)
        await _until(lambda: receiver.received == [2])
        await outbox.close()
        rejected = registry.get_sample_value("test_items_dropped_total", {"reason": "rejected"})
        assert rejected == 1

    asyncio.run(scenario())


def test_without_a_file_at_most_capacity_items_are_held() -> None:
    async def scenario() -> None:
        receiver, registry = Receiver(), CollectorRegistry()
        receiver.up = False
        outbox = _outbox(_spool(None), receiver, registry, capacity=3)
        await outbox.start()
        for i in range(3):
            assert outbox.put(i)
        await outbox.durable(3)
        assert outbox.put(3) == 0  # held in memory already: dropped and counted
        full = registry.get_sample_value("test_items_dropped_total", {"reason": "buffer_full"})
        assert full == 1
        receiver.up = True
        await _until(lambda: receiver.received == [0, 1, 2])
        await outbox.close()

    asyncio.run(scenario())

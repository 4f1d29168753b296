"""`Batcher` on its own: a receiver that can be down (a hand-written fake `send`), time through
an injected clock. Invariants: `put` never blocks or raises; memory stays bounded during an
outage and the overflow is counted; once the receiver is back, everything kept arrives once,
in order; a refused batch is dropped and counted, not retried; `close` flushes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from inferplane.runtime.delivery.batching import Batcher, BatchingSettings, BatchMetrics
from inferplane.testing.clock import FakeClock


class Down(ConnectionError):
    """The receiver is unreachable (retryable)."""


class Refused(ValueError):
    """The receiver refused the batch (not retryable)."""


class FakeReceiver:
    def __init__(self) -> None:
        self.up = True
        self.refuse_next = 0
        self.received: list[int] = []
        self.calls = 0

    async def send(self, batch: list[int]) -> None:
        self.calls += 1
        await asyncio.sleep(0)
        if not self.up:
            raise Down("receiver down")
        if self.refuse_next:
            self.refuse_next -= 1
            raise Refused("bad batch")
        self.received += batch


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(f"test_items_{name}", labels) or 0.0


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


Body = Callable[[Batcher[int], FakeReceiver, FakeClock, CollectorRegistry], Awaitable[None]]


def run(body: Body, **settings: float) -> None:
    async def main() -> None:
        receiver, clock, registry = FakeReceiver(), FakeClock(), CollectorRegistry()
        metrics = BatchMetrics(
            registry, "test_items", sent_help="s", dropped_help="d", buffered_help="b"
        )
        batcher: Batcher[int] = Batcher(
            receiver.send,
            BatchingSettings(
                **{
                    "capacity": 20,
                    "batch_size": 5,
                    "backoff_initial_seconds": 0.1,
                    "backoff_max_seconds": 1.0,
                    **settings,  # type: ignore[arg-type]
                }
            ),
            metrics,
            name="test",
            retryable=lambda exc: isinstance(exc, Down),
            clock=clock,
            sleep=clock.sleep,
        )
        await batcher.start()
        try:
            await body(batcher, receiver, clock, registry)
        finally:
            await batcher.close(timeout_seconds=1)

    asyncio.run(main())


def test_an_outage_keeps_a_bounded_buffer_then_delivers_it_in_order_once() -> None:
    async def body(
        b: Batcher[int], r: FakeReceiver, clock: FakeClock, registry: CollectorRegistry
    ) -> None:
        r.up = False
        accepted = [b.put(i) for i in range(30)]
        assert accepted == list(range(1, 21)) + [0] * 10  # positions; 0 = dropped
        assert b.pending == 20
        assert sample(registry, "dropped_total", reason="buffer_full") == 10
        assert sample(registry, "buffered") == 20
        await until(lambda: len(clock.slept) >= 5)  # backing off while down
        assert all(0 <= s <= 1.0 for s in clock.slept)
        assert b.pending == 20 and r.received == []
        r.up = True
        await until(lambda: b.pending == 0)
        assert r.received == list(range(20))
        assert sample(registry, "sent_total") == 20
        assert sample(registry, "buffered") == 0
        # Room again: what comes next is taken and delivered.
        assert b.put(99)
        await until(lambda: r.received[-1:] == [99])

    run(body)


def test_settled_waits_for_the_items_delivery_through_an_outage() -> None:
    """`settled(position)` returns once the item at that position (and so every one before it)
    was delivered, refused or given up; not while the receiver is down."""

    async def body(
        b: Batcher[int], r: FakeReceiver, clock: FakeClock, registry: CollectorRegistry
    ) -> None:
        r.up = False
        positions = [b.put(i) for i in range(7)]
        waiter = asyncio.ensure_future(b.settled(positions[-1]))
        await until(lambda: len(clock.slept) >= 2)
        assert not waiter.done()
        r.up = True
        await asyncio.wait_for(waiter, 5)
        assert r.received == list(range(7))
        r.refuse_next = 1
        await asyncio.wait_for(b.settled(b.put(7)), 5)  # refused counts as settled
        assert r.received == list(range(7))
        r.up = False
        lost = b.put(8)
        waiter = asyncio.ensure_future(b.settled(lost))
        await b.close(timeout_seconds=0.1)  # given up at close: counted, and settled
        await asyncio.wait_for(waiter, 5)

    run(body)


def test_a_refused_batch_is_dropped_and_counted_not_retried() -> None:
    async def body(
        b: Batcher[int], r: FakeReceiver, clock: FakeClock, registry: CollectorRegistry
    ) -> None:
        r.refuse_next = 1
        for i in range(10):
            b.put(i)
        await until(lambda: b.pending == 0)
        assert r.received == list(range(5, 10))
        assert r.calls == 2
        assert sample(registry, "dropped_total", reason="rejected") == 5

    run(body)


class ManualClock(FakeClock):
    """A `FakeClock` whose `sleep` blocks until the test `advance`s time past its end, instead
    of advancing time itself: the flush-interval test must see a partial batch held back for
    as long as the test keeps the clock still."""

    async def sleep(self, seconds: float) -> None:
        until_t = self.monotonic() + seconds
        while self.monotonic() < until_t:
            await asyncio.sleep(0.001)


def test_a_partial_batch_waits_for_the_flush_interval_a_full_one_does_not() -> None:
    async def main() -> None:
        receiver, clock, registry = FakeReceiver(), ManualClock(), CollectorRegistry()
        metrics = BatchMetrics(
            registry, "test_items", sent_help="s", dropped_help="d", buffered_help="b"
        )
        b: Batcher[int] = Batcher(
            receiver.send,
            BatchingSettings(batch_size=5, flush_interval_seconds=10.0),
            metrics,
            name="test",
            clock=clock,
            sleep=clock.sleep,
        )
        await b.start()
        for i in range(5):  # a full batch goes at once
            b.put(i)
        await until(lambda: receiver.received == list(range(5)))
        b.put(5)  # a partial one waits for the interval
        b.put(6)
        await asyncio.sleep(0.05)
        assert receiver.received == list(range(5))
        clock.advance(10.0)
        await until(lambda: receiver.received == list(range(7)))
        await b.close()

    asyncio.run(main())


def test_put_from_other_threads_wakes_the_sender() -> None:
    async def body(
        b: Batcher[int], r: FakeReceiver, clock: FakeClock, registry: CollectorRegistry
    ) -> None:
        threads = [threading.Thread(target=b.put, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        await until(lambda: sorted(r.received) == [0, 1, 2])

    run(body)


def test_close_flushes_what_is_buffered_and_counts_what_it_could_not() -> None:
    async def main() -> None:
        for up in (True, False):
            receiver, registry = FakeReceiver(), CollectorRegistry()
            receiver.up = up
            metrics = BatchMetrics(
                registry, "test_items", sent_help="s", dropped_help="d", buffered_help="b"
            )
            batcher: Batcher[int] = Batcher(
                receiver.send,
                BatchingSettings(flush_interval_seconds=3600, batch_size=100),
                metrics,
                name="test",
                retryable=lambda exc: isinstance(exc, Down),
            )
            await batcher.start()
            for i in range(3):
                batcher.put(i)
            await batcher.close(timeout_seconds=1)
            assert receiver.received == ([0, 1, 2] if up else [])
            assert batcher.pending == 0
            lost = sample(registry, "dropped_total", reason="buffer_full")
            assert lost == (0 if up else 3)

    asyncio.run(main())

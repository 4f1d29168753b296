"""`Outbox`: a write-ahead hand-off of per-request facts to a remote service.

The process that concludes a request writes its facts here; nothing on the request path waits
for the receiver:

- `put(item)` never blocks, raises or does I/O: the item joins the items waiting to be written
  (at most `capacity` of them; beyond that the newest is dropped, counted as
  `{prefix}_dropped_total{reason="buffer_full"}`) and gets its position (1, 2, ...);
- a writer task appends what waits to the `Spool` (SQLite, `synchronous=FULL`: one fsync per
  append) in one transaction, at most once per `flush_interval_seconds`: an item is on disk
  within `flush_interval_seconds` + one append (a few ms) of its `put`, and the disk sees at
  most 1 / `flush_interval_seconds` fsyncs a second whatever the load. `durable(position)`
  returns once the item at `position` is on disk (for a caller that acknowledges something
  to a third party only then);
- a sender task delivers the spool, oldest first, in batches of up to `batch_size` (as soon
  as the previous call returned: batches grow with load only), from memory (the newest
  `capacity` items appended are also kept there) or, for older ones (a previous process's,
  or a long outage's), read back from the file; a batch is removed from the spool only once
  the receiver acknowledged it (in the next append's transaction: one fsync for both). A
  retryable failure (`retryable`; by default the gRPC codes in `RETRYABLE_CODES`) keeps the
  batch and backs off (exponential, full jitter); any other error drops the batch, counted
  as `reason="rejected"` (re-sending would wedge the sender). The outbox grows on disk for
  as long as the receiver is away, and the next process on the same file delivers what a
  previous one left (a crash included).

Delivery is at-least-once: a batch acknowledged by the receiver but not yet removed when the
process died is sent again, so the receiver must drop copies by id (the usage ledger keeps one
row per request id): exactly once in effect. What a crash can lose is only what was `put` in
the last `flush_interval_seconds` and not yet appended.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import random
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

from inferplane.runtime.delivery.batching import BatchMetrics, Sleep, retryable_rpc_error
from inferplane.runtime.delivery.spool import Spool

log = structlog.get_logger("inferplane.runtime.delivery.outbox")

T = TypeVar("T")

# While nothing is written, acknowledged rows are removed from the file after this long.
_IDLE_TRIM_SECONDS = 0.5


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OutboxSettings:
    """How an `Outbox` writes and sends.

    Attributes:
        capacity: items waiting to be written at most (memory; a disk that stalls longer
            than `capacity / items per second` drops the newest). An outbox without a file
            (`Spool(None, ...)`) also holds at most this many items in all.
        batch_size: items per send.
        flush_interval_seconds: the longest an item waits before it is appended (seconds;
            also the shortest time between two appends: one fsync each).
        backoff_initial_seconds, backoff_max_seconds: exponential backoff with full jitter
            between failed sends.
    """

    capacity: int = 10_000
    batch_size: int = 256
    flush_interval_seconds: float = 0.005
    backoff_initial_seconds: float = 0.2
    backoff_max_seconds: float = 10.0


class Outbox(Generic[T]):
    """Write-ahead, batched, retrying delivery of items (see the module docstring).

    Args:
        spool: where items wait (a file, or memory with `path=None`); the outbox closes it.
        send: delivers one batch or raises.
        metrics: `{prefix}_sent_total`, `{prefix}_dropped_total{reason}` and
            `{prefix}_buffered` (items not yet acknowledged: waiting to be written or in the
            spool).
        name: the tasks' name (logs).

    Call `put` on the event loop's thread (or before `start`).
    """

    def __init__(
        self,
        spool: Spool[T],
        send: Callable[[list[T]], Awaitable[object]],
        settings: OutboxSettings,
        metrics: BatchMetrics,
        *,
        name: str,
        retryable: Callable[[BaseException], bool] = retryable_rpc_error,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._spool = spool
        self._send_batch = send
        self._settings = settings
        self.metrics = metrics
        self._name = name
        self._retryable = retryable
        self._sleep = sleep
        self._waiting: collections.deque[T] = collections.deque()  # not yet appended
        self._accepted = 0  # positions handed out
        self._written = 0  # items appended, oldest first (their positions are <= this)
        # Appended items still kept in memory, by sequence number (the newest `capacity`).
        self._memory: collections.deque[tuple[int, T]] = collections.deque()
        # Sequence numbers: the last item appended, through which the receiver has every item,
        # through which the spool's rows were removed (what a previous process left counts
        # as not acknowledged).
        first, self._last = spool.bounds()
        self._acked = self._dropped = first - 1 if first else self._last
        self._progress: asyncio.Event | None = None  # set (and replaced) on every append
        self._to_write: asyncio.Event | None = None
        self._to_send: asyncio.Event | None = None
        self._closing = False
        self._writer: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None

    # -- the request path ---------------------------------------------------------------------

    def put(self, item: T) -> int:
        """Queues one item for the spool. Returns its position (for `durable`), or 0 when it
        was dropped (too many waiting to be written). Never blocks or raises."""
        try:
            waiting = len(self._waiting)
            held = waiting if self._spool.path is not None else waiting + len(self._spool)
            if held >= self._settings.capacity or self._closing:
                self.metrics.dropped.labels("buffer_full").inc()
                return 0
            self._waiting.append(item)
            self._accepted += 1
            self.metrics.buffered.inc()
            if not waiting and self._to_write is not None:
                self._to_write.set()
            return self._accepted
        except Exception:  # the request path must never see the outbox's problems
            with contextlib.suppress(Exception):
                log.exception("outbox_put_failed", outbox=self._name)
            return 0

    async def durable(self, position: int) -> None:
        """Returns once the item at `position` (from `put`) is in the spool (at once for 0).
        While the spool cannot be written it does not return: bound it with a timeout."""
        while self._written < position:
            if self._progress is None:
                self._progress = asyncio.Event()
            await self._progress.wait()

    @property
    def pending(self) -> int:
        """Items waiting to be written."""
        return len(self._waiting)

    @property
    def spooled(self) -> int:
        """Items in the spool not yet acknowledged by the receiver."""
        return self._last - self._acked

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the writer and the sender on the running loop (the sender begins with what
        a previous process left in the spool)."""
        self._to_write = asyncio.Event()
        self._to_send = asyncio.Event()
        if self._waiting:
            self._to_write.set()
        if self.spooled:
            self._to_send.set()
        self.metrics.buffered.set(len(self._waiting) + self.spooled)
        self._writer = asyncio.create_task(self._write_loop(), name=f"{self._name}-writer")
        self._sender = asyncio.create_task(self._send_loop(), name=f"{self._name}-sender")

    async def close(self, timeout_seconds: float = 5.0) -> None:
        """Appends what waits, makes one bounded attempt (`timeout_seconds`) to deliver the
        spool, stops, and closes the spool; what is left stays in the file for the next
        process (in memory: counted as dropped)."""
        self._closing = True
        if self._writer is not None:
            assert self._to_write is not None
            self._to_write.set()
            with contextlib.suppress(Exception):
                await self._writer  # it appends what waits, then returns
            self._writer = None
        elif self._waiting:
            await self._append()
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
            self._sender = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain_once(), timeout_seconds)
        if self._acked > self._dropped:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._spool.drop, self._acked)
                self._dropped = self._acked
        left = self.spooled + len(self._waiting)
        if left and self._spool.path is None:
            log.warning("outbox_items_lost_at_close", outbox=self._name, items=left)
            self.metrics.dropped.labels("buffer_full").inc(left)
        elif left:
            log.info("outbox_left_for_next_start", outbox=self._name, items=left)
        await asyncio.to_thread(self._spool.close)

    # -- writer -------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        assert self._to_write is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting:
                if self._closing:
                    return
                self._to_write.clear()
                if self._last > self._dropped:  # rows on disk: trim the acknowledged, later
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._to_write.wait(), _IDLE_TRIM_SECONDS)
                    if not self._waiting and self._acked > self._dropped and not self._closing:
                        await self._append()
                    continue
                await self._to_write.wait()
                continue
            started = loop.time()
            if not await self._append():
                await self._sleep(self._settings.backoff_initial_seconds)
                continue
            if self._closing:
                continue
            rest = self._settings.flush_interval_seconds - (loop.time() - started)
            if rest > 0:
                await self._sleep(rest)  # the items put meanwhile go in the next append

    async def _append(self) -> bool:
        """Appends every item waiting now and removes the acknowledged ones, in one
        transaction; False when the spool could not be written (they stay waiting, in
        order)."""
        items = list(self._waiting)
        acked = self._acked
        try:
            last = await asyncio.to_thread(self._spool.append, items, acked)
        except Exception:
            log.exception("outbox_append_failed", outbox=self._name, items=len(items))
            return False
        self._dropped = max(self._dropped, acked)
        for _ in items:
            self._waiting.popleft()
        first = last - len(items) + 1
        self._memory.extend(zip(range(first, last + 1), items, strict=True))
        while len(self._memory) > self._settings.capacity:
            self._memory.popleft()  # still in the file: read back when its turn comes
        self._last = max(self._last, last)
        self._written += len(items)
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()
        if self._to_send is not None:
            self._to_send.set()
        return True

    # -- sender -------------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        assert self._to_send is not None
        failures = 0
        while True:
            if not self.spooled:
                self._to_send.clear()
                await self._to_send.wait()
                continue
            try:
                await self._send_one()
                failures = 0
            except _Unreachable as exc:
                failures += 1
                delay = random.uniform(  # jitter, not a secret
                    0,
                    min(
                        self._settings.backoff_max_seconds,
                        self._settings.backoff_initial_seconds * 2 ** min(failures - 1, 30),
                    ),
                )
                log.warning(
                    "outbox_receiver_unreachable",
                    outbox=self._name,
                    attempt=failures,
                    spooled=len(self._spool),
                    error=str(exc),
                )
                await self._sleep(delay)
            except Exception:  # a bug here must not end the sender; the spool keeps the items
                log.exception("outbox_sender_error", outbox=self._name)
                await self._sleep(self._settings.backoff_max_seconds)

    async def _send_one(self) -> None:
        """Sends the spool's oldest batch and removes it once acknowledged (or refused).

        Raises:
            _Unreachable: a retryable failure; the batch stays in the spool.
        """
        while self._memory and self._memory[0][0] <= self._acked:
            self._memory.popleft()
        size = self._settings.batch_size
        if self._memory and self._memory[0][0] == self._acked + 1:
            taken = list(itertools.islice(self._memory, size))
            through, batch = taken[-1][0], [item for _, item in taken]
        else:  # older items than memory holds: read them back
            through, batch = await asyncio.to_thread(self._spool.peek, size, self._acked)
            if batch and self._memory:
                batch = batch[: max(1, self._memory[0][0] - self._acked - 1)]
                through = self._acked + len(batch)
        if not batch:
            self._acked = self._last  # nothing left on disk (rows trimmed meanwhile)
            return
        try:
            await self._send_batch(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._retryable(exc):
                raise _Unreachable(str(exc)) from exc
            self.metrics.dropped.labels("rejected").inc(len(batch))
            log.error("outbox_batch_rejected", outbox=self._name, items=len(batch), error=str(exc))
        else:
            self.metrics.sent.inc(len(batch))
        self._acked = max(self._acked, through)
        self.metrics.buffered.set(len(self._waiting) + self.spooled)

    async def _drain_once(self) -> None:
        """Sends the spool batch by batch until it is empty or a send fails."""
        with contextlib.suppress(_Unreachable):
            while self.spooled:
                await self._send_one()


class _Unreachable(Exception):
    """A batch could not be delivered now (a retryable failure); it stays in the spool."""

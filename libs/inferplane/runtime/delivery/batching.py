"""`Batcher`: a request path's non-blocking hand-off of items to a remote service, in batches.

Per-request facts (records to telemetry, usage to auth) must never slow or fail the request,
should wait out a short outage of the receiver, and must not grow memory without bound. A
`Batcher[T]` is that machinery; a sink converts its items and says how a batch is sent:
- `put(item)` (any thread) never blocks, raises or does I/O; at most `capacity` items are held,
  buffered plus in flight; beyond that the newest is dropped, counted as
  `{prefix}_dropped_total{reason="buffer_full"}`;
- a batch goes when `batch_size` items wait or the oldest waited `flush_interval_seconds`
  (0: at once, so batches grow with load only);
- a send failing with a retryable error (`retryable`; by default the gRPC codes in
  `RETRYABLE_CODES`) puts the batch back at the front, in order, and the sender backs off
  (tenacity, exponential, full jitter): nothing is lost in an outage shorter than the buffer;
  any other error drops the batch, counted as `reason="rejected"`;
- delivery is at-least-once (receivers drop copies by request id); `close()` makes one last
  bounded flush and counts what is left as dropped (facts that must survive an outage or a
  crash go through a durable `inferplane.runtime.delivery.outbox.Outbox` instead);
- items settle (delivered, refused or lost at close) in the order they were put: `put` returns
  the item's position and `settled(position)` waits until that item settled, for a caller
  that must not go on before the receiver knows.
`GrpcSink` is a `Batcher` sending to one gRPC service (the sinks subclass it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_random_exponential,
)

from inferplane.runtime.security.identity import PeerSecurity
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.runtime.delivery.batching")

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)
"""gRPC codes after which the same batch may succeed later (the receiver is down, restarting,
overloaded). Any other code means it refused the batch itself: re-sending would wedge the
sender."""


def retryable_rpc_error(exc: BaseException) -> bool:
    """True for a gRPC call that failed with one of `RETRYABLE_CODES`."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE_CODES


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BatchingSettings:
    """How a `Batcher` buffers and sends (sinks subclass it with their target).

    Attributes:
        capacity: items held at most, buffered plus in flight. An outage shorter than
            `capacity / items per second` loses nothing.
        batch_size: items per send.
        flush_interval_seconds: a partial batch is sent once its oldest item waited this
            long; 0: at once.
        backoff_initial_seconds, backoff_max_seconds: exponential backoff with full jitter
            between failed sends.
    """

    capacity: int = 10_000
    batch_size: int = 500
    flush_interval_seconds: float = 0.0
    backoff_initial_seconds: float = 0.2
    backoff_max_seconds: float = 10.0


class BatchMetrics:
    """`{prefix}_sent_total`, `{prefix}_dropped_total{reason}` and `{prefix}_buffered`, in the
    registry of the caller's composition root. `reasons` are pre-created at 0 (the batcher
    uses `buffer_full` and `rejected`; a sink may add its own, e.g. `invalid`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str,
        *,
        sent_help: str,
        dropped_help: str,
        buffered_help: str,
        reasons: Sequence[str] = ("buffer_full", "rejected"),
    ) -> None:
        self.sent = Counter(f"{prefix}_sent", sent_help, registry=registry)
        self.dropped = Counter(f"{prefix}_dropped", dropped_help, ["reason"], registry=registry)
        self.buffered = Gauge(f"{prefix}_buffered", buffered_help, registry=registry)
        for reason in reasons:
            self.dropped.labels(reason)


class _SendFailed(Exception):
    """A batch could not be delivered now and went back to the front of the buffer."""


class Batcher(Generic[T]):
    """Buffers items and hands them to `send` (delivers one batch or raises) in batches, from
    a background task on the loop that ran `start()`; see the module docstring."""

    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[object]],
        settings: BatchingSettings,
        metrics: BatchMetrics,
        *,
        name: str,
        retryable: Callable[[BaseException], bool] = retryable_rpc_error,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._send_batch = send
        self._settings = settings
        self.metrics = metrics
        self._name = name
        self._retryable = retryable
        self._clock = clock or SystemClock()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._buffer: collections.deque[T] = collections.deque()
        self._in_flight = 0
        self._oldest_at: float | None = None
        self._accepted = 0  # items ever accepted by put: the last one's position
        self._settled = 0  # items ever settled, oldest first
        self._progress: asyncio.Event | None = None  # set (and replaced) on every settle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._send_lock: asyncio.Lock | None = None
        self._task: asyncio.Task[None] | None = None

    def put(self, item: T) -> int:
        """Queues one item. Returns its position (1, 2, ...: for `settled`), or 0 when it was
        dropped (buffer full). Never blocks or raises; may be called from any thread."""
        try:
            with self._lock:
                size = len(self._buffer) + self._in_flight
                if size >= self._settings.capacity:
                    self.metrics.dropped.labels("buffer_full").inc()
                    return 0
                was_empty = not self._buffer
                self._buffer.append(item)
                self._accepted += 1
                position = self._accepted
                if self._oldest_at is None:
                    self._oldest_at = self._clock.monotonic()
                # With an interval the sender polls (no cross-thread wake-up per request).
                wake = len(self._buffer) == self._settings.batch_size or (
                    was_empty and not self._settings.flush_interval_seconds
                )
            self.metrics.buffered.set(size + 1)
            if wake and self._loop is not None and self._wake is not None:
                self._loop.call_soon_threadsafe(self._wake.set)
            return position
        except Exception:  # the request path must never see the sender's problems
            with contextlib.suppress(Exception):
                log.exception("batch_put_failed", sink=self._name)
            return 0

    async def settled(self, position: int) -> None:
        """Returns once the item at `position` (from `put`) settled: delivered, refused by the
        receiver, or counted as lost at `close()`. Bound it with a timeout: while the receiver
        is down it does not return. Call it on the sender's loop."""
        while self._settled < position:
            if self._progress is None:
                self._progress = asyncio.Event()
            await self._progress.wait()

    @property
    def pending(self) -> int:
        """Items buffered or in flight."""
        with self._lock:
            return len(self._buffer) + self._in_flight

    async def start(self) -> None:
        """Starts the background sender on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def close(self, timeout_seconds: float = 5.0) -> None:
        """Stops the sender after one last attempt (bounded by `timeout_seconds`) to deliver
        what is buffered; what is still undelivered is counted as dropped (`buffer_full`)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._send_lock is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), timeout_seconds)
        with self._lock:
            left = len(self._buffer) + self._in_flight
            self._buffer.clear()
            self._in_flight = 0
            self._oldest_at = None
        self._advance(left)
        if left:
            log.warning("batch_items_lost_at_close", sink=self._name, items=left)
            self.metrics.dropped.labels("buffer_full").inc(left)
            self.metrics.buffered.set(0)

    async def flush(self) -> int:
        """Sends everything buffered now, batch by batch, one attempt each (a drain hook).

        Returns the items delivered; never raises: what could not be delivered stays buffered
        for the background sender.
        """
        try:
            return await self._flush()
        except _SendFailed:
            return 0

    async def _flush(self) -> int:
        """`flush`, raising `_SendFailed` (items kept) when a batch could not be delivered."""
        assert self._send_lock is not None, "start() first"
        delivered = 0
        async with self._send_lock:
            while batch := self._take_batch():
                delivered += await self._send(batch)
        return delivered

    def _take_batch(self) -> list[T]:
        with self._lock:
            count = min(self._settings.batch_size, len(self._buffer))
            batch = [self._buffer.popleft() for _ in range(count)]
            self._in_flight += count
            if not self._buffer:
                self._oldest_at = None
            return batch

    async def _attempt(self, batch: list[T]) -> bool:
        """One send of `batch`: True when delivered (counted as sent), False when the receiver
        refused it (counted as rejected: re-sending would wedge the sender).

        Raises:
            _SendFailed: a retryable failure (the receiver is away); the caller keeps the batch.
        """
        try:
            await self._send_batch(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._retryable(exc):
                raise _SendFailed(str(exc)) from exc
            self.metrics.dropped.labels("rejected").inc(len(batch))
            log.error("batch_rejected", sink=self._name, items=len(batch), error=str(exc))
            return False
        self.metrics.sent.inc(len(batch))
        return True

    async def _send(self, batch: list[T]) -> int:
        try:
            delivered = await self._attempt(batch)
        except (asyncio.CancelledError, _SendFailed):
            self._requeue(batch)
            raise
        self._settle(len(batch))
        return len(batch) if delivered else 0

    def _settle(self, count: int) -> None:
        with self._lock:
            self._in_flight -= count
            size = len(self._buffer) + self._in_flight
        self.metrics.buffered.set(size)
        self._advance(count)

    def _advance(self, count: int) -> None:
        """`count` more of the oldest items settled: wakes `settled` waiters (sender's loop)."""
        self._settled += count
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    def _requeue(self, batch: list[T]) -> None:
        """Puts `batch` (taken for a send) back at the front, in order."""
        with self._lock:
            self._in_flight -= len(batch)
            self._buffer.extendleft(reversed(batch))
            if self._oldest_at is None:
                self._oldest_at = self._clock.monotonic()

    def _due_in(self) -> float | None:
        """Seconds until a batch is due (0: now); while nothing is buffered, the interval
        (polling) or, without one, None (until woken)."""
        with self._lock:
            if self._oldest_at is None or not self._buffer:
                return self._settings.flush_interval_seconds or None
            if len(self._buffer) >= self._settings.batch_size:
                return 0.0
            waited = self._clock.monotonic() - self._oldest_at
            return max(0.0, self._settings.flush_interval_seconds - waited)

    async def _wait_for_work(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            delay = self._due_in()
            if delay == 0:
                return
            waiters: set[asyncio.Future[object]] = {asyncio.ensure_future(self._wake.wait())}
            if delay is not None:
                waiters.add(asyncio.ensure_future(self._sleep(delay)))
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    async def _run(self) -> None:
        while True:
            await self._wait_for_work()
            try:
                await self._deliver()
            except Exception:  # a bug here must not end the sender; the items stay buffered
                log.exception("batch_sender_error", sink=self._name)
                await self._sleep(self._settings.backoff_max_seconds)

    async def _deliver(self) -> None:
        """Flushes, retrying with backoff until everything buffered now got through."""
        settings = self._settings

        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            log.warning(
                "batch_receiver_unreachable",
                sink=self._name,
                attempt=state.attempt_number,
                buffered=self.pending,
                error=str(error),
            )

        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(_SendFailed),
            wait=wait_random_exponential(
                multiplier=settings.backoff_initial_seconds, max=settings.backoff_max_seconds
            ),
            stop=stop_never,
            sleep=self._sleep,
            before_sleep=before_sleep,
            reraise=True,
        ):
            with attempt:
                await self._flush()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GrpcSinkSettings(BatchingSettings):
    """`BatchingSettings` plus the receiver: `target` (`host:port`), the deadline of one
    call, `rpc_timeout_seconds`, and the identity the channel presents (`security`;
    plaintext by default, for tests)."""

    target: str
    rpc_timeout_seconds: float = 5.0
    security: PeerSecurity = dataclasses.field(default_factory=PeerSecurity.plaintext)


class GrpcSink(Generic[T]):
    """A `Batcher` sending to one gRPC service over its own channel. Subclasses make their stub
    in `_bind(channel)` and send one batch in `_send(batch)`; `_put` is their request path."""

    def __init__(
        self,
        settings: GrpcSinkSettings,
        metrics: BatchMetrics,
        *,
        name: str,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._settings = settings
        self._channel_options = channel_options
        self._channel: grpc.aio.Channel | None = None
        self._batcher: Batcher[T] = Batcher(
            self._send, settings, metrics, name=name, clock=clock, sleep=sleep
        )
        self._put = self._batcher.put
        self.metrics = metrics

    @property
    def pending(self) -> int:
        """Items buffered or in flight."""
        return self._batcher.pending

    async def start(self) -> None:
        """Opens the channel and starts the background sender on the running loop. The
        channel's reconnect backoff is capped at `backoff_max_seconds` (gRPC's default cap,
        120 s, would outlast a short outage)."""
        max_backoff_ms = max(100, int(self._settings.backoff_max_seconds * 1000))
        self._channel = self._settings.security.aio_channel(
            self._settings.target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", max_backoff_ms),
                *self._channel_options,
            ],
        )
        self._bind(self._channel)
        await self._batcher.start()

    async def flush(self) -> int:
        """Sends everything buffered now, one attempt per batch; returns the items delivered.
        Never raises: what could not be delivered stays buffered."""
        return await self._batcher.flush()

    async def settled(self, position: int) -> None:
        """`Batcher.settled`: returns once the item `_put` placed at `position` settled."""
        await self._batcher.settled(position)

    async def close(self, timeout_seconds: float = 5.0) -> None:
        """Stops the sender after one last bounded attempt to deliver what is buffered (the
        rest is counted as dropped), then closes the channel."""
        await self._batcher.close(timeout_seconds)
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    def _bind(self, channel: grpc.aio.Channel) -> None:
        raise NotImplementedError

    async def _send(self, batch: list[T]) -> None:
        raise NotImplementedError

"""The in-process engine's own state (`inproc`, issue 29): its scheduler's numbers and its KV
events, for the replica's `WatchReplicaState` stream (`server/state_stream.py`).

`InprocEngineState` is made before vLLM's `AsyncLLM` and follows it:

1. `engine_args(argv)`: binds the KV event subscriber on loopback and appends vLLM's
   `--enable-prefix-caching --kv-events-config {...}` (publisher `zmq`, the subscriber's
   `tcp://127.0.0.1:<port>`, a loopback replay socket), unless the engine pools (`--runner
   pooling`: no prefix cache to route on) or prefix caching is turned off;
2. `stat_loggers()`: the stat logger vLLM calls once per engine step (`engine_stats.py`);
3. `started(llm)`: the engine's block size and block count (`cache_config.num_gpu_blocks`, known
   once the engine core reported it), the index bounded by them, the subscriber started;
4. `close()`.

It is the engine's `ReportsEngineState` (`InprocEngine` delegates to it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from inferplane.replica.engines.engine_stats import (
    EngineStats,
    SchedulerStatsSink,
    vllm_stat_logger,
)
from inferplane.replica.engines.kv_events import (
    KvBlockIndex,
    KvEventSubscriber,
    prefix_caching_off,
)
from inferplane.runtime.processes.ports import free_port

log = structlog.get_logger("inferplane.replica.engines.inproc_state")


def wants_kv_events(argv: Sequence[str]) -> bool:
    """KV events are worth turning on for these engine arguments: a generating engine with
    prefix caching (pooling engines cache nothing routers could reuse)."""
    pooling = any(
        a == "pooling" and i > 0 and argv[i - 1] == "--runner" for i, a in enumerate(argv)
    ) or ("--runner=pooling" in argv)
    return not pooling and not prefix_caching_off(argv)


class InprocEngineState:
    """The scheduler's numbers and the KV blocks of an in-process vLLM engine (module doc).

    Args:
        kv_events: subscribe to the engine's KV events (when `wants_kv_events` agrees).
        on_change: called when a reading or a KV batch changed something.
    """

    def __init__(
        self, *, kv_events: bool = True, on_change: Callable[[], object] = lambda: None
    ) -> None:
        self._sink = SchedulerStatsSink(on_change)
        self._want_events = kv_events
        self._on_change = on_change
        self._index: KvBlockIndex | None = None
        self._subscriber: KvEventSubscriber | None = None
        self._task: asyncio.Task[None] | None = None

    def engine_args(self, argv: Sequence[str]) -> list[str]:
        """`argv` plus the KV event arguments (see the module doc)."""
        argv = list(argv)
        if not (self._want_events and wants_kv_events(argv)):
            return argv
        index = KvBlockIndex()
        subscriber = KvEventSubscriber(index, on_change=self._on_change, replay_port=free_port())
        subscriber.bind()
        self._index, self._subscriber = index, subscriber
        log.info("kv_events_subscribed", endpoint=subscriber.endpoint)
        return argv + subscriber.engine_args()

    def stat_loggers(self) -> list[Callable[..., Any]]:
        """vLLM stat logger factories for `AsyncLLM.from_engine_args(stat_loggers=...)`."""
        return [vllm_stat_logger(self._sink)]

    def started(self, llm: Any) -> None:
        """The engine is up: its block size and count; the subscriber starts (needs a loop)."""
        cache = llm.vllm_config.cache_config
        self._sink.configure(int(cache.block_size or 0), int(cache.num_gpu_blocks or 0))
        if self._index is not None and self._subscriber is not None:
            self._index.block_size = self._sink.block_size
            self._index.set_capacity(self._sink.total_kv_blocks)
            self._task = asyncio.ensure_future(self._subscriber.run())

    def engine_stats(self) -> EngineStats:
        return self._sink.stats()

    @property
    def kv_blocks(self) -> KvBlockIndex | None:
        """The KV block index while its subscription runs (None: events off or failed)."""
        if self._subscriber is None or self._subscriber.failed or self._task is None:
            return None
        return self._index

    async def close(self) -> None:
        """Stops the subscription (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._subscriber is not None:
            self._subscriber.close()

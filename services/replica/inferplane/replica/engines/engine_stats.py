"""The engine's own state as the replica streams it to routers (issue 29): KV capacity, the
engine's queue, preemptions, and its KV blocks by content hash.

- `EngineStats`: one reading (blocks, requests, preemptions).
- `ReportsEngineState`: what an engine client offers when it knows its state (`engine_stats`,
  and `kv_blocks`, the `KvBlockIndex` its KV events fill, or None without events). The state
  stream (`server/state_stream.py`) asks the replica's engine for it; an engine without it
  reports zeros and `kv_events` false.
- `SchedulerStatsSink` and `vllm_stat_logger`: for `inproc`, a vLLM stat logger
  (`vllm.v1.metrics.loggers.StatLoggerBase`, handed to `AsyncLLM.from_engine_args(
  stat_loggers=...)`) that keeps the last `SchedulerStats` (`num_running_reqs`,
  `num_waiting_reqs`, `kv_cache_usage`) and sums `IterationStats.num_preempted_reqs`: the same
  numbers vLLM's Prometheus logger turns into `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and `vllm:num_preemptions_total`,
  taken where vLLM hands them over (once per engine step, on the event loop, a few attribute
  reads) rather than by reading the Prometheus registry back. `total_kv_blocks` is the cache
  config's `num_gpu_blocks` less vLLM's null block (never allocatable: `BlockPool.get_usage`
  divides by the same), `free_kv_blocks` is `total × (1 − kv_cache_usage)` (blocks that only
  cache a prefix are free: vLLM evicts them on demand).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from inferplane.replica.engines.kv_events import KvBlockIndex


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """One reading of the engine's state (0: not known).

    Attributes:
        block_size: tokens per KV block.
        total_kv_blocks: KV blocks a request can hold in all.
        free_kv_blocks: KV blocks not held by a running request.
        running_requests: requests the engine runs (prefill or decode).
        waiting_requests: requests in the engine's own queue.
        preemptions_total: preemptions since the engine started.
    """

    block_size: int = 0
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    preemptions_total: int = 0


UNKNOWN = EngineStats()


@runtime_checkable
class ReportsEngineState(Protocol):
    """An engine client that knows its own state."""

    def engine_stats(self) -> EngineStats:
        """The latest reading (cheap: called up to ~20 times a second)."""
        ...

    @property
    def kv_blocks(self) -> KvBlockIndex | None:
        """The engine's cached blocks by content hash (None: no KV events)."""
        ...


class SchedulerStatsSink:
    """The last scheduler reading of an in-process vLLM engine, and its preemptions.

    Args:
        on_change: called after each reading that changed something (the state stream's
            wake-up).
    """

    def __init__(self, on_change: Callable[[], object] = lambda: None) -> None:
        self._on_change = on_change
        self.block_size = 0
        self.total_kv_blocks = 0
        self.running = 0
        self.waiting = 0
        self.usage = 0.0
        self.preemptions = 0

    def configure(self, block_size: int, num_gpu_blocks: int) -> None:
        """The engine's block size and block count (after the engine started)."""
        self.block_size = block_size
        self.total_kv_blocks = max(0, num_gpu_blocks - 1)  # less vLLM's null block

    def record(self, running: int, waiting: int, usage: float, preempted: int) -> None:
        """One engine step's numbers (`preempted`: this step's preemptions)."""
        changed = (running, waiting, usage) != (self.running, self.waiting, self.usage)
        self.running, self.waiting, self.usage = running, waiting, usage
        if preempted:
            self.preemptions += preempted
            changed = True
        if changed:
            self._on_change()

    def stats(self) -> EngineStats:
        """The reading as `EngineStats`."""
        total = self.total_kv_blocks
        free = round(total * (1.0 - min(max(self.usage, 0.0), 1.0)))
        return EngineStats(
            block_size=self.block_size,
            total_kv_blocks=total,
            free_kv_blocks=free,
            running_requests=self.running,
            waiting_requests=self.waiting,
            preemptions_total=self.preemptions,
        )


def vllm_stat_logger(sink: SchedulerStatsSink) -> Callable[..., Any]:
    """A vLLM `StatLoggerFactory` (`factory(vllm_config, engine_index)`) whose loggers feed
    `sink`. Imports vLLM: call it after the engine environment is set (inproc only)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._config = vllm_config

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            preempted = iteration_stats.num_preempted_reqs if iteration_stats is not None else 0
            if scheduler_stats is None:
                if preempted:
                    sink.record(sink.running, sink.waiting, sink.usage, preempted)
                return
            sink.record(
                scheduler_stats.num_running_reqs,
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                scheduler_stats.kv_cache_usage,
                preempted,
            )

        def log_engine_initialized(self) -> None:
            cache = self._config.cache_config
            sink.configure(int(cache.block_size or 0), int(cache.num_gpu_blocks or 0))

    def factory(vllm_config: Any, engine_index: int = 0) -> Any:
        return _SinkLogger(vllm_config, engine_index)

    return factory

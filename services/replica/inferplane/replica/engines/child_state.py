"""A child engine's own state (`http-completions`, `grpc`; issue 29), for the replica's
`WatchReplicaState` stream, from what the engine already exposes:

- numbers: its Prometheus endpoint (`--engine-metrics-url`: vLLM's `/metrics`, or our launcher's
  `--metrics-port` in `--grpc` mode), read every `poll_seconds` (0.25 s) and only the lines
  needed: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
  `vllm:num_preemptions_total` and `vllm:cache_config_info` (labels `block_size`,
  `num_gpu_blocks`); an engine that does not report one leaves it 0 (unknown);
- KV events (`http-completions` only): `--enable-prefix-caching --kv-events-config {...}`
  appended to the child's command (vLLM's arguments come last), publishing to the replica's
  loopback subscriber (`kv_events.KvEventSubscriber`). `kv_events` reads true from the first
  batch received (a child that never publishes, such as a fake engine, stays false). The `grpc`
  transport's servicer has KV events of its own on all interfaces (`SMG_VLLM_SERVICER_KV_EVENTS`
  stays 0): no events there.

Cost: one loopback HTTP GET per poll; vLLM's `/metrics` text is tens of kB (histograms), of
which only the lines starting with the five names are split and read.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Sequence

import structlog

from inferplane.replica.engines.engine_stats import EngineStats
from inferplane.replica.engines.inproc_state import wants_kv_events
from inferplane.replica.engines.kv_events import KvBlockIndex, KvEventSubscriber
from inferplane.runtime.processes.ports import free_port

log = structlog.get_logger("inferplane.replica.engines.child_state")

POLL_SECONDS = 0.25
_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def stats_from_metrics(text: str) -> EngineStats:
    """An `EngineStats` from a vLLM Prometheus exposition (values summed over engines; the
    block count less vLLM's null block, as `engine_stats.SchedulerStatsSink` counts it)."""
    values: dict[str, float] = {}
    block_size = blocks = 0
    for line in text.splitlines():
        if not line.startswith(_NAMES):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value = line.partition(" ")
            labels = ""
        else:
            labels, _, value = rest.rpartition("}")
        try:
            number = float(value.split()[0])
        except (IndexError, ValueError):
            continue
        if name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels))
            with contextlib.suppress(ValueError):
                block_size = int(found.get("block_size", "0") or 0)
                blocks += int(found.get("num_gpu_blocks", "0") or 0)
            continue
        values[name] = values.get(name, 0.0) + number
    total = max(0, blocks - 1)
    usage = min(max(values.get("vllm:kv_cache_usage_perc", 0.0), 0.0), 1.0)
    return EngineStats(
        block_size=block_size,
        total_kv_blocks=total,
        free_kv_blocks=round(total * (1.0 - usage)),
        running_requests=int(values.get("vllm:num_requests_running", 0)),
        waiting_requests=int(values.get("vllm:num_requests_waiting", 0)),
        preemptions_total=int(values.get("vllm:num_preemptions_total", 0)),
    )


class ChildEngineState:
    """`ReportsEngineState` of a child engine (see the module doc).

    Args:
        metrics_url: the engine's Prometheus endpoint ("": no numbers, and no KV events: the
            block count from there bounds the KV index).
        kv_events: subscribe to its KV events (`engine_argv` then adds the arguments).
        poll_seconds: how often the metrics are read.
        on_change: called when a reading or a KV batch changed something.
    """

    def __init__(
        self,
        metrics_url: str,
        *,
        kv_events: bool,
        poll_seconds: float = POLL_SECONDS,
        on_change: Callable[[], object] = lambda: None,
    ) -> None:
        self._url = metrics_url
        self._want_events = kv_events
        self._poll = poll_seconds
        self._on_change = on_change
        self._stats = EngineStats()
        self._index: KvBlockIndex | None = None
        self._subscriber: KvEventSubscriber | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def engine_argv(self, argv: Sequence[str]) -> list[str]:
        """The child's command with the KV event arguments appended (when wanted)."""
        argv = list(argv)
        if not (self._want_events and self._url and wants_kv_events(argv)):
            return argv  # without the engine's block count the index could not be bounded
        index = KvBlockIndex()
        subscriber = KvEventSubscriber(index, on_change=self._on_change, replay_port=free_port())
        subscriber.bind()
        self._index, self._subscriber = index, subscriber
        return argv + subscriber.engine_args()

    def start(self) -> None:
        """Starts polling and receiving (in the running loop)."""
        if self._url:
            self._tasks.append(asyncio.ensure_future(self._poll_metrics()))
        if self._subscriber is not None:
            self._tasks.append(asyncio.ensure_future(self._subscriber.run()))

    async def _poll_metrics(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=max(self._poll * 4, 1.0))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with session.get(self._url) as response:
                        text = await response.text() if response.status == 200 else ""
                except (aiohttp.ClientError, TimeoutError):
                    text = ""
                if text:
                    stats = stats_from_metrics(text)
                    if stats != self._stats:
                        self._stats = stats
                        self._set_capacity(stats)
                        self._on_change()
                await asyncio.sleep(self._poll)

    def _set_capacity(self, stats: EngineStats) -> None:
        if self._index is not None and stats.total_kv_blocks:
            self._index.set_capacity(stats.total_kv_blocks)
            if not self._index.block_size:
                self._index.block_size = stats.block_size

    def engine_stats(self) -> EngineStats:
        return self._stats

    @property
    def kv_blocks(self) -> KvBlockIndex | None:
        """The KV block index once the engine's first batch arrived (None before, or when
        events are off or the subscription failed)."""
        subscriber = self._subscriber
        if subscriber is None or subscriber.failed or not subscriber.messages:
            return None
        return self._index

    async def close(self) -> None:
        """Stops polling and receiving (idempotent)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._subscriber is not None:
            self._subscriber.close()

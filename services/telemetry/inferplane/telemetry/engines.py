"""Engine metrics: scrape each replica's Prometheus endpoint, attribute, derive rates.

Each target is one replica's `/metrics` (vLLM's registry, served by the node-agent's launcher).
The series read (vLLM 0.32 names; summed over vLLM's `engine` label, the max for usage):

| vLLM series | meaning |
|---|---|
| `vllm:kv_cache_usage_perc` | KV cache usage, a fraction 0..1 despite the name |
| `vllm:num_requests_running` / `vllm:num_requests_waiting` | requests in the batch / queued |
| `vllm:num_preemptions_total` | preemptions (a request's KV blocks taken back) |
| `vllm:prefix_cache_queries_total` / `_hits_total` | prompt tokens looked up / found |

Targets are static (settings, `deployment/replica=url`) and/or follow the orchestrator's
routing table (`discovery.py` calls `EngineScraper.set_targets` on every change).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

import httpx
import structlog
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from inferplane.runtime import ConfigError
from inferplane.runtime.time.clock import Clock
from inferplane.telemetry.domain import counter_increase, counter_rate

log = structlog.get_logger("inferplane.telemetry")

Fetch = Callable[[str], Awaitable[str]]
"""Returns the Prometheus text exposition at a URL; raises on any failure."""

_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
}
_KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTarget:
    """One replica's metrics endpoint and what it belongs to."""

    deployment: str
    replica: str
    url: str

    @classmethod
    def parse(cls, spec: str) -> EngineTarget:
        """Parses `deployment/replica=http://host:port/metrics`.

        Raises:
            ConfigError: the spec does not have that shape.
        """
        name, sep, url = spec.partition("=")
        deployment, slash, replica = name.strip().partition("/")
        if not (sep and slash and deployment and replica and url.startswith("http")):
            raise ConfigError(
                f"engine target {spec!r}: expected deployment/replica=http://host:port/metrics"
            )
        return cls(deployment, replica, url.strip())


@dataclasses.dataclass(frozen=True, slots=True)
class EngineReading:
    """One scrape of one replica at `time` (epoch seconds); None where the series was absent."""

    time: float
    up: bool
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


def parse_exposition(text: str, now: float) -> EngineReading:
    """Reads the vLLM series above out of a Prometheus text exposition.

    Raises:
        ValueError: the text is not a valid exposition.
    """
    values: dict[str, float] = {}
    kv: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == _KV_USAGE:
                kv = sample.value if kv is None else max(kv, sample.value)
            elif sample.name in _SUMMED:
                field = _SUMMED[sample.name]
                values[field] = values.get(field, 0.0) + sample.value
    return EngineReading(time=now, up=True, kv_cache_usage=kv, **values)


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentEngineStats:
    """A deployment's engine numbers over the rate window (ratios 0..1, per-second rates).

    `prefix_cache_hit_rate` is Σ hit tokens / Σ queried tokens over the window across replicas
    (None when nothing was queried); `preemptions` is the increase over the window and
    `preemption_rate` that increase per second; `kv_cache_usage` is the hottest replica's.
    """

    deployment: str
    replicas: int
    replicas_up: int
    kv_cache_usage: float | None
    running: float
    waiting: float
    preemptions: float
    preemption_rate: float
    prefix_cache_hit_rate: float | None


def deployment_stats(
    deployment: str, histories: Iterable[Sequence[EngineReading]]
) -> DeploymentEngineStats:
    """Aggregates the replicas' reading histories (each time-ordered, within the window)."""
    replicas = up = 0
    kv: float | None = None
    running = waiting = preemptions = rate = hits = queries = 0.0
    for history in histories:
        replicas += 1
        ok = [r for r in history if r.up]
        if history and history[-1].up:
            up += 1
            last = history[-1]
            if last.kv_cache_usage is not None:
                kv = last.kv_cache_usage if kv is None else max(kv, last.kv_cache_usage)
            running += last.running or 0.0
            waiting += last.waiting or 0.0
        pre = [(r.time, r.preemptions) for r in ok if r.preemptions is not None]
        preemptions += counter_increase(pre)
        rate += counter_rate(pre)
        hits += counter_increase([(r.time, r.prefix_hits) for r in ok if r.prefix_hits is not None])
        queries += counter_increase(
            [(r.time, r.prefix_queries) for r in ok if r.prefix_queries is not None]
        )
    return DeploymentEngineStats(
        deployment=deployment,
        replicas=replicas,
        replicas_up=up,
        kv_cache_usage=kv,
        running=running,
        waiting=waiting,
        preemptions=preemptions,
        preemption_rate=rate,
        prefix_cache_hit_rate=hits / queries if queries > 0 else None,
    )


class HttpFetch:
    """`Fetch` over httpx with a timeout; loopback or cluster-internal URLs."""

    def __init__(self, timeout_seconds: float = 2.0) -> None:
        self._client = httpx.AsyncClient(timeout=timeout_seconds)

    async def __call__(self, url: str) -> str:
        response = await self._client.get(url)
        response.raise_for_status()
        return response.text

    async def aclose(self) -> None:
        await self._client.aclose()


class EngineScraper:
    """Scrapes targets, keeps each replica's readings over `window_seconds`, exposes metrics.

    Register it as a collector (`registry.register(scraper)`): `collect` serves the latest
    snapshot, built on the event loop after each scrape and read from Prometheus's HTTP thread.
    """

    def __init__(
        self,
        targets: Sequence[EngineTarget],
        fetch: Fetch,
        clock: Clock,
        *,
        window_seconds: float = 300.0,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self._window = window_seconds
        self._targets: tuple[EngineTarget, ...] = ()
        self._history: dict[EngineTarget, deque[EngineReading]] = {}
        self._snapshot: tuple[tuple[EngineTarget, EngineReading], ...] = ()
        self._stats: dict[str, DeploymentEngineStats] = {}
        self.set_targets(targets)

    def set_targets(self, targets: Sequence[EngineTarget]) -> None:
        """Replaces the target list; history of targets still listed is kept, the others'
        series leave the exposition at once."""
        self._targets = tuple(dict.fromkeys(targets))
        self._history = {t: self._history.get(t, deque()) for t in self._targets}
        self._refresh()

    @property
    def targets(self) -> tuple[EngineTarget, ...]:
        return self._targets

    async def scrape_once(self) -> None:
        """Scrapes every target concurrently; a failed scrape records the replica as down."""
        now = self._clock.time()
        targets = self._targets  # set_targets may swap the list while the fetches run
        results = await asyncio.gather(
            *(self._fetch(t.url) for t in targets), return_exceptions=True
        )
        for target, result in zip(targets, results, strict=True):
            if target not in self._history:
                continue  # removed meanwhile: its reading would resurrect it
            if isinstance(result, BaseException):
                log.debug("engine_scrape_failed", url=target.url, error=repr(result))
                reading = EngineReading(time=now, up=False)
            else:
                try:
                    reading = parse_exposition(result, now)
                except ValueError as exc:
                    log.warning("engine_scrape_unparsable", url=target.url, error=str(exc))
                    reading = EngineReading(time=now, up=False)
            self.add_reading(target, reading)

    def add_reading(self, target: EngineTarget, reading: EngineReading) -> None:
        """Appends a reading and drops readings older than the window."""
        history = self._history.setdefault(target, deque())
        history.append(reading)
        while history and history[0].time < reading.time - self._window:
            history.popleft()
        self._refresh()

    def _refresh(self) -> None:
        self._snapshot = tuple(
            (t, h[-1]) for t, h in self._history.items() if h and t in self._targets
        )
        by_deployment: dict[str, list[Sequence[EngineReading]]] = {}
        for target in self._targets:
            by_deployment.setdefault(target.deployment, []).append(
                tuple(self._history.get(target, ()))
            )
        self._stats = {d: deployment_stats(d, hs) for d, hs in by_deployment.items()}

    def stats(self, deployment: str) -> DeploymentEngineStats | None:
        """The deployment's numbers over the window; None when it has no target."""
        return self._stats.get(deployment)

    def all_stats(self) -> dict[str, DeploymentEngineStats]:
        return dict(self._stats)

    async def run(self, interval_seconds: float, sleep: Callable[[float], Awaitable[None]]) -> None:
        """Scrapes every `interval_seconds` until cancelled."""
        while True:
            try:
                await self.scrape_once()
            except Exception:  # a bug in one scrape must not stop the loop
                log.exception("engine_scrape_loop_error")
            await sleep(interval_seconds)

    # -- prometheus_client collector -------------------------------------------------------

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snapshot, stats = self._snapshot, self._stats
        labels = ["deployment", "replica"]
        up = GaugeMetricFamily(
            "inferplane_engine_up", "1 when the replica's last scrape succeeded.", labels=labels
        )
        kv = GaugeMetricFamily(
            "inferplane_engine_kv_cache_usage_ratio",
            "KV cache usage of the replica, 0..1 (vllm:kv_cache_usage_perc).",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "inferplane_engine_requests_running", "Requests in the replica's batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "inferplane_engine_requests_waiting", "Requests queued in the replica.", labels=labels
        )
        preempt = CounterMetricFamily(
            "inferplane_engine_preemptions", "Preemptions in the replica.", labels=labels
        )
        queries = CounterMetricFamily(
            "inferplane_engine_prefix_cache_queries",
            "Prompt tokens looked up in the replica's prefix cache.",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "inferplane_engine_prefix_cache_hits",
            "Prompt tokens found in the replica's prefix cache.",
            labels=labels,
        )
        for target, reading in snapshot:
            values = [target.deployment, target.replica]
            up.add_metric(values, 1.0 if reading.up else 0.0)
            for family, value in (
                (kv, reading.kv_cache_usage),
                (running, reading.running),
                (waiting, reading.waiting),
                (preempt, reading.preemptions),
                (queries, reading.prefix_queries),
                (hits, reading.prefix_hits),
            ):
                if reading.up and value is not None:
                    family.add_metric(values, value)
        hit_rate = GaugeMetricFamily(
            "inferplane_deployment_prefix_cache_hit_ratio",
            "Prefix-cache hit tokens / queried tokens over the rate window, across replicas.",
            labels=["deployment"],
        )
        pre_rate = GaugeMetricFamily(
            "inferplane_deployment_preemptions_per_second",
            "Preemptions per second over the rate window, across replicas.",
            labels=["deployment"],
        )
        dep_kv = GaugeMetricFamily(
            "inferplane_deployment_kv_cache_usage_ratio",
            "KV cache usage of the deployment's fullest replica, 0..1.",
            labels=["deployment"],
        )
        for name, stat in stats.items():
            if stat.prefix_cache_hit_rate is not None:
                hit_rate.add_metric([name], stat.prefix_cache_hit_rate)
            pre_rate.add_metric([name], stat.preemption_rate)
            if stat.kv_cache_usage is not None:
                dep_kv.add_metric([name], stat.kv_cache_usage)
        yield from (up, kv, running, waiting, preempt, queries, hits, hit_rate, pre_rate, dep_kv)

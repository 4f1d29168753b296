"""Engine metrics: vLLM exposition parsing, attribution, windowed rates, real HTTP scrapes."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from inferplane.runtime import ConfigError
from inferplane.runtime.processes.ports import free_port
from inferplane.telemetry.engines import EngineScraper, EngineTarget, HttpFetch, parse_exposition
from inferplane.testing.clock import FakeClock


def vllm_text(
    *, kv: float, running: int, waiting: int, preemptions: float, queries: float, hits: float
) -> str:
    """What vLLM 0.32's /metrics says (two engine cores, counters with _created)."""
    return f"""\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="kimi"}} {kv}
vllm:kv_cache_usage_perc{{engine="1",model_name="kimi"}} {kv / 2}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="kimi"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="kimi"}} {waiting}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="kimi"}} {preemptions}
vllm:num_preemptions_created{{engine="0",model_name="kimi"}} 1.7e9
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="kimi"}} {queries / 2}
vllm:prefix_cache_queries_total{{engine="1",model_name="kimi"}} {queries / 2}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="kimi"}} {hits}
"""


def test_parse_reads_the_vllm_series() -> None:
    reading = parse_exposition(
        vllm_text(kv=0.5, running=3, waiting=1, preemptions=2, queries=100, hits=80), now=5.0
    )
    assert (reading.time, reading.up, reading.kv_cache_usage) == (5.0, True, 0.5)
    assert (reading.running, reading.waiting, reading.preemptions) == (3, 1, 2)
    assert (reading.prefix_queries, reading.prefix_hits) == (100, 80)
    assert parse_exposition("", 1.0).kv_cache_usage is None


def test_target_specs() -> None:
    target = EngineTarget.parse("kimi/kimi-0=http://127.0.0.1:50071/metrics")
    assert target == EngineTarget("kimi", "kimi-0", "http://127.0.0.1:50071/metrics")
    for bad in ("kimi=http://x", "kimi/r0", "kimi/r0=ftp://x"):
        with pytest.raises(ConfigError, match="deployment/replica="):
            EngineTarget.parse(bad)


class Pages:
    """A fake fetch: url → exposition text (or an exception)."""

    def __init__(self) -> None:
        self.pages: dict[str, str | Exception] = {}

    async def __call__(self, url: str) -> str:
        page = self.pages[url]
        if isinstance(page, Exception):
            raise page
        return page


def test_rates_over_the_window_per_deployment(clock: FakeClock) -> None:
    """Hit rate = Δhits/Δqueries and preemption rate = Δpreemptions/Δt over the window,
    summed across a deployment's replicas; older readings leave the window."""
    pages = Pages()
    a0 = EngineTarget("a", "a-0", "http://a0")
    a1 = EngineTarget("a", "a-1", "http://a1")
    b0 = EngineTarget("b", "b-0", "http://b0")
    scraper = EngineScraper([a0, a1, b0], pages, clock, window_seconds=60)

    def scrape(step: int) -> None:
        pages.pages["http://a0"] = vllm_text(
            kv=0.2, running=1, waiting=0, preemptions=step, queries=100 * step, hits=90 * step
        )
        pages.pages["http://a1"] = vllm_text(
            kv=0.7, running=2, waiting=1, preemptions=0, queries=100 * step, hits=50 * step
        )
        pages.pages["http://b0"] = ConnectionRefusedError("down")
        asyncio.run(scraper.scrape_once())
        clock.advance(10)

    for step in range(10):
        scrape(step)
    a = scraper.stats("a")
    assert a is not None
    assert a.prefix_cache_hit_rate == pytest.approx(140 / 200)
    # Window 60 s: readings at t = 30..90 → 6 preemptions over 60 s on a-0.
    assert a.preemptions == 6
    assert a.preemption_rate == pytest.approx(6 / 60)
    assert (a.replicas, a.replicas_up, a.kv_cache_usage, a.running, a.waiting) == (
        2,
        2,
        0.7,
        3,
        1,
    )
    b = scraper.stats("b")
    assert b is not None and (b.replicas_up, b.prefix_cache_hit_rate) == (0, None)

    registry = CollectorRegistry()
    registry.register(scraper)  # type: ignore[arg-type]
    value = registry.get_sample_value
    assert value("inferplane_engine_up", {"deployment": "b", "replica": "b-0"}) == 0
    assert (
        value("inferplane_engine_kv_cache_usage_ratio", {"deployment": "a", "replica": "a-1"})
        == 0.7
    )
    assert value("inferplane_engine_preemptions_total", {"deployment": "a", "replica": "a-0"}) == 9
    assert value(
        "inferplane_deployment_prefix_cache_hit_ratio", {"deployment": "a"}
    ) == pytest.approx(0.7)
    assert value(
        "inferplane_deployment_preemptions_per_second", {"deployment": "a"}
    ) == pytest.approx(0.1)


def test_engine_restart_is_a_counter_reset_not_a_negative_rate(clock: FakeClock) -> None:
    pages = Pages()
    target = EngineTarget("a", "a-0", "http://a0")
    scraper = EngineScraper([target], pages, clock, window_seconds=300)
    for preemptions in (5, 7, 1, 2):  # the engine restarted between 7 and 1
        pages.pages["http://a0"] = vllm_text(
            kv=0.1, running=0, waiting=0, preemptions=preemptions, queries=0, hits=0
        )
        asyncio.run(scraper.scrape_once())
        clock.advance(10)
    stats = scraper.stats("a")
    assert stats is not None and stats.preemptions == 2 + 1 + 1


def test_scrapes_a_real_metrics_endpoint_over_http(clock: FakeClock) -> None:
    """The httpx fetch reads a prometheus_client /metrics served on loopback."""
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "usage", ["engine"], registry=registry).labels("0").set(0.4)
    Counter("vllm:num_preemptions", "preemptions", ["engine"], registry=registry).labels("0").inc(3)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:

        async def main() -> None:
            fetch = HttpFetch(timeout_seconds=2)
            target = EngineTarget("kimi", "kimi-0", f"http://127.0.0.1:{port}/metrics")
            scraper = EngineScraper([target], fetch, clock)
            await scraper.scrape_once()
            await fetch.aclose()
            stats = scraper.stats("kimi")
            assert stats is not None
            assert (stats.replicas_up, stats.kv_cache_usage) == (1, 0.4)

        asyncio.run(main())
    finally:
        server.shutdown()
        thread.join(5)

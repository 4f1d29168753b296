"""`inferplane top --once` against a real in-process telemetry service, its /metrics and an
engine's /metrics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from typer.testing import CliRunner

from inferplane.runtime.processes.ports import free_port
from inferplane.telemetry.cli import app
from inferplane.testing.clock import FakeClock

from .conftest import Harness, record, start_harness, stop_harness


class Engine:
    """A vLLM-like /metrics on loopback: KV 42%, counters that `step()` moves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        Gauge("vllm:kv_cache_usage_perc", "u", ["engine"], registry=self.registry).labels("0").set(
            0.42
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "p", ["engine"], registry=self.registry
        ).labels("0")
        self.queries = Counter(
            "vllm:prefix_cache_queries", "q", ["engine"], registry=self.registry
        ).labels("0")
        self.hits = Counter(
            "vllm:prefix_cache_hits", "h", ["engine"], registry=self.registry
        ).labels("0")
        self.url = ""

    def step(self, preemptions: int, queries: int, hits: int) -> None:
        self.preemptions.inc(preemptions)
        self.queries.inc(queries)
        self.hits.inc(hits)


@pytest.fixture
def engine() -> Iterator[Engine]:
    fake = Engine()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=fake.registry)
    fake.url = f"http://127.0.0.1:{port}/metrics"
    try:
        yield fake
    finally:
        server.shutdown()
        thread.join(5)


def _top(harness: Harness, *extra: str) -> str:
    result = CliRunner().invoke(
        app,
        [
            "top",
            "--once",
            "--address",
            harness.address,
            "--metrics-url",
            f"http://127.0.0.1:{harness.settings.metrics_port}/metrics",
            *extra,
        ],
        env={"COLUMNS": "220", "INFERPLANE_PLAINTEXT": "1"},  # the test service is plaintext
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_top_once_shows_latency_engines_and_alerts(clock: FakeClock, engine: Engine) -> None:
    h = start_harness(
        clock,
        metrics_port=free_port(),
        engine_targets=(f"kimi-tiny/kimi-tiny-0={engine.url}",),
    )
    try:
        engine.step(preemptions=1, queries=1000, hits=100)
        h.loop.run(h.components.scraper.scrape_once())
        clock.advance(30)
        engine.step(preemptions=1, queries=400, hits=300)  # over the window: 75% hits
        h.loop.run(h.components.scraper.scrape_once())
        now = clock.time()
        h.send(
            *[
                record(
                    request_id=f"r{i}",
                    ttft=0.1 + 0.01 * i,
                    itl=(0.02,),
                    completion_tokens=60,
                    finished_at=now - 1,
                    error_code="server_error" if i == 0 else "",
                )
                for i in range(30)
            ]
        )
        h.send(record(request_id="na", source="node-agent", tool_calls=4, tool_calls_valid=3))
        h.evaluate()
        out = _top(h, "--window", "60")
    finally:
        stop_harness(h)
    line = next(line for line in out.splitlines() if "kimi-tiny" in line)
    assert "0.50" in line  # 30 requests / 60 s
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells == [
        "kimi-tiny",
        "kimi-tiny",
        "0.50",  # 30 requests / 60 s
        "245 ms",  # TTFT p50 of 0.10 .. 0.39 (linear interpolation)
        "387 ms",  # TTFT p99
        "20 ms",
        "20 ms",
        "30.0",  # 30 × 60 tokens / 60 s
        "3.3%",  # 1 error in 30
        "42.0%",  # KV cache usage
        "2",  # preemptions since the engine started
        "75.0%",  # prefix-cache hits over the window: 300 / 400
        "75.0%",  # tool calls valid: 3 / 4 (from the node-agent's record)
        "error_rate, preemptions",
    ]


def test_top_once_says_what_it_could_not_read(clock: FakeClock) -> None:
    h = start_harness(clock)
    try:
        out = _top(h)
    finally:
        stop_harness(h)
    assert "metrics http://127.0.0.1:0/metrics" in out
    assert "all" in out

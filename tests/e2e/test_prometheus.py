"""A real Prometheus (Debian's `prometheus`) against the session stack, with deploy/'s
configuration (rendered for the stack's ports by `render_prometheus_config`, scraping every
second) and rules.

Invariant (issue 7, "Real Prometheus"): requests sent through the edge with the `openai`
client come back through Prometheus's HTTP API as a TTFT histogram quantile no larger than
the TTFTs the client saw, and as engine metrics of the serving replica (job `engines`, found
through the file_sd file telemetry writes from the routing table); every service, Envoy and
the engine are scraped (`up` = 1); the edge's overhead (from its access log, through
telemetry) has a sample per request, each below what the client saw. Prometheus is stopped
and its data directory removed afterwards.
"""

from __future__ import annotations

import bisect
import json
import math
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from inferplane.localstack import MODEL_NAME, Stack, engine_sd_file, render_prometheus_config
from inferplane.runtime.processes.ports import free_port
from inferplane.telemetry.metrics import TTFT_BUCKETS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
REQUESTS = 8
TTFT_P99 = (
    "histogram_quantile(0.99, sum by (le) (rate(inferplane_time_to_first_token_seconds_bucket"
    f'{{deployment="{MODEL_NAME}"}}[1m])))'
)


class Prometheus:
    """A Prometheus process on loopback with its own data directory."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="inferplane-prometheus-"))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = (self.dir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of `promql` now; [] while Prometheus is not listening yet."""
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()}")
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.loads(response.read())
        except OSError:
            return []
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def prometheus(stack: Stack) -> Iterator[Prometheus]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("Debian's prometheus is not installed (apt-get install -y prometheus)")
    config = render_prometheus_config(
        yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text()),
        metrics_ports=stack.config.metrics_ports,
        envoy_admin_port=stack.config.envoy_admin_port,
        engine_sd_file=engine_sd_file(stack.config.data_dir),
        rules_dir=PROMETHEUS_DIR,
        scrape_interval="1s",
    )
    prom = Prometheus(config)
    try:
        yield prom
    finally:
        prom.stop()
        assert not prom.dir.exists() and prom.proc.returncode is not None


def _poll(what: str, probe: Callable[[], Any], timeout: float = 90.0) -> Any:
    """`probe()` until it returns something truthy; real Prometheus on its 1 s scrape clock."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _value(result: list[dict[str, Any]]) -> float:
    return sum(float(r["value"][1]) for r in result)


def test_prometheus_reads_ttft_and_engine_metrics_of_the_stack(
    stack: Stack, client: openai.OpenAI, prometheus: Prometheus
) -> None:
    started = time.monotonic()
    (endpoint,) = stack.serving_endpoints()
    replica = endpoint.replica_id
    engine = f'deployment="{MODEL_NAME}",replica="{replica}"'
    # Every target of deploy/'s config is scraped: five services, Envoy, the engine.
    _poll(
        "every target up",
        lambda: (
            {
                (r["metric"]["job"], r["metric"].get("service", r["metric"].get("replica")))
                for r in prometheus.query("up == 1")
            }
            >= {
                *(
                    ("inferplane", s)
                    for s in ("auth", "router", "orchestrator", "node-agent", "telemetry")
                ),
                ("envoy", "edge"),
                ("engines", replica),
            }
        ),
    )
    count = f'sum(inferplane_time_to_first_token_seconds_count{{deployment="{MODEL_NAME}"}})'
    queries = f"sum(vllm:prefix_cache_queries_total{{{engine}}})"
    # One request first, scraped before the measured ones: a rate needs the series to exist
    # before they arrive (on a fresh stack it appears with them and its rate would be 0).
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "warm up"}], max_tokens=2
    )
    _poll("a first TTFT observation", lambda: _value(prometheus.query(count)) >= 1)
    before_count = _value(prometheus.query(count))
    # The edge's overhead histogram holds every request of the session's stack (other tests'
    # queued ones included): this test reads what its own requests add.
    overhead = f'inferplane_edge_overhead_seconds_{{}}{{{{model="{MODEL_NAME}"}}}}'
    _poll(
        "a first edge overhead observation",
        lambda: _value(prometheus.query(overhead.format("count"))) >= 1,
    )
    before_overhead_n = _value(prometheus.query(overhead.format("count")))
    before_overhead_sum = _value(prometheus.query(overhead.format("sum")))
    before_queries = _value(
        _poll("the engine's prefix-cache queries", lambda: prometheus.query(queries))
    )

    client_ttfts = []
    for i in range(REQUESTS):
        sent = time.monotonic()
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"What is 2+2? ({i})"}],
            max_tokens=8,
            stream=True,
        )
        first = None
        for chunk in stream:
            # The first token: any delta field besides the role (reasoning, content, tools).
            delta = chunk.choices[0].delta.model_dump(exclude_none=True) if chunk.choices else {}
            if first is None and {k for k, v in delta.items() if v} - {"role"}:
                first = time.monotonic() - sent
        assert first is not None
        client_ttfts.append(first)

    # Every request's record reached telemetry and was scraped...
    _poll(
        f"{REQUESTS} more TTFT observations",
        lambda: _value(prometheus.query(count)) >= before_count + REQUESTS,
    )
    # ... and the quantile over them is bounded by what the client saw: the router measures a
    # part of the client's TTFT, and Prometheus interpolates inside the bucket that holds it.
    p99 = _value(
        _poll(
            "the TTFT p99",
            lambda: [r for r in prometheus.query(TTFT_P99) if not math.isnan(float(r["value"][1]))],
        )
    )
    bound = TTFT_BUCKETS[
        min(bisect.bisect_left(TTFT_BUCKETS, max(client_ttfts)), len(TTFT_BUCKETS) - 1)
    ]
    assert 0 < p99 <= bound, (p99, client_ttfts)
    # The engine saw the prompts: vLLM's own counter, scraped straight from the replica.
    _poll(
        "the engine's prefix-cache queries to grow",
        lambda: _value(prometheus.query(queries)) > before_queries,
    )
    # The edge's own overhead (its access log to telemetry): one sample per request, each a
    # part of that request's TTFT, so their mean is below the largest TTFT the client saw.
    _poll(
        f"{REQUESTS} more edge overhead observations",
        lambda: _value(prometheus.query(overhead.format("count"))) >= before_overhead_n + REQUESTS,
    )
    edge_n = _value(prometheus.query(overhead.format("count"))) - before_overhead_n
    edge_sum = _value(prometheus.query(overhead.format("sum"))) - before_overhead_sum
    edge_mean = edge_sum / edge_n
    assert 0 < edge_mean < max(client_ttfts), (edge_mean, edge_n, client_ttfts)
    kv = prometheus.query(f"vllm:kv_cache_usage_perc{{{engine}}}")
    assert kv and all(0 <= float(r["value"][1]) <= 1 for r in kv)
    # The deploy/ rules load and evaluate against these series.
    with urllib.request.urlopen(f"http://127.0.0.1:{prometheus.port}/api/v1/rules", timeout=5) as r:
        groups = json.loads(r.read())["data"]["groups"]
    assert [r["name"] for g in groups for r in g["rules"] if r.get("health") == "err"] == []
    print(
        f"\nprometheus e2e: TTFT p99 {p99 * 1000:.0f} ms (client max "
        f"{max(client_ttfts) * 1000:.0f} ms) over {REQUESTS} requests; edge overhead mean "
        f"{edge_mean * 1000:.2f} ms; "
        f"{time.monotonic() - started:.1f} s"
    )

"""deploy/prometheus and deploy/grafana against the code, and a real Prometheus scraping an
in-process telemetry service.

The real-Prometheus tests need Debian's `prometheus` package (/usr/bin/prometheus and
/usr/bin/promtool): `apt-get install -y prometheus`. They skip, saying so, without it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from inferplane.runtime.processes.ports import free_port
from inferplane.telemetry.engines import EngineReading, EngineTarget
from inferplane.telemetry_client import SinkMetrics
from inferplane.testing.clock import FakeClock

from .conftest import record, start_harness, stop_harness
from .test_edge_overhead import entry as edge_entry

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_prometheus = pytest.mark.skipif(
    not Path(PROMETHEUS).exists(),
    reason="Debian's prometheus is not installed (apt-get install -y prometheus)",
)
needs_promtool = pytest.mark.skipif(
    not Path(PROMTOOL).exists(),
    reason="promtool is not installed (apt-get install -y prometheus)",
)
VLLM_SERIES = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
}


def _exposed_names(clock: FakeClock) -> set[str]:
    """Every series name the telemetry service and the record sink expose."""
    h = start_harness(clock, engine_targets=("kimi-tiny/kimi-tiny-0=http://127.0.0.1:1/metrics",))
    try:
        h.send(
            record(request_id="a", itl=(0.01,), tool_calls=1, tool_calls_valid=1),
            record(
                request_id="a",
                source="node-agent",
                tool_calls=2,
                tool_calls_valid=1,
                invalid_reasons=("invalid_json",),
                markers_leaked=1,
            ),
        )
        target = EngineTarget("kimi-tiny", "kimi-tiny-0", "http://127.0.0.1:1/metrics")
        for t in (0.0, 10.0):
            h.loop.call(
                h.components.scraper.add_reading,
                target,
                EngineReading(
                    time=clock.time() + t,
                    up=True,
                    kv_cache_usage=0.5,
                    running=1,
                    waiting=0,
                    preemptions=t,
                    prefix_queries=10 + t,
                    prefix_hits=5 + t,
                ),
            )
        h.loop.call(h.components.edge_overhead_metrics.observe, edge_entry())
        text = generate_latest(h.components.registry).decode()
    finally:
        stop_harness(h)
    sink = CollectorRegistry()
    SinkMetrics(sink)
    text += generate_latest(sink).decode()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _names_in(expr: str) -> set[str]:
    return set(
        re.findall(
            r"\b(?:inferplane_[a-z0-9_]+|vllm:[a-z0-9_]+|(?:deployment|model):[a-z0-9_:]+)", expr
        )
    )


def test_dashboard_and_rules_only_use_series_that_exist(clock: FakeClock) -> None:
    """A renamed metric breaks this test, not a dashboard in production."""
    exposed = _exposed_names(clock)
    rules = yaml.safe_load((DEPLOY / "prometheus" / "inferplane.rules.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "inferplane.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    known = exposed | recorded | VLLM_SERIES
    unknown = {n for e in exprs for n in _names_in(e)} - known
    assert not unknown, f"series used in deploy/ but not exposed: {sorted(unknown)}"
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for panel in (
        "Requests/s",
        "TTFT",
        "ITL",
        "tokens/s",
        "KV cache",
        "Preemptions",
        "Prefix-cache hit rate",
        "Tool-call validity",
        "Alerts",
        "Edge overhead",
    ):
        assert panel in titles


@needs_promtool
def test_promtool_accepts_the_config_and_rules() -> None:
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "inferplane.rules.yml"]):
        result = subprocess.run(
            [PROMTOOL, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def _query(port: int, promql: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@needs_prometheus
def test_real_prometheus_reads_back_a_ttft_quantile(clock: FakeClock, tmp_path: Path) -> None:
    """Prometheus scrapes the telemetry service's /metrics (1 s interval, loopback, tmp
    storage) with the deploy/ rules loaded; histogram_quantile over the TTFT buckets comes
    back through the HTTP API as Prometheus's bucket interpolation predicts."""
    h = start_harness(clock, metrics_port=free_port())
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(DEPLOY / "prometheus" / "inferplane.rules.yml")],
                "scrape_configs": [
                    {
                        "job_name": "inferplane",
                        "static_configs": [
                            {
                                "targets": [f"127.0.0.1:{h.settings.metrics_port}"],
                                "labels": {"service": "telemetry"},
                            }
                        ],
                    }
                ],
            }
        )
    )
    # 100 requests with TTFT 0.12 s: all in the (0.1, 0.15] bucket, so Prometheus reports
    # p99 = 0.1 + 0.05 × 0.99 = 0.1495 and p50 = 0.125.
    h.send(*[record(request_id=f"r{i}", ttft=0.12) for i in range(100)])
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    promql = (
        "histogram_quantile({q}, sum by (le) (inferplane_time_to_first_token_seconds_bucket"
        '{{deployment="kimi-tiny"}}))'
    )
    try:
        deadline = time.monotonic() + 60
        result: list[dict[str, Any]] = []
        while not result:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {proc.stderr.read() if proc.stderr else ''}")
            assert time.monotonic() < deadline, "prometheus never scraped the telemetry service"
            with contextlib.suppress(OSError):  # not listening yet
                result = _query(prom_port, promql.format(q=0.99))
            if not result:
                time.sleep(0.5)  # real Prometheus on its real scrape interval
        assert float(result[0]["value"][1]) == pytest.approx(0.1495)
        [p50] = _query(prom_port, promql.format(q=0.5))
        assert float(p50["value"][1]) == pytest.approx(0.125)
        up = _query(prom_port, 'up{service="telemetry"}')
        assert up and up[0]["value"][1] == "1"
        url = f"http://127.0.0.1:{prom_port}/api/v1/rules"
        with urllib.request.urlopen(url, timeout=5) as response:
            groups = json.loads(response.read())["data"]["groups"]
        bad = [r["name"] for g in groups for r in g["rules"] if r.get("health") == "err"]
        assert len(groups) == 2 and not bad
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stop_harness(h)

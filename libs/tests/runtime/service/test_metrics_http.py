"""serve_text_metrics: engine metrics keep vLLM's colon names whatever the scraper offers."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter

from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.service.metrics_http import serve_text_metrics

OPENMETRICS_FIRST = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_a_scraper_offering_openmetrics_still_gets_the_colon_names() -> None:
    """Prometheus offers OpenMetrics first; prometheus_client's own server would answer with
    `vllm_prefix_cache_queries_total` (escaped), this one answers the text format with
    `vllm:prefix_cache_queries_total`, as vLLM's HTTP server does."""
    registry = CollectorRegistry()
    Counter("vllm:prefix_cache_queries", "Prefix cache queries.", registry=registry).inc(3)
    port = free_port()
    server = serve_text_metrics(port, "127.0.0.1", registry)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics", headers={"Accept": OPENMETRICS_FIRST}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read().decode()
            assert response.headers["Content-Type"].startswith("text/plain")
        assert "vllm:prefix_cache_queries_total 3.0" in body
        assert "vllm_prefix_cache_queries" not in body
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5) as missing:
            raise AssertionError(f"expected 404, got {missing.status}")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
    finally:
        server.shutdown()

"""`serve_text_metrics`: a registry on `/metrics` in Prometheus's classic text format only;
`ScrapedMetrics`: another process's endpoint served with a registry's own series.

prometheus_client's own server answers a scraper that offers OpenMetrics (Prometheus does) in
OpenMetrics with `escaping=underscores`, which renames vLLM's `vllm:*` series to `vllm_*`:
dashboards, alerts and the engines' own HTTP servers all use the colon names. vLLM's HTTP
server answers in the text format; the engine metrics that inferplane serves itself (the
replica process with an in-process engine, the launcher of a `--grpc` engine) must too.
"""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class ScrapedMetrics:
    """A collector for another process's Prometheus endpoint (text format): fetched at each
    scrape of the registry it is registered in (in the scraping thread), its series served
    with that registry's. An endpoint that does not answer (a child engine starting or
    restarting) contributes nothing to that scrape.

    Args:
        url: the endpoint (`http://host:port/metrics`).
        timeout_seconds: the fetch's deadline.
    """

    def __init__(self, url: str, timeout_seconds: float = 2.0) -> None:
        self._url = url
        self._timeout = timeout_seconds

    def collect(self) -> Any:
        try:
            with urllib.request.urlopen(self._url, timeout=self._timeout) as response:
                text = response.read().decode("utf-8", "replace")
            return list(text_string_to_metric_families(text))
        except (OSError, ValueError):
            return []


def serve_text_metrics(port: int, host: str, registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Serves `registry` at `http://host:port/metrics` (and `/`) from a daemon thread; returns
    the server (`shutdown()` stops it).

    Raises: OSError when the port cannot be bound.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.partition("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # one line per scrape would drown the replica's log

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server

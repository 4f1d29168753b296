"""`serve_text_metrics`: a registry on `/metrics` in Prometheus's classic text format only.

prometheus_client's own server answers a scraper that offers OpenMetrics (Prometheus does) in
OpenMetrics with `escaping=underscores`, which renames vLLM's `vllm:*` series to `vllm_*`:
dashboards, alerts and the engines' own HTTP servers all use the colon names. vLLM's HTTP
server answers in the text format; the engine metrics that inferplane serves itself (the
replica process with an in-process engine, the launcher of a `--grpc` engine) must too.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


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

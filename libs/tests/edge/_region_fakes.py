"""A fake region edge for the global tier's tests: a small HTTP/1.1 server on loopback that
answers the region's ready route (200 or 503, as the test sets it), echoes which region served
any other request, streams an SSE response on `/v1/stream` until the test releases or kills
it, and can be stopped (connections refused) and started again on the same port."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from inferplane.regions import REGION_READY_PATH
from inferplane.wire.headers import SERVED_REGION

STREAM_PATH = "/v1/stream"


class FakeRegionEdge:
    """One region's edge. `ready` drives the ready route, `busy` answers 503 to the rest;
    `requests` lists every request
    served other than the ready route (`(method, path, headers)`); `stream_started` is set
    once a stream's first event was written."""

    def __init__(self, region: str, port: int) -> None:
        self.region = region
        self.port = port
        self.ready = True
        #: Answer every request but the ready route 503 (a region without capacity).
        self.busy = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.stream_started = threading.Event()
        self.stream_release = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serves on `port` (again, after `stop`)."""
        edge = self
        self.stream_started.clear()
        self.stream_release.clear()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with edge._lock:
                    edge._sockets.add(self.connection)

            def finish(self) -> None:
                with edge._lock:
                    edge._sockets.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def _body(self) -> bytes:
                length = int(self.headers.get("content-length") or 0)
                return self.rfile.read(length) if length else b""

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header(SERVED_REGION, edge.region)
                self.end_headers()
                self.wfile.write(data)

            def _serve(self) -> None:
                self._body()
                if self.path == REGION_READY_PATH:
                    self._answer(200 if edge.ready else 503, {"ready": edge.ready})
                    return
                with edge._lock:
                    edge.requests.append((self.command, self.path, dict(self.headers.items())))
                if edge.busy:
                    self._answer(
                        503, {"error": {"code": "model_overloaded", "region": edge.region}}
                    )
                    return
                if self.path == STREAM_PATH:
                    self._stream()
                    return
                self._answer(200, {"region": edge.region, "path": self.path})

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.send_header(SERVED_REGION, edge.region)
                self.end_headers()
                self._chunk(b'data: {"n": 1}\n\n')
                edge.stream_started.set()
                if edge.stream_release.wait(30):
                    try:
                        self._chunk(b"data: [DONE]\n\n")
                        self.wfile.write(b"0\r\n\r\n")
                    except OSError:
                        pass  # cut by `stop`

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            do_GET = do_POST = _serve

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops listening (new connections are refused) and cuts every open connection
        (a stream in flight ends without its last chunk)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            sockets, self._sockets = set(self._sockets), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.stream_release.set()

    def served(self, path: str) -> int:
        """How many requests to `path` this edge served."""
        with self._lock:
            return sum(1 for _, p, _ in self.requests if p == path)

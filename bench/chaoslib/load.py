"""The load a fault hits: closed loops of streamed requests through the edge, plus a probe."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .streams import COMPLETED, Request, body, client, stream


class Load:
    """One closed loop per entry of `workers` (its API, a key of `streams.API_PATHS`) of
    streamed requests of `max_tokens` (a worker whose request did not complete waits
    `backoff_s` before the next), plus a chat probe (one request of `probe_tokens` at a time,
    `probe_pause_s` apart): every request is kept. `http2`: every request on HTTP/2 (one
    multiplexed connection), else HTTP/1.1 (a connection per stream)."""

    def __init__(
        self,
        base_url: str,
        key: str,
        *,
        workers: Sequence[str],
        max_tokens: int,
        http2: bool = False,
        probe_tokens: int = 8,
        probe_pause_s: float = 0.25,
        backoff_s: float = 1.0,
        read_timeout_s: float = 60.0,
        label: str = "load",
    ) -> None:
        self._url, self._key, self._label = base_url, key, label
        self._max_tokens, self._probe_tokens, self._pause = max_tokens, probe_tokens, probe_pause_s
        self._backoff = backoff_s
        self._workers = list(workers)
        self._http = client(
            http2=http2, read_timeout_s=read_timeout_s, connections=len(self._workers) + 1
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self._current: dict[int, Request] = {}
        self._threads = [
            threading.Thread(target=self._loop, args=(w,), daemon=True)
            for w in range(len(self._workers))
        ]
        self._threads.append(threading.Thread(target=self._probe, daemon=True))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """No new requests; waits for the ones in flight."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._http.close()

    def _run(self, request: Request, salt: str) -> None:
        with self._lock:
            self.requests.append(request)
        payload = body(request.api, request.max_tokens, salt)
        stream(self._http, self._url, self._key, payload, request)

    def _loop(self, worker: int) -> None:
        n = 0
        api = self._workers[worker]
        while not self._stop.is_set():
            request = Request(self._label, self._max_tokens, api=api)
            with self._lock:
                self._current[worker] = request
            self._run(request, f"worker {worker} story {n}")
            n += 1
            if request.outcome != COMPLETED:
                self._stop.wait(self._backoff)  # as a client would, not a hot loop

    def _probe(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._run(Request("probe", self._probe_tokens), f"p{n}")
            n += 1
            self._stop.wait(self._pause)

    def all_mid_stream(self, min_tokens: int, min_left: int) -> bool:
        """Every worker's request in flight has streamed at least `min_tokens` token events
        and has at least `min_left` tokens to go (events may carry several tokens, so fewer
        events only means more to go)."""
        with self._lock:
            current = list(self._current.values())
        return len(current) == len(self._workers) and all(
            not r.ended_at and min_tokens <= r.tokens <= r.max_tokens - min_left for r in current
        )

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def recovered_at(self, since: float) -> float | None:
        """When the first probe started at or after `since` completed, or None."""
        done = [
            r.ended_at
            for r in self.snapshot()
            if r.client == "probe"
            and r.started_at >= since
            and r.ended_at
            and r.outcome == COMPLETED
        ]
        return min(done) if done else None

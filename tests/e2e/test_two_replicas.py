"""Two kimi-tiny replicas behind the edge: routing, admission, failover and per-key limits.

Its own stack (module scope, not the session's): two vLLM CPU replicas of a `prefix_affinity`
deployment with a small concurrency cap (`MAX_NUM_SEQS` per replica) and a short admission
queue timeout in the router, and the per-key rate windows (the picker's, and auth's)
shortened to `RATE_WINDOW_S` so a token limit visibly resets. Requests go through Envoy with
the official `openai` client (or raw httpx where the SSE bytes matter). Invariants (issue 6,
"Tests"):

- prefix affinity keeps a multi-turn conversation on one replica, whose engine's prefix-cache
  hits grow turn after turn (the serving replica is read from each engine's own Prometheus
  counters: exactly one engine's `vllm:request_success_total` moves per request);
- load at twice the deployment's capacity gets 429s with Retry-After, never a 5xx;
- a key over its token limit is refused (429 with `x-ratelimit-*-tokens`) until its window
  resets, then served again;
- killing one replica's engine under streaming load fails no request that had not started
  streaming (Envoy retries it down the pick on the other replica), and the streams in flight
  on the killed replica move to the other one (mid-stream migration, issue 31): each ends
  with its finish reason and `[DONE]`, never an error event or a silent truncation, and its
  text is exactly the tokens the killed engine generated followed by those the sibling
  generated (both replicas log them by token id).

The kill test runs last: the killed replica is being restarted when the module ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack, running_stack
from inferplane.replica.testing.pipeline import kimi_tiny_assets

from .conftest import engine_core_pid, local_config

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(1800)]

REPLICAS = 2
MAX_NUM_SEQS = 4  # per replica: the router admits at most 8 requests at once
QUEUE_TIMEOUT_S = 1.0
RATE_WINDOW_S = 10
AFTER_KILL = 9  # requests that start after the kill, all of which must succeed
KILL_TOKENS = 250  # per stream of the kill test (ignore_eos: every one is generated)
TOOLS = ("get_weather", "get_time", "web_search")  # declared first: a long shared prefix

T = TypeVar("T")


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("two-replicas")
    # A private copy: the engines must not see the fixture model change under them.
    model = data_dir / "kimi-tiny"
    shutil.copytree(kimi_tiny.model_path(), model)
    config = local_config(
        data_dir,
        model_path=model,
        # Two engines start side by side on two shared cores.
        startup_timeout_seconds=900,
        warmup_timeout_seconds=300,
        # vLLM's CPU auto-binding pins every engine to core 0.
        engine_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        transport=os.environ.get("INFERPLANE_E2E_TRANSPORT", "http-completions"),
        replicas=REPLICAS,
        routing_policy="prefix_affinity",
        max_num_seqs=MAX_NUM_SEQS,
        service_args={
            "router": (
                "--queue-timeout-seconds",
                str(QUEUE_TIMEOUT_S),
                # The picker enforces the keys' limits (auth's window: its ext_authz routes).
                "--key-limit-window-seconds",
                str(RATE_WINDOW_S),
            ),
            "auth": ("--rate-window-seconds", str(RATE_WINDOW_S)),
        },
    )
    with running_stack(config, print) as stack:
        yield stack


@pytest.fixture(scope="module")
def key(two_replicas: Stack) -> str:
    return two_replicas.create_api_key("two-replicas")


@pytest.fixture(scope="module")
def client(two_replicas: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=two_replicas.config.base_url, api_key=key, max_retries=0, timeout=120
    )


# -- engine metrics ----------------------------------------------------------------------------


def _metrics(url: str) -> dict[str, float]:
    """Sums of the engine's Prometheus samples by metric name (labels folded)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _replicas(stack: Stack) -> dict[str, str]:
    """Serving replica id → its engine's metrics URL."""
    return {
        e.replica_id: stack.replica(e.replica_id).metrics_url for e in stack.serving_endpoints()
    }


def _poll(what: str, seconds: float, read: Callable[[], T | None]) -> T:
    """`read()` until it returns something other than None; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _done(metrics: dict[str, float]) -> float:
    return metrics.get("vllm:request_success_total", 0.0)


def _hits(metrics: dict[str, float]) -> float:
    return metrics.get("vllm:prefix_cache_hits_total", 0.0)


# -- prefix affinity ---------------------------------------------------------------------------


def _snapshot(replicas: dict[str, str]) -> dict[str, dict[str, float]]:
    return {rid: _metrics(url) for rid, url in replicas.items()}


def _running(replicas: dict[str, str]) -> dict[str, float]:
    return {
        rid: _metrics(url).get("vllm:num_requests_running", 0.0) for rid, url in replicas.items()
    }


def test_prefix_affinity_keeps_a_conversation_on_one_replica_with_growing_cache_hits(
    two_replicas: Stack, client: openai.OpenAI
) -> None:
    """From the second turn on, a long request of the same conversation is streaming on the
    conversation's replica while the turn is sent: a load-only policy would now pick the idle
    replica, prefix affinity keeps the turn where its prefix is cached (the bounded-load cap,
    ceil(1.25 * 2 / 2) = 2 requests, is not reached)."""
    replicas = _replicas(two_replicas)
    assert len(replicas) == REPLICAS
    tools: list[Any] = kimi_tiny.tools(*TOOLS)
    messages: list[dict[str, object]] = [dict(m) for m in kimi_tiny.NO_TOOL.messages]
    served: list[str] = []
    turn_hits: list[float] = []
    for turn in range(4):
        background: openai.Stream[Any] | None = None
        if served:
            # The conversation so far with another question: it shares the turn's prefix.
            story: list[Any] = [*messages[:-1], {"role": "user", "content": "Tell a long story."}]
            background = client.chat.completions.create(
                model=MODEL_NAME,
                messages=story,
                tools=tools,
                max_tokens=1500,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i, _chunk in enumerate(background):
                if i == 5:  # well past its prefill: its cache hits are counted
                    break
            busy = _poll(
                "the background stream on an engine",
                5,
                lambda: r if sum((r := _running(replicas)).values()) >= 1 else None,
            )
            assert busy[served[0]] == 1 and sum(busy.values()) == 1, busy
        before = _snapshot(replicas)
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            tools=tools,
            max_tokens=16,
            temperature=0,
        )

        def finished(
            start: dict[str, dict[str, float]] = before,
        ) -> dict[str, dict[str, float]] | None:
            now = _snapshot(replicas)
            return now if sum(_done(now[r]) - _done(start[r]) for r in replicas) >= 1 else None

        after = _poll(f"turn {turn + 1}'s engine counters", 10, finished)
        (replica,) = [r for r in replicas if _done(after[r]) > _done(before[r])]
        served.append(replica)
        turn_hits.append(_hits(after[replica]) - _hits(before[replica]))
        if background is not None:
            background.close()  # the engine aborts it
            _poll(
                "idle engines", 10, lambda: True if not any(_running(replicas).values()) else None
            )
        messages += [
            {"role": "assistant", "content": response.choices[0].message.content or "ok"},
            {"role": "user", "content": f"Tell me more, part {turn + 2}."},
        ]
    print(f"\nconversation served by {served}; prefix-cache hits per turn (tokens) {turn_hits}")
    assert len(set(served)) == 1, f"the conversation moved between replicas: {served}"
    # Every turn after the first reuses the KV blocks of the conversation's earlier requests.
    assert all(hits > 0 for hits in turn_hits[1:]), turn_hits


# -- per-key token limit -----------------------------------------------------------------------


def _tiny(client: openai.OpenAI) -> Any:
    """One short chat through the edge; the raw HTTP response (openai's httpx: status, headers)."""
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=24,
            extra_body={"ignore_eos": True},
        )
        return raw.http_response
    except openai.APIStatusError as exc:
        return exc.response


def _seconds(reset: str) -> float:
    """OpenAI's reset duration (`1s`, `6m0s`, `250ms`) in seconds."""
    if reset.endswith("ms"):
        return float(reset[:-2]) / 1000
    minutes, _, secs = reset.rstrip("s").rpartition("m")
    return float(minutes or 0) * 60 + float(secs)


def test_a_key_over_its_token_limit_is_refused_until_its_window_resets(
    two_replicas: Stack,
) -> None:
    limit = 40  # one request's prompt + 24 completion tokens exceed it
    secret = two_replicas.create_api_key(
        "token-limited", limits=auth_pb2.Limits(tokens_per_minute=limit)
    )
    client = openai.OpenAI(
        base_url=two_replicas.config.base_url, api_key=secret, max_retries=0, timeout=60
    )
    first = _tiny(client)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == str(limit)
    # The picker counts the request's tokens when it concludes (its trailers or the replica's
    # report): the next requests are refused once they are counted.
    refused = _poll(
        "a 429 once the usage is accounted",
        RATE_WINDOW_S,
        lambda: r if (r := _tiny(client)).status_code == 429 else None,
    )
    refused_at = time.monotonic()
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded", error
    assert "tokens" in error["message"].lower(), error
    assert refused.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    reset_s = _seconds(refused.headers["x-ratelimit-reset-tokens"])
    assert 0 < reset_s <= RATE_WINDOW_S
    assert int(refused.headers["retry-after"]) >= 1

    statuses: list[int] = []
    while True:
        response = _tiny(client)
        statuses.append(response.status_code)
        if response.status_code != 429:
            break
        # Usage reported just after a window ends counts in the next one: at most two windows.
        assert time.monotonic() - refused_at < 2 * RATE_WINDOW_S + 5, "the window never reset"
        time.sleep(0.25)
    waited = time.monotonic() - refused_at
    print(f"\ntoken limit: refused for {waited:.1f} s (reset said {reset_s:.1f} s), {statuses}")
    assert statuses[-1] == 200, statuses
    # `x-ratelimit-reset-tokens` rounds up to whole seconds above one second.
    assert waited >= reset_s - 1.0, f"served again after {waited:.1f} s of a {reset_s} s reset"


# -- overload ----------------------------------------------------------------------------------


@dataclass
class StreamResult:
    """What one raw SSE request through the edge got."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    error: str = ""  # a transport error (connection reset, timeout)
    body: str = ""  # a non-200 body
    started_at: float = 0.0  # monotonic time of the request
    first_event_at: float | None = None
    ended_at: float = 0.0

    @property
    def chunks(self) -> list[dict[str, object]]:
        return [json.loads(e[6:]) for e in self.events if e != "data: [DONE]"]

    @property
    def error_event(self) -> dict[str, object] | None:
        return next((c for c in self.chunks if "error" in c), None)

    @property
    def complete(self) -> bool:
        finished = any(
            choice.get("finish_reason")
            for c in self.chunks
            for choice in c.get("choices", [])  # type: ignore[attr-defined]
        )
        return (
            self.status == 200
            and finished
            and self.error_event is None
            and self.events[-1:] == ["data: [DONE]"]
        )


def _stream(
    http: httpx.Client,
    url: str,
    key: str,
    prompt: str,
    max_tokens: int,
    result: StreamResult | None = None,
) -> StreamResult:
    """One streamed completion; fills `result` (a fresh one by default) as events arrive, so
    another thread can watch a stream in flight."""
    result = result or StreamResult()
    result.started_at = time.monotonic()
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with http.stream(
            "POST",
            f"{url}/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as response:
            result.status = response.status_code
            result.headers = dict(response.headers)
            if response.status_code != 200:
                result.body = response.read().decode(errors="replace")[:500]
                return result
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if result.first_event_at is None:
                        result.first_event_at = time.monotonic()
                    result.events.append(line)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended_at = time.monotonic()
    return result


def test_twice_the_capacity_gets_429_with_retry_after_and_no_5xx(
    two_replicas: Stack, key: str
) -> None:
    capacity = REPLICAS * MAX_NUM_SEQS
    url = two_replicas.config.base_url
    barrier = threading.Barrier(2 * capacity)

    def one(i: int) -> StreamResult:
        barrier.wait(30)
        # ~256 tokens each: far longer than the queue timeout on these engines.
        return _stream(http, url, key, f"Story {i}: once upon a time", 256)

    with (
        httpx.Client(timeout=300, limits=httpx.Limits(max_connections=2 * capacity)) as http,
        futures.ThreadPoolExecutor(2 * capacity) as pool,
    ):
        results = list(pool.map(one, range(2 * capacity)))
    statuses = sorted(r.status for r in results)
    print(f"\n{2 * capacity} streams at capacity {capacity}: statuses {statuses}")
    assert all(not r.error for r in results), [r.error for r in results if r.error]
    assert all(r.status in (200, 429) for r in results), [
        (r.status, r.body) for r in results if r.status not in (200, 429)
    ]
    overloaded = [r for r in results if r.status == 429]
    served = [r for r in results if r.status == 200]
    assert overloaded, "twice the capacity was admitted"
    assert len(served) >= capacity // 2, statuses
    for r in overloaded:
        assert int(r.headers["retry-after"]) >= 1, r.headers
        assert json.loads(r.body)["error"]["code"], r.body
        # Refused by the queue timeout (or a full queue), not after a long wait.
        assert r.ended_at - r.started_at < QUEUE_TIMEOUT_S + 10
    for r in served:
        assert r.complete, (r.events[-2:], r.error)


# -- failover ----------------------------------------------------------------------------------


class StreamingLoad:
    """`workers` closed loops of streamed completions through the edge, all kept."""

    def __init__(self, url: str, key: str, workers: int, max_tokens: int) -> None:
        self._url, self._key, self._max_tokens = url, key, max_tokens
        self._http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=workers))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.results: list[StreamResult] = []
        self._current: dict[int, StreamResult] = {}  # worker → its request in flight
        self._threads = [
            threading.Thread(target=self._loop, args=(w,), daemon=True) for w in range(workers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            result = StreamResult()
            with self._lock:
                self._current[worker] = result
            # Distinct prompts: conversations spread over both replicas.
            _stream(
                self._http,
                self._url,
                self._key,
                f"Worker {worker} story {n}:",
                self._max_tokens,
                result,
            )
            n += 1
            with self._lock:
                self.results.append(result)

    def all_mid_stream(self, tokens_left: int) -> bool:
        """Every worker's request in flight has streamed events and has at least
        `tokens_left` tokens to go (the node-agent may merge tokens into one event, so fewer
        events than tokens only means more to go): none is waiting for its first token and
        none is about to end."""
        with self._lock:
            current = list(self._current.values())
        return len(current) == len(self._threads) and all(
            r.first_event_at is not None and 2 <= len(r.events) <= self._max_tokens - tokens_left
            for r in current
        )

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        self._http.close()


def _migrations(data_dir: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Streams that moved (request id → the token ids the killed engine generated, those the
    sibling generated), from the replicas' logs: the origin's `stream_migrated` and the
    sibling's `continuation_ended`."""
    before: dict[str, list[int]] = {}
    after: dict[str, list[int]] = {}
    for log in data_dir.rglob("replica.log"):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry.get("event") == "stream_migrated":
                before[entry["request_id"]] = list(entry["generated_ids"])
            elif entry.get("event") == "continuation_ended":
                after[entry["request_id"]] = list(entry["continued_ids"])
    return {rid: (ids, after.get(rid, [])) for rid, ids in before.items()}


def test_killing_a_replica_under_streaming_load_fails_no_request_that_had_not_started(
    two_replicas: Stack, key: str
) -> None:
    replicas = _replicas(two_replicas)
    assert len(replicas) == REPLICAS
    router_metrics = f"http://127.0.0.1:{two_replicas.config.metrics_ports['router']}/metrics"
    fallbacks_metric = "inferplane_router_fallbacks_served_total"
    fallbacks_before = _metrics(router_metrics).get(fallbacks_metric, 0.0)
    # Three streams at a time fit the surviving replica's cap (MAX_NUM_SEQS) without queueing
    # into 429s; ~250 tokens each keep streams in flight when the engine dies (with 100, a
    # loaded machine sometimes finished them between the metrics poll and the kill).
    load = StreamingLoad(two_replicas.config.base_url, key, workers=3, max_tokens=KILL_TOKENS)
    # Engine core pids first: the kill then follows the observation of running streams at once.
    pids = {rid: engine_core_pid(two_replicas.replica(rid).engine_pid) for rid in replicas}
    load.start()
    try:
        _poll("some finished requests", 120, lambda: True if load.count() >= 3 else None)

        def busiest() -> str | None:
            # Only while every request of the load is streaming, with enough tokens left to
            # outlast the metrics scrape: the victim's running requests are then streams that
            # have started (not one that arrived just before the kill, which the router
            # would retry elsewhere, leaving no stream to end with an error event).
            if not load.all_mid_stream(tokens_left=100):
                return None
            running = {
                rid: _metrics(url).get("vllm:num_requests_running", 0.0)
                for rid, url in replicas.items()
            }
            rid = max(running, key=lambda r: running[r])
            return rid if running[rid] >= 1 and load.all_mid_stream(tokens_left=50) else None

        victim = _poll("an engine with streams in flight", 60, busiest)
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        done_at_kill = load.count()
        # Keep the load on long enough for many requests to start after the kill.
        _poll(
            "requests after the kill",
            180,
            lambda: True if load.count() >= done_at_kill + AFTER_KILL + 3 else None,
        )
    finally:
        load.stop()
    results = load.results

    def before_streaming(r: StreamResult) -> bool:
        return r.first_event_at is None

    failed = [r for r in results if before_streaming(r)]
    ended_by_error = [r for r in results if not before_streaming(r) and r.error_event]
    truncated = [
        r for r in results if not before_streaming(r) and not r.error_event and not r.complete
    ]
    after_kill = [r for r in results if r.started_at > killed_at]
    fallbacks = _metrics(router_metrics).get(fallbacks_metric, 0.0) - fallbacks_before
    moved = _migrations(two_replicas.config.data_dir)
    print(
        f"\nkilled {victim}: {len(results)} requests, {len(after_kill)} started after the kill; "
        f"failed before streaming {len(failed)}, ended by an error event {len(ended_by_error)}, "
        f"truncated {len(truncated)}; served by a fallback of the pick {fallbacks:.0f}; "
        f"moved to the sibling {len(moved)}"
    )
    assert failed == [], [(r.status, r.body, r.error) for r in failed[:5]]
    assert truncated == [], [(r.events[-2:], r.error) for r in truncated[:5]]
    # The streams in flight on the killed engine moved to the other replica and ended there
    # like any other: finish reason, [DONE], no error event.
    assert ended_by_error == [], [r.error_event for r in ended_by_error]
    assert moved, "no stream was in flight on the killed replica"
    by_id = {str(r.chunks[0].get("id")): r for r in results if r.chunks}
    backend = kimi_tiny_assets().backend
    for request_id, (before, after) in moved.items():
        r = by_id[request_id]
        assert r.complete and r.first_event_at is not None and r.first_event_at < killed_at
        # No token repeated or lost: the killed engine's tokens, then the sibling's, all of
        # max_tokens (ignore_eos), and the client's text is exactly their decoding.
        assert len(before) + len(after) == KILL_TOKENS, (len(before), len(after))
        text = "".join(
            str(c.get("text") or "")
            for chunk in r.chunks
            for c in chunk["choices"]  # type: ignore[attr-defined]
        )
        assert text == backend.decode([*before, *after], skip_special_tokens=False), request_id
    assert len(after_kill) >= AFTER_KILL and all(r.complete for r in after_kill), [
        (r.status, r.events[-2:]) for r in after_kill if not r.complete
    ]

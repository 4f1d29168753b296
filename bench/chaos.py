"""Faults under load (issue 18, "the chaos suite"): one fault at a time, with recovery in
between, under a streaming load through the edge of the whole local stack.

    .venv/bin/python bench/chaos.py [--quick] [--faults router,auth,...] [--workers 4]
                                    [--max-tokens 300] [--database postgresql|sqlite]
                                    [--transport inproc] [--keep]

Starts the local stack (`inferplane.localstack.Stack`: Envoy, auth, router, orchestrator,
telemetry, one node-agent and ONE kimi-tiny replica on the CPU engine: Envoy has nowhere else to
retry a request) with auth logging at debug level, then for each fault: a load of `--workers`
closed loops of streamed chat completions (`--max-tokens` each, `ignore_eos`, raw SSE read with
httpx) plus a probe (one short streamed request at a time, back to back), the fault once every
load stream is mid-way, recovery, a few more seconds of load, the load's end (streams in flight
finish) and the usage reports' settling.

Faults (`--faults`, table order; `--quick` without `--faults`: the four service kills that
restart no engine, with shorter phases):

    engine-core      SIGKILL of the replica's vLLM engine core (`VLLM::EngineCore`)
    replica          SIGKILL of the replica process
    node-agent       SIGKILL of the node-agent
    router           SIGKILL of the router
    auth             SIGKILL of auth
    orchestrator     SIGKILL of the orchestrator
    telemetry        SIGKILL of telemetry
    node-agent-term  SIGTERM of the node-agent while streams longer than its replica processes'
                     drain grace (`replica_drain_grace_seconds`, 5 s) run
    database         PostgreSQL (auth's and the orchestrator's database) stopped at once
                     (`pg_ctl -m immediate`) and started again 10 s later

`inferplane up` restarts no component, so the bench does what a process supervisor (systemd's
`Restart=always`, a pod's restart policy) would: a killed service starts again at once, same
argv; the node-agent restarts replica processes and the orchestrator places replicas, as in
production. The database fault needs PostgreSQL (`scripts/postgres.sh`; installed when
missing): a SQLite file cannot go away from the connections that hold it open (an unreadable
or renamed file keeps serving them), so the whole bench runs auth and the orchestrator on
PostgreSQL when that fault is selected (`--database`).

Each request ends as exactly one of:
- completed: HTTP 200, a finish_reason, `data: [DONE]` last, no error event;
- failed before the first token: no generated token and an explicit refusal: an HTTP error
  status (its OpenAI error code is shown), an SSE error event, or no response at all
  (a connection error before any status, shown as `conn`);
- ended by an error event: generated tokens, then `data: {"error": ...}`;
- cut silently: an HTTP 200 stream that ended with neither `data: [DONE]` nor an error event,
  cleanly or by a connection reset (goal 0).
Envoy's retries are its `upstream_rq_retry` counter of the replicas cluster over the phase.

Usage: auth logs every request it accounts (`usage_accounted`, with the edge's request id, at
debug level) and every response carries that id (`x-request-id`, the id the router reports).
Once the reports settle, a request a replica served (HTTP 200) that auth never accounted is
lost; a request id accounted twice is doubled (goal 0 for both). Requests refused before the
router (auth or the picker down) have no usage to account.

Recovery: from the fault until a probe request started after it completes.

Last lines: `doubled_usage_records: D`, `silent_truncations: N` (goal 0) and
`lost_usage_records: M` (goal 0).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.auth.v1 import auth_pb2
from inferplane.edge import REPLICAS_CLUSTER
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack, StackConfig
from inferplane.node_agent.supervisor.process import tree_pids
from inferplane.runtime.processes.ports import free_port, free_port_run
from inferplane.runtime.security.identity import PeerSecurity

REPO = Path(__file__).resolve().parents[1]
Log = Callable[[str], None]

DATABASE_AWAY_S = 10.0


# -- one request -------------------------------------------------------------------------------


COMPLETED = "completed"
FAILED_BEFORE_FIRST_TOKEN = "failed_before_first_token"
ENDED_BY_ERROR_EVENT = "ended_by_error_event"
CUT_SILENTLY = "cut_silently"


@dataclasses.dataclass
class Request:
    """What one streamed chat completion through the edge got (filled while it streams)."""

    client: str  # "load" or "probe"
    max_tokens: int
    started_at: float = 0.0  # monotonic
    status: int = 0  # HTTP status; 0 = no response
    request_id: str = ""  # the edge's x-request-id
    tokens: int = 0  # events that carried generated text (reasoning, content or tool calls)
    first_token_at: float | None = None
    finish_reason: str = ""
    error: dict[str, Any] | None = None  # the SSE error event's `error`, or the error body's
    done: bool = False  # `data: [DONE]` was the last event
    transport_error: str = ""
    ended_at: float = 0.0
    last_events: list[str] = dataclasses.field(default_factory=list)

    @property
    def outcome(self) -> str:
        """COMPLETED, FAILED_BEFORE_FIRST_TOKEN, ENDED_BY_ERROR_EVENT or CUT_SILENTLY (module
        docstring)."""
        if (
            self.status == 200
            and self.done
            and self.finish_reason
            and self.error is None
            and not self.transport_error
        ):
            return COMPLETED
        if self.tokens == 0 and (self.status != 200 or self.error is not None):
            return FAILED_BEFORE_FIRST_TOKEN
        if self.error is not None and self.status == 200:
            return ENDED_BY_ERROR_EVENT
        return CUT_SILENTLY

    @property
    def error_code(self) -> str:
        """The OpenAI error code a refusal carried, else its status (`conn`: no response)."""
        if self.error is not None:
            code = str(self.error.get("code") or self.error.get("type") or "error")
            # The edge shapes an auth outage and an unusable upstream alike; tell them apart.
            if "authentication" in str(self.error.get("message", "")):
                code += " (auth)"
            return code
        return str(self.status) if self.status else "conn"

    def describe(self, origin: float = 0.0) -> str:
        """One line for a report; times in seconds from `origin` (e.g. the fault)."""
        ended = f"{self.ended_at - origin:+.1f}" if self.ended_at else "-"
        return (
            f"{self.client} {self.request_id or '-'} ({self.started_at - origin:+.1f} s → "
            f"{ended} s): status {self.status}, {self.tokens} "
            f"token events, finish_reason {self.finish_reason or '-'}, done {self.done}, "
            f"error {self.error}, transport {self.transport_error or '-'}, "
            f"last events {self.last_events}"
        )


def chat_body(max_tokens: int, salt: str) -> dict[str, Any]:
    """A streamed chat completion of exactly `max_tokens` tokens (`ignore_eos`); `salt` makes
    prompts differ (no shared prefix-cache blocks between clients)."""
    messages = [dict(m) for m in kimi_tiny.NO_TOOL.messages]
    messages[-1]["content"] = f"{messages[-1]['content']} ({salt})"
    return {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def stream_chat(
    http: httpx.Client, base_url: str, key: str, body: dict[str, Any], request: Request
) -> Request:
    """Sends `body` to `/chat/completions` and fills `request` as the SSE events arrive."""
    request.started_at = time.monotonic()
    try:
        with http.stream(
            "POST",
            f"{base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as response:
            request.status = response.status_code
            request.request_id = response.headers.get("x-request-id", "")
            if response.status_code != 200:
                text = response.read().decode(errors="replace")
                with contextlib.suppress(ValueError, AttributeError):
                    request.error = dict(json.loads(text)["error"])
                if request.error is None:
                    request.error = {"code": f"http_{response.status_code}", "body": text[:200]}
                return request
            for line in response.iter_lines():
                if line.startswith("data: "):
                    _on_event(request, line[6:])
    except httpx.HTTPError as exc:
        request.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        request.ended_at = time.monotonic()
    return request


def _on_event(request: Request, data: str) -> None:
    request.last_events = [*request.last_events[-2:], data[-120:]]
    if data == "[DONE]":
        request.done = True
        return
    request.done = False  # anything after [DONE] breaks the stream's contract
    try:
        chunk = json.loads(data)
    except ValueError:
        return
    if "error" in chunk:
        request.error = dict(chunk["error"]) if isinstance(chunk["error"], dict) else {}
        return
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            request.tokens += 1
            if request.first_token_at is None:
                request.first_token_at = time.monotonic()
        if choice.get("finish_reason"):
            request.finish_reason = str(choice["finish_reason"])


# -- the load ----------------------------------------------------------------------------------


class Load:
    """`workers` closed loops of streamed chat completions of `max_tokens` (a worker whose
    request did not complete waits `backoff_s` before the next), plus a probe (one request of
    `probe_tokens` at a time, `probe_pause_s` apart): every request is kept."""

    def __init__(
        self,
        base_url: str,
        key: str,
        *,
        workers: int,
        max_tokens: int,
        probe_tokens: int = 8,
        probe_pause_s: float = 0.25,
        backoff_s: float = 1.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        self._url, self._key = base_url, key
        self._max_tokens, self._probe_tokens, self._pause = max_tokens, probe_tokens, probe_pause_s
        self._backoff = backoff_s
        self._http = httpx.Client(
            timeout=httpx.Timeout(read_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=workers + 1),
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self._current: dict[int, Request] = {}
        self._threads = [
            threading.Thread(target=self._loop, args=(w,), daemon=True) for w in range(workers)
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

    def _run(self, request: Request, body: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(request)
        stream_chat(self._http, self._url, self._key, body, request)

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            request = Request("load", self._max_tokens)
            with self._lock:
                self._current[worker] = request
            self._run(request, chat_body(self._max_tokens, f"worker {worker} story {n}"))
            n += 1
            if request.outcome != COMPLETED:
                self._stop.wait(self._backoff)  # as a client would, not a hot loop

    def _probe(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._run(Request("probe", self._probe_tokens), chat_body(self._probe_tokens, f"p{n}"))
            n += 1
            self._stop.wait(self._pause)

    def all_mid_stream(self, min_tokens: int, min_left: int) -> bool:
        """Every worker's request in flight has streamed at least `min_tokens` token events
        and has at least `min_left` tokens to go (events may carry several tokens, so fewer
        events only means more to go)."""
        with self._lock:
            current = list(self._current.values())
        return len(current) == len(self._threads) - 1 and all(
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


# -- what auth accounted -----------------------------------------------------------------------


_ACCOUNTED = re.compile(r"usage_accounted\b.*?request_id[\"'=:\s]+([0-9A-Za-z_.:-]+)")
_REPLACED = re.compile(r"replaced[\"'=:\s]+(?:True|true)\b")


class UsageLedger:
    """Request ids auth accounted, read from its log (every instance's lines: a restarted
    auth appends to the same file), by the `usage_accounted` debug line."""

    def __init__(self, log_path: Path) -> None:
        self._path = log_path

    def counts(self) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()
        with contextlib.suppress(OSError), self._path.open(errors="replace") as log:
            for line in log:
                if "usage_accounted" not in line or _REPLACED.search(line):
                    continue  # a provisional row replaced by the late report: not a copy
                if match := _ACCOUNTED.search(line):
                    counts[match.group(1)] += 1
        return counts


def settle_usage(
    ledger: UsageLedger, requests: Sequence[Request], timeout_s: float
) -> collections.Counter[str]:
    """Waits until auth accounted every served request (or `timeout_s`); returns the counts."""
    served = {r.request_id for r in requests if r.status == 200 and r.request_id}
    deadline = time.monotonic() + timeout_s
    while True:
        counts = ledger.counts()
        if served <= set(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


# -- the stack's processes ---------------------------------------------------------------------


def engine_core_pid(replica_pid: int, timeout_s: float = 10.0) -> int:
    """The pid of vLLM's engine core (`VLLM::EngineCore`) below a replica process.

    Raises: RuntimeError when none shows up within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in tree_pids(replica_pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                    return pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"no engine core below replica process {replica_pid}")
        time.sleep(0.1)


def wait_healthy(security: PeerSecurity, address: str, timeout_s: float) -> bool:
    """Whether the gRPC health service at `address` answered SERVING within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            time.sleep(0.1)
    return False


def restart_service(stack: Stack, name: str, log: Log, exit_timeout_s: float = 60.0) -> None:
    """Waits for service `name` to exit (SIGKILL it after `exit_timeout_s`), then starts it
    again with the same argv and log: a supervisor's restart. Call from a long-lived thread
    (the child's parent-death signal follows the starting thread)."""
    proc = stack.processes[name]
    assert proc.proc is not None
    try:
        proc.proc.wait(exit_timeout_s)
    except subprocess.TimeoutExpired:
        log(f"  {name} still runs {exit_timeout_s:.0f} s after the signal: SIGKILL")
        proc.proc.kill()
        proc.proc.wait(10)
    exited, code = time.monotonic(), proc.proc.returncode
    proc.start()
    healthy = wait_healthy(stack.config.security, stack.config.address(name), 60)
    state = "healthy" if healthy else "NOT healthy after 60 s"
    log(f"  {name} exited ({code}), restarted: {state} {time.monotonic() - exited:.1f} s later")


def envoy_retries(stack: Stack) -> int:
    """Envoy's `upstream_rq_retry` counter of the replicas cluster (0 when unreadable)."""
    if stack.edge is None:
        return 0
    name = f"cluster.{REPLICAS_CLUSTER}.upstream_rq_retry"
    with contextlib.suppress(httpx.HTTPError, ValueError):
        text = httpx.get(f"{stack.edge.admin_url}/stats?filter=^{name}$", timeout=5).text
        for line in text.splitlines():
            stat, _, value = line.partition(": ")
            if stat == name:
                return int(value)
    return 0


# -- PostgreSQL, the database that goes away ---------------------------------------------------


class Postgres:
    """A throw-away PostgreSQL (`scripts/postgres.sh`) that can be stopped and started again
    on its port: the database that goes away."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url = ""
        self._bin = ""
        self._port = 0

    def start(self) -> None:
        """Raises: RuntimeError when the script fails (no PostgreSQL and no way to install)."""
        self.directory.parent.chmod(0o755)
        done = subprocess.run(
            [str(REPO / "scripts" / "postgres.sh"), "start", str(self.directory)],
            capture_output=True,
            text=True,
            check=False,
        )
        match = re.search(r"INFERPLANE_TEST_POSTGRES_URL=(\S+)", done.stdout)
        if done.returncode != 0 or match is None:
            raise RuntimeError(f"scripts/postgres.sh start failed: {done.stderr.strip()[-500:]}")
        self.url = match.group(1)
        self._port = int(re.search(r":(\d+)/", self.url).group(1))  # type: ignore[union-attr]
        self._bin = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version)[-1].as_posix()

    def database(self, name: str) -> str:
        """Creates database `name`; returns its URL."""
        from sqlalchemy import create_engine

        engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        finally:
            engine.dispose()
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def _pg_ctl(self, *args: str) -> None:
        command = " ".join([f"{self._bin}/pg_ctl", "-D", f"'{self.directory}/data'", *args])
        subprocess.run(["su", "postgres", "-c", command], check=True, capture_output=True)

    def stop_now(self) -> None:
        """Stops the server at once (`-m immediate`: every connection drops, as in a crash)."""
        self._pg_ctl("-m", "immediate", "-w", "stop")

    def start_again(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self._port} -k '{self.directory}' -c fsync=off"
        )
        self._pg_ctl("-l", f"'{self.directory}/pg.log'", "-w", "-o", f'"{options}"', "start")

    def close(self) -> None:
        subprocess.run(
            [str(REPO / "scripts" / "postgres.sh"), "stop", str(self.directory)],
            capture_output=True,
            check=False,
        )


def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", path.parent.name))


# -- faults ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What a fault acts on."""

    stack: Stack
    log: Log
    postgres: Postgres | None = None


# A fault's preparation (run before the load is at its steady point: lookups take time)
# returns its trigger; the trigger injects the fault and returns its monotonic time, then its
# follow-up (a supervisor's restart, the database's return) runs while the load goes on.
Trigger = Callable[[], float]
FollowUp = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: `prepare(ctx)` → (trigger, follow-up)."""

    name: str
    what: str
    prepare: Callable[[Context], tuple[Trigger, FollowUp]]
    long_streams: bool = False  # streams must outlast a drain grace
    recovery_timeout_s: float = 90.0
    needs_postgres: bool = False


def _signal(pid: int, sig: int) -> Trigger:
    def fire() -> float:
        os.kill(pid, sig)
        return time.monotonic()

    return fire


def _nothing() -> None:
    return None


def _kill_engine_core(ctx: Context) -> tuple[Trigger, FollowUp]:
    replica = ctx.stack.serving_replica()
    return _signal(engine_core_pid(replica.engine_pid), signal.SIGKILL), _nothing


def _kill_replica(ctx: Context) -> tuple[Trigger, FollowUp]:
    replica = ctx.stack.serving_replica()
    return _signal(replica.engine_pid, signal.SIGKILL), _nothing


def _service(name: str, sig: int = signal.SIGKILL) -> Callable[[Context], tuple[Trigger, FollowUp]]:
    def prepare(ctx: Context) -> tuple[Trigger, FollowUp]:
        pid = ctx.stack.processes[name].pid
        return _signal(pid, sig), lambda: restart_service(ctx.stack, name, ctx.log)

    return prepare


def _database_away(ctx: Context) -> tuple[Trigger, FollowUp]:
    postgres = ctx.postgres
    assert postgres is not None
    at: list[float] = []

    def fire() -> float:
        postgres.stop_now()
        at.append(time.monotonic())
        return at[0]

    def back() -> None:
        time.sleep(max(0.0, at[0] + DATABASE_AWAY_S - time.monotonic()))
        postgres.start_again()
        ctx.log(f"  PostgreSQL back after {time.monotonic() - at[0]:.1f} s")

    return fire, back


FAULTS: tuple[Fault, ...] = (
    Fault("engine-core", "SIGKILL engine core", _kill_engine_core, recovery_timeout_s=300),
    Fault("replica", "SIGKILL replica process", _kill_replica, recovery_timeout_s=300),
    Fault("node-agent", "SIGKILL node-agent", _service("node_agent"), recovery_timeout_s=300),
    Fault("router", "SIGKILL router", _service("router")),
    Fault("auth", "SIGKILL auth", _service("auth")),
    Fault("orchestrator", "SIGKILL orchestrator", _service("orchestrator")),
    Fault("telemetry", "SIGKILL telemetry", _service("telemetry")),
    Fault(
        "node-agent-term",
        "SIGTERM node-agent, long streams",
        _service("node_agent", signal.SIGTERM),
        long_streams=True,
        recovery_timeout_s=300,
    ),
    Fault(
        "database",
        f"database away {DATABASE_AWAY_S:.0f} s",
        _database_away,
        needs_postgres=True,
    ),
)
QUICK_FAULTS = ("router", "auth", "orchestrator", "telemetry")


# -- one phase ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One fault's figures (module docstring)."""

    fault: Fault
    requests: list[Request]
    accounted: collections.Counter[str]
    retries: int
    fault_at: float
    recovery_s: float | None
    wall_s: float

    def outcomes(self, outcome: str) -> list[Request]:
        return [r for r in self.requests if r.outcome == outcome]

    @property
    def lost(self) -> list[Request]:
        return [r for r in self.requests if r.status == 200 and not self.accounted[r.request_id]]

    @property
    def doubled(self) -> list[Request]:
        return [r for r in self.requests if r.request_id and self.accounted[r.request_id] > 1]

    def in_flight(self) -> str:
        """How the load's streams in flight at the fault ended, e.g. `4: completed ×4`."""
        cut = [
            r
            for r in self.requests
            if r.client == "load" and r.started_at < self.fault_at < (r.ended_at or math.inf)
        ]
        outcomes = collections.Counter(r.outcome for r in cut)
        return f"{len(cut)}: " + ", ".join(f"{o} ×{n}" for o, n in outcomes.most_common())

    def cuts(self) -> str:
        resets = sum(1 for r in self.outcomes(CUT_SILENTLY) if r.transport_error)
        return f" (reset ×{resets})" if resets else ""

    def refusals(self) -> str:
        codes = collections.Counter(r.error_code for r in self.outcomes(FAILED_BEFORE_FIRST_TOKEN))
        return ", ".join(f"{code} ×{n}" for code, n in codes.most_common())


@dataclasses.dataclass(frozen=True)
class Phase:
    """How one fault's load runs."""

    workers: int = 4
    max_tokens: int = 300
    long_max_tokens: int = 1800
    warm_s: float = 3.0
    after_s: float = 5.0
    settle_s: float = 30.0


def run_fault(fault: Fault, ctx: Context, key: str, phase: Phase, ledger: UsageLedger) -> Row:
    """Runs the load, injects `fault` once every load stream is mid-way, waits for recovery,
    keeps the load on for `phase.after_s`, stops it and lets the usage reports settle."""
    stack, log = ctx.stack, ctx.log
    started = time.monotonic()
    max_tokens = phase.long_max_tokens if fault.long_streams else phase.max_tokens
    trigger, follow_up = fault.prepare(ctx)
    load = Load(stack.config.base_url, key, workers=phase.workers, max_tokens=max_tokens)
    retries_before = envoy_retries(stack)
    load.start()
    recovery: float | None = None
    fault_at = 0.0
    try:
        deadline = time.monotonic() + 120
        # Mid-way: a stream has tokens out and many to go, so the fault cuts it; long streams
        # keep more than the drain grace's worth to go (at ≥ 100 tokens/s per stream here).
        min_left = max_tokens // 2 if fault.long_streams else 60
        while not (
            time.monotonic() - started >= phase.warm_s
            and load.recovered_at(started) is not None
            and load.all_mid_stream(min_tokens=5, min_left=min_left)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{fault.name}: the load never reached a steady state")
            time.sleep(0.02)
        fault_at = trigger()
        log(f"  {fault.what} at +{fault_at - started:.1f} s")
        follow_up()
        deadline = fault_at + fault.recovery_timeout_s
        while (recovered := load.recovered_at(fault_at)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        recovery = None if recovered is None else recovered - fault_at
        log(
            f"  recovered {recovery:.1f} s after the fault"
            if recovery is not None
            else f"  NOT recovered within {fault.recovery_timeout_s:.0f} s"
        )
        time.sleep(phase.after_s)
    finally:
        load.stop()
    requests = load.snapshot()
    accounted = settle_usage(ledger, requests, phase.settle_s)
    return Row(
        fault=fault,
        requests=requests,
        accounted=accounted,
        retries=envoy_retries(stack) - retries_before,
        fault_at=fault_at,
        recovery_s=recovery,
        wall_s=time.monotonic() - started,
    )


# -- report ------------------------------------------------------------------------------------


HEADER = (
    "| fault | sent | completed | failed before 1st token (codes) | ended by error event "
    "| cut silently | usage lost / doubled | Envoy retries | recovery s |"
)


def table_row(row: Row) -> str:
    failed = row.outcomes(FAILED_BEFORE_FIRST_TOKEN)
    refusals = f" ({row.refusals()})" if failed else ""
    recovery = f"{row.recovery_s:.1f}" if row.recovery_s is not None else "not recovered"
    return (
        f"| {row.fault.what} | {len(row.requests)} | {len(row.outcomes(COMPLETED))} "
        f"| {len(failed)}{refusals} | {len(row.outcomes(ENDED_BY_ERROR_EVENT))} "
        f"| {len(row.outcomes(CUT_SILENTLY))}{row.cuts()} | {len(row.lost)} / {len(row.doubled)} "
        f"| {row.retries} | {recovery} |"
    )


def evidence(row: Row, limit: int = 3) -> Iterable[str]:
    """Lines describing the requests that missed a goal (cut silently, usage lost/doubled)."""
    for label, requests in (
        ("cut silently", row.outcomes(CUT_SILENTLY)),
        ("usage lost", row.lost),
        ("usage doubled", row.doubled),
    ):
        for request in requests[:limit]:
            described = request.describe(row.fault_at)
            yield f"  {row.fault.name}: {label}: {described} ({request.outcome})"
        if len(requests) > limit:
            yield f"  {row.fault.name}: {label}: ... and {len(requests) - limit} more"


# -- main --------------------------------------------------------------------------------------


def bench_key(stack: Stack) -> str:
    """An API key with limits far above the load (its checks and reports then take the
    counter store's path, as production keys do)."""
    return stack.create_api_key(
        "chaos",
        limits=auth_pb2.Limits(
            requests_per_minute=100_000, tokens_per_minute=100_000_000, max_concurrent_requests=64
        ),
    )


def stack_config(data_dir: Path, transport: str, database_urls: dict[str, str]) -> StackConfig:
    """The bench's stack: auth at debug level (its `usage_accounted` lines), the databases of
    `database_urls` (service name → URL; SQLite for the others)."""
    args: dict[str, tuple[str, ...]] = {"auth": ("--log-level", "debug")}
    for name, url in database_urls.items():
        args[name] = (*args.get(name, ()), "--database-url", url)
    return StackConfig(
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5),
        metrics_base_port=free_port_run(5),
        envoy_admin_port=free_port(),
        transport=transport,
        startup_timeout_seconds=420,
        service_args=args,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="", help="comma list (default: all; --quick: four)")
    parser.add_argument("--quick", action="store_true", help="shorter phases, four faults")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--transport", default="inproc")
    parser.add_argument("--database", choices=("postgresql", "sqlite"), default="")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args(argv)

    known = {f.name: f for f in FAULTS}
    names = [n for n in args.faults.split(",") if n] or (
        list(QUICK_FAULTS) if args.quick else list(known)
    )
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(known)}")
    faults = [f for f in FAULTS if f.name in names]
    phase = Phase(
        workers=args.workers,
        max_tokens=args.max_tokens,
        warm_s=2.0 if args.quick else 3.0,
        after_s=2.0 if args.quick else 5.0,
    )
    database = args.database or (
        "postgresql" if any(f.needs_postgres for f in faults) else "sqlite"
    )

    began = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    data_dir = Path(tempfile.mkdtemp(prefix="inferplane-chaos-"))
    postgres: Postgres | None = None
    rows: list[Row] = []
    try:
        urls: dict[str, str] = {}
        if database == "postgresql":
            postgres = Postgres(data_dir / "pg")
            try:
                postgres.start()
                urls = {n: postgres.database(f"chaos_{n}") for n in ("auth", "orchestrator")}
            except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                print(f"PostgreSQL unavailable ({exc}): SQLite, without the database fault")
                postgres = None
                faults = [f for f in faults if not f.needs_postgres]
        elif any(f.needs_postgres for f in faults):
            print("the database fault needs --database postgresql: skipped")
            faults = [f for f in faults if not f.needs_postgres]
        config = stack_config(data_dir / "stack", args.transport, urls)
        print(
            f"chaos {date}: {len(faults)} faults, {phase.workers} streams of "
            f"{phase.max_tokens} tokens (+ a probe), transport {args.transport}, "
            f"databases {database}, 1 replica; data in {data_dir}"
        )
        stack = Stack(config)
        stack.start(lambda m: print(f"  {m}"))
        try:
            print(f"stack up in {time.monotonic() - began:.0f} s")
            ctx = Context(stack, lambda m: print(m, flush=True), postgres)
            key = bench_key(stack)
            ledger = UsageLedger(config.data_dir / "logs" / "auth.log")
            for fault in faults:
                print(f"== {fault.name}: {fault.what}", flush=True)
                row = run_fault(fault, ctx, key, phase, ledger)
                rows.append(row)
                print(f"  {table_row(row)}  ({row.wall_s:.0f} s)", flush=True)
                print(f"  streams in flight at the fault: {row.in_flight()}")
                for line in evidence(row):
                    print(line)
                dead = stack.dead_component()
                if dead:
                    print(f"  a component is down after {fault.name}: {dead.splitlines()[0]}")
        finally:
            stack.stop()
    finally:
        if postgres is not None:
            postgres.close()
        if args.keep:
            print(f"kept {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)

    print()
    print(f"chaos {date}, {time.monotonic() - began:.0f} s in all")
    print(HEADER)
    print("|" + "---|" * 9)
    for row in rows:
        print(table_row(row))
    for row in rows:
        print(f"  {row.fault.name}: streams in flight at the fault: {row.in_flight()}")
    for row in rows:
        for line in evidence(row):
            print(line)
    print(f"doubled_usage_records: {sum(len(r.doubled) for r in rows)}")
    print(f"silent_truncations: {sum(len(r.outcomes(CUT_SILENTLY)) for r in rows)}")
    print(f"lost_usage_records: {sum(len(r.lost) for r in rows)}")


if __name__ == "__main__":
    main()

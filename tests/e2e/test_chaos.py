"""Faults under streaming load through the edge (issue 18, "Faults under load"), and the
failure semantics after the first byte on HTTP/1.1 and HTTP/2 (issue 31,
docs/architecture.md "Failure semantics"): the short version of `bench/chaos.py`, whose
machinery it runs (load, fault, supervisor's restart, usage ledger, stream outcomes).

Its own stack (module scope, not the session's: its services get killed, and auth logs at
debug level, one `usage_accounted` line per accounted request id). Four streams of 300 tokens
(`ignore_eos`, raw SSE through Envoy) and a probe run while a service is SIGKILLed mid-stream
and started again at once, as a process supervisor would. Invariants:

- no stream is cut or reset: every HTTP 200 stream ends with `data: [DONE]` or an SSE error
  event (never a clean or reset end without either);
- every request a replica served (HTTP 200) is accounted by auth exactly once (by the edge's
  `x-request-id`): no usage lost, none doubled;
- the stack recovers: a request sent after the fault completes.

Then the replica's own failures, with a stream of each API (chat completions, Anthropic
Messages, Responses) on each protocol (HTTP/1.1, HTTP/2 with prior knowledge) in flight:

- the engine core SIGKILLed: every stream ends with its API's error event (chat
  `data: {"error": ...}`, Messages `event: error`, Responses `response.failed` then `error`),
  never a finish;
- the replica process SIGKILLed (nothing is left to write an event): every stream ends with
  a transport-level error (HTTP/1.1: the chunked body without its last chunk; HTTP/2: the
  stream reset), never a clean end.

The engine and replica kills run last: each costs a replica restart (~20-60 s).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from inferplane.localstack import Stack, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(900)]

APIS = ("chat", "messages", "responses")
#: The error events a stream of each API ends with after an engine failure past its first byte.
ERROR_EVENTS = {
    "chat": ["data.error"],
    "messages": ["error"],
    "responses": ["response.failed", "error"],
}


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
    spec = importlib.util.spec_from_file_location("inferplane_bench_chaos", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    # Its machinery, bench/chaoslib, imports as it does when the script runs; bench/ stays on
    # sys.path only while it loads (its other scripts must not shadow anyone's modules).
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


chaos = _load_bench()
PHASE = chaos.Phase(workers=4, max_tokens=300, warm_s=2.0, after_s=2.0, settle_s=20.0)


class LostUsageError(AssertionError):
    """Requests a replica served that auth never accounted."""


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = chaos.stack_config(
        tmp_path_factory.mktemp("chaos"),
        os.environ.get("INFERPLANE_E2E_TRANSPORT", "inproc"),
        {},
    )
    with running_stack(config, print) as stack:
        yield stack


@pytest.fixture(scope="module")
def key(chaos_stack: Stack) -> str:
    return str(chaos.bench_key(chaos_stack))


def _run(stack: Stack, key: str, name: str) -> Any:
    """Runs fault `name` of bench/chaos.py under the load; prints its row and evidence."""
    (fault,) = [f for f in chaos.FAULTS if f.name == name]
    ledger = chaos.UsageLedger(stack.config.data_dir / "logs" / "auth.log")
    row = chaos.run_fault(fault, chaos.Context(stack, print), key, PHASE, ledger)
    print(f"\n{chaos.HEADER}\n{chaos.table_row(row)}")
    print(f"streams in flight at the fault: {row.in_flight()}")
    for line in chaos.evidence(row):
        print(line)
    return row


def _check(row: Any) -> None:
    """The invariants of the module docstring; lost usage last, as LostUsageError."""
    assert row.recovery_s is not None, "no request completed after the fault"
    cut = row.outcomes(chaos.CUT_SILENTLY, chaos.RESET_AFTER_FIRST_BYTE)
    assert not cut, [r.describe(row.fault_at) for r in cut]
    assert not row.doubled, [r.describe(row.fault_at) for r in row.doubled]
    completed = row.outcomes(chaos.COMPLETED)
    assert len([r for r in completed if r.started_at > row.fault_at]) >= 3, row.in_flight()
    if row.lost:
        raise LostUsageError(
            f"{len(row.lost)} served requests never accounted by auth: "
            + "; ".join(r.describe(row.fault_at) for r in row.lost)
        )


def test_sigkill_of_auth_under_streaming_load(chaos_stack: Stack, key: str) -> None:
    """Auth down ~1 s: new requests get a shaped 503 (`service_unavailable`) until it is back;
    streams in flight go on; the router's usage reports wait and are accounted once."""
    row = _run(chaos_stack, key, "auth")
    assert not chaos_stack.dead_component(), chaos_stack.dead_component()
    _check(row)


def test_sigkill_of_the_router_under_streaming_load(chaos_stack: Stack, key: str) -> None:
    """The router (endpoint picker) down ~1 s: new requests get 503 `picker_unavailable`
    until it is back; streams in flight go on (ext_proc's failure_mode_allow); every served
    request's usage still reaches auth: the replica's report of a stream the dead router
    picked reaches the restarted one, which accounts it from the report's key and model."""
    row = _run(chaos_stack, key, "router")
    assert not chaos_stack.dead_component(), chaos_stack.dead_component()
    _check(row)


# -- the replica's own failures, every API on both protocols -----------------------------------


def _serving(stack: Stack, key: str, timeout_s: float = 420.0) -> None:
    """Waits until a short chat stream completes through the edge (a killed replica is
    restarted by the node-agent: engine start and warm-up, minutes on a loaded box)."""
    deadline = time.monotonic() + timeout_s
    with chaos.client(http2=False) as http:
        while True:
            request = chaos.Request("probe", 4)
            chaos.stream(http, stack.config.base_url, key, chaos.body("chat", 4, "up?"), request)
            if request.outcome == chaos.COMPLETED:
                return
            assert time.monotonic() < deadline, request.describe()
            time.sleep(1.0)


def _streams_at(stack: Stack, key: str, kill: Callable[[], None]) -> dict[str, Any]:
    """A stream of every API on each protocol (two `Load`s, one per protocol, one worker per
    API), `kill()` once all six are mid-stream; returns the streams in flight at the kill by
    `api/h1` / `api/h2`, after each ended."""
    loads = {
        http2: chaos.Load(
            stack.config.base_url,
            key,
            workers=APIS,
            max_tokens=PHASE.max_tokens,
            http2=http2,
            label="h2" if http2 else "h1",
            probe_pause_s=1.0,
        )
        for http2 in (False, True)
    }
    for load in loads.values():
        load.start()
    try:
        deadline = time.monotonic() + 180
        while not all(load.all_mid_stream(min_tokens=3, min_left=0) for load in loads.values()):
            assert time.monotonic() < deadline, "the six streams were never in flight together"
            time.sleep(0.01)
        at = time.monotonic()
        kill()
    finally:
        for load in loads.values():
            load.stop()
    cut: dict[str, Any] = {}
    for load in loads.values():
        for r in load.snapshot():
            if r.client != "probe" and r.started_at < at < r.ended_at and r.tokens:
                cut[f"{r.api}/{r.client}"] = r
    for r in cut.values():
        print(f"{r.outcome}: {r.describe(at)}")
    assert sorted(cut) == sorted(f"{a}/{p}" for a in APIS for p in ("h1", "h2")), sorted(cut)
    return cut


def test_engine_core_kill_ends_every_api_with_its_error_event_on_both_protocols(
    chaos_stack: Stack, key: str
) -> None:
    """The engine core dies after the first byte: the replica process lives on and ends each
    stream with its API's error event, on HTTP/1.1 and HTTP/2 alike (no finish, no reset)."""
    _serving(chaos_stack, key)
    core = chaos.engine_core_pid(chaos_stack.serving_replica().engine_pid)
    cut = _streams_at(chaos_stack, key, lambda: os.kill(core, signal.SIGKILL))
    for name, request in cut.items():
        api, protocol = name.split("/")
        assert request.http_version == ("HTTP/2" if protocol == "h2" else "HTTP/1.1"), name
        assert request.outcome == chaos.ENDED_BY_ERROR_EVENT, request.describe()
        assert request.error_events == ERROR_EVENTS[api], request.describe()
        assert not request.done and not request.transport_error, request.describe()


def test_replica_process_kill_resets_every_stream_on_both_protocols(
    chaos_stack: Stack, key: str
) -> None:
    """The replica process dies after the first byte: nothing is left to write an error
    event, and Envoy can only reset the client's stream. Every stream must end with a
    transport-level error on both protocols (HTTP/1.1: an incomplete chunked body; HTTP/2:
    RST_STREAM), never a clean end a client would take for a whole answer."""
    _serving(chaos_stack, key)
    pid = chaos_stack.serving_replica().engine_pid
    cut = _streams_at(chaos_stack, key, lambda: os.kill(pid, signal.SIGKILL))
    for name, request in cut.items():
        assert request.outcome == chaos.RESET_AFTER_FIRST_BYTE, (name, request.describe())
        assert not request.done and request.error is None, request.describe()

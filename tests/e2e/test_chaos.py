"""Faults under streaming load through the edge (issue 18, "Faults under load"): the short
version of `bench/chaos.py`, whose machinery it runs (load, fault, supervisor's restart,
usage ledger).

Its own stack (module scope, not the session's: its services get killed, and auth logs at
debug level, one `usage_accounted` line per accounted request id). Four streams of 300 tokens
(`ignore_eos`, raw SSE through Envoy) and a probe run while a service is SIGKILLed mid-stream
and started again at once, as a process supervisor would. Invariants:

- no stream is cut silently: every HTTP 200 stream ends with `data: [DONE]` or an SSE error
  event (never a clean or reset end without either);
- every request a replica served (HTTP 200) is accounted by auth exactly once (by the edge's
  `x-request-id`): no usage lost, none doubled;
- the stack recovers: a request sent after the fault completes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from inferplane.localstack import Stack, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(900)]


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
    spec = importlib.util.spec_from_file_location("inferplane_bench_chaos", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
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
    cut = row.outcomes(chaos.CUT_SILENTLY)
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

"""The control plane's loss never touches the data path (issue 31, part 4): two routers share
the replica's cap through orchestrator leases; the orchestrator is SIGKILLed under streaming
load and started again at once (a new process: it stands by until the dead one's leader lease
runs out, ~10 s, then leads and adopts the grants its predecessor wrote). The load runs through
the whole failover. Invariants:

- no request is refused: every request completes (the routers admit on their last lease's
  shares while no orchestrator grants, services/router/README.md "When the orchestrator is
  away"); before, a router applied the standby's view (shares of 0) and refused with 429
  `model_overloaded`;
- afterwards both routers hold a lease of the new leader's epoch again (no held-over shares),
  and their shares of the replica's cap add up to at most the cap.

Uses bench/chaos.py's machinery (load, fault, supervisor's restart), as tests/e2e/test_chaos.py
does. ~2 min on the 2-core box (the stack's start is most of it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from inferplane.localstack import Stack, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.scenario, pytest.mark.timeout(900)]

_HELD_OVER = re.compile(r"^inferplane_router_cap_shares_held_over_seconds(?:\{\})? (\S+)$", re.M)
_SHARE = re.compile(
    r'^inferplane_router_cap_share_requests\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', re.M
)
_VALID = re.compile(r"^inferplane_router_cap_lease_valid(?:\{\})? (\S+)$", re.M)


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
    spec = importlib.util.spec_from_file_location("inferplane_bench_chaos_orch", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    sys.path.insert(0, str(path.parent))  # bench/chaoslib, only while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


chaos = _load_bench()
# The load goes on 20 s past the first request served after the kill: the standby's ~10 s
# and the new leader's first grants fall inside it.
PHASE = chaos.Phase(workers=4, max_tokens=300, warm_s=2.0, after_s=20.0, settle_s=20.0)


def _router_metrics(stack: Stack, name: str) -> str:
    cfg = stack.config
    url = f"http://{cfg.host_address(name)}:{cfg.metrics_ports[name]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        return str(answer.read().decode())


def test_orchestrator_sigkill_under_load_with_two_routers_refuses_nothing(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = chaos.stack_config(
        tmp_path_factory.mktemp("orchestrator-loss"),
        os.environ.get("INFERPLANE_E2E_TRANSPORT", "inproc"),
        {},
    )
    config = dataclasses.replace(config, routers=2)
    with running_stack(config, print) as stack:
        key = str(chaos.bench_key(stack))
        (fault,) = [f for f in chaos.FAULTS if f.name == "orchestrator"]
        ledger = chaos.UsageLedger(stack.config.data_dir / "logs" / "auth.log")
        row = chaos.run_fault(fault, chaos.Context(stack, print), key, PHASE, ledger)
        print(f"\n{chaos.HEADER}\n{chaos.table_row(row)}")
        for line in chaos.evidence(row):
            print(line)
        assert not stack.dead_component(), stack.dead_component()
        refused = row.outcomes(chaos.FAILED_BEFORE_FIRST_TOKEN)
        assert not refused, [r.describe(row.fault_at) for r in refused]
        after = [r for r in row.outcomes(chaos.COMPLETED) if r.started_at > row.fault_at + 12]
        assert after, "no request completed once the new orchestrator could lead"
        assert len(row.outcomes(chaos.COMPLETED)) == len(row.requests), row.in_flight()
        # Both routers back on a lease of the new leader (the load's end leaves them time).
        deadline = time.monotonic() + 60
        while True:
            texts = {n: _router_metrics(stack, n) for n in config.router_names}
            held = {n: _HELD_OVER.search(t) for n, t in texts.items()}
            valid = {n: _VALID.search(t) for n, t in texts.items()}
            if all(
                h is not None and float(h.group(1)) == 0.0 and v and float(v.group(1)) == 1.0
                for n, h in held.items()
                for v in [valid[n]]
            ):
                break
            assert time.monotonic() < deadline, {n: (h and h.group(1)) for n, h in held.items()}
            time.sleep(1.0)
        shares: dict[str, float] = {}
        for text in texts.values():
            for replica, value in _SHARE.findall(text):
                shares[replica] = shares.get(replica, 0.0) + float(value)
        cap = config.max_num_seqs
        assert shares and all(total <= cap for total in shares.values()), (shares, cap)

"""One fault under the load: `run_fault` (load, fault once every stream is mid-way, recovery,
the load's end, the usage reports' settling) → a `Row`."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import grpc

from inferplane.localstack import Stack

from .faults import Context, Fault
from .ledger import UsageLedger, moved_streams, settle_usage
from .load import Load
from .processes import Log, envoy_retries
from .report import Row


@dataclasses.dataclass(frozen=True)
class Phase:
    """How one fault's load runs."""

    workers: int = 4
    max_tokens: int = 300
    long_max_tokens: int = 1800
    warm_s: float = 3.0
    after_s: float = 5.0
    settle_s: float = 30.0
    http2: bool = False  # the load's streams on HTTP/2 (one connection), else HTTP/1.1


def _all_serving(stack: Stack, log: Log, timeout_s: float) -> None:
    """Waits (up to `timeout_s`) until the routing table lists every replica of the stack as
    serving: a replica killed by the previous fault may still be restarting once the other
    one served the recovery probe, and the next fault must find the stack whole."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(grpc.RpcError):
            if len(stack.serving_endpoints()) >= stack.config.replicas:
                return
        if time.monotonic() > deadline:
            log(f"  fewer than {stack.config.replicas} replicas serve after {timeout_s:.0f} s")
            return
        time.sleep(0.5)


def run_fault(fault: Fault, ctx: Context, key: str, phase: Phase, ledger: UsageLedger) -> Row:
    """Runs the load, injects `fault` once every load stream is mid-way, waits for recovery,
    keeps the load on for `phase.after_s`, stops it and lets the usage reports settle."""
    stack, log = ctx.stack, ctx.log
    _all_serving(stack, log, fault.recovery_timeout_s)
    started = time.monotonic()
    max_tokens = phase.long_max_tokens if fault.long_streams else phase.max_tokens
    trigger, follow_up = fault.prepare(ctx)
    load = Load(
        stack.config.base_url,
        key,
        workers=["chat"] * phase.workers,
        max_tokens=max_tokens,
        http2=phase.http2,
    )
    retries_before = envoy_retries(stack)
    moved_before = moved_streams(stack.config.data_dir)
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
        migrated=moved_streams(stack.config.data_dir) - moved_before,
    )

"""The faults (`FAULTS`, table order): each prepares its trigger and a follow-up."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable

from inferplane.localstack import Stack

from .processes import Log, Postgres, engine_core_pid, restart_service

DATABASE_AWAY_S = 10.0


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

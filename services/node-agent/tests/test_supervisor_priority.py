"""vLLM's engine core at a lower CPU priority (supervisor/priority.py): once a CPU replica is
ready, the engine core process below its launcher gets the niceness asked for on every
thread, while the launcher (the engine front) and the workers keep theirs; only CPU plans ask
for it; it never raises a priority; bad values are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.node_agent.supervisor import handle as supervisor
from inferplane.node_agent.supervisor.priority import (
    ENGINE_CORE_COMM,
    autogroup_niceness,
    autogroups_enabled,
    comm,
    parse_autogroup,
    renice_engine_cores,
    set_autogroup_niceness,
    thread_ids,
)
from inferplane.node_agent.supervisor.process import plan_launch, tree_pids
from inferplane.runtime import ConfigError

from .test_supervisor_manager import make_manager

pytestmark = [pytest.mark.timeout(60)]

SPEC = nodeagent_pb2.ReplicaSpec(served_model_name="m", model_source="/models/m")

# A stand-in for the launcher (the engine front): an "engine core" child named like vLLM's,
# with a second thread, that starts a "worker" grandchild; one more thread in the front.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    core = '''
    import subprocess, sys, threading, time
    open("/proc/self/comm", "w").write("VLLM::EngineCore")
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    worker = "open('/proc/self/comm', 'w').write('VLLM::Worker'); import time; time.sleep(60)"
    subprocess.Popen([sys.executable, "-c", worker])
    time.sleep(60)
    '''
    subprocess.Popen([sys.executable, "-c", core])
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    time.sleep(60)
    """
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def niceness(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def engine_tree() -> Iterator[tuple[int, int, int]]:
    """(front, core, worker) pids, once the core has its two threads and the worker its name."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = tree_pids(launcher.pid)
            if (
                len(pids) == 3
                and comm(pids[1]) == ENGINE_CORE_COMM
                and len(thread_ids(pids[1])) == 2
                and comm(pids[2]) == "VLLM::Worker"
            ):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the engine tree did not come up: {tree_pids(launcher.pid)}")
        yield pids[0], pids[1], pids[2]
    finally:
        for pid in reversed(tree_pids(launcher.pid)):
            os.kill(pid, 9)
        launcher.wait()


def test_only_the_engine_core_gets_the_niceness(engine_tree: tuple[int, int, int]) -> None:
    front, core, worker = engine_tree
    base = niceness(0)
    wanted = min(19, base + 7)
    assert renice_engine_cores(front, wanted) == [core]
    assert {niceness(t) for t in thread_ids(core)} == {wanted}
    assert {niceness(t) for t in thread_ids(front)} == {base}
    assert {niceness(t) for t in thread_ids(worker)} == {base}


def test_renice_never_raises_a_priority(engine_tree: tuple[int, int, int]) -> None:
    front, core, _worker = engine_tree
    high = min(19, niceness(0) + 8)
    renice_engine_cores(front, high)
    renice_engine_cores(front, max(1, high - 4))
    assert {niceness(t) for t in thread_ids(core)} == {high}


def test_no_engine_core_below_the_root_finds_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert renice_engine_cores(os.getpid(), 10) == []
        assert niceness(child.pid) == niceness(0)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("value", [0, -1, 20])
def test_a_niceness_outside_1_to_19_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.19"):
        renice_engine_cores(os.getpid(), value)


def test_cpu_plans_carry_the_niceness_gpu_plans_do_not(tmp_path: Path) -> None:
    def plan(**kwargs: object) -> int:
        return plan_launch("r1", SPEC, data_dir=tmp_path, **kwargs).engine_core_niceness  # type: ignore[arg-type]

    assert plan(cpu=True, engine_core_niceness=10) == 10
    assert plan(cpu=True) == 0
    assert plan(cpu=False, engine_core_niceness=10) == 0


@pytest.mark.parametrize("value", [-1, 20])
@pytest.mark.parametrize("name", ["engine_cpu_core_niceness", "engine_cpu_autogroup_niceness"])
def test_settings_refuse_a_niceness_outside_0_to_19(name: str, value: int) -> None:
    with pytest.raises(ConfigError, match=name):
        NodeAgentSettings(**{name: value})  # type: ignore[arg-type]


needs_autogroups = pytest.mark.skipif(
    not autogroups_enabled(), reason="the kernel schedules no autogroups (sched(7))"
)


@needs_autogroups
def test_a_session_leader_gets_the_autogroup_niceness_and_we_keep_ours() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        ours = autogroup_niceness(os.getpid())  # None in the root autogroup (CI runners)
        assert autogroup_niceness(leader.pid) == 0  # a new session's group starts at 0
        assert set_autogroup_niceness(leader.pid, 10) is True
        assert autogroup_niceness(leader.pid) == 10
        assert autogroup_niceness(os.getpid()) == ours
    finally:
        leader.kill()
        leader.wait()


@needs_autogroups
def test_a_process_that_does_not_lead_its_session_is_refused() -> None:
    """Its autogroup is its session's: here, ours."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = autogroup_niceness(os.getpid())
        with pytest.raises(ValueError, match="does not lead its session"):
            set_autogroup_niceness(child.pid, 10)
        assert autogroup_niceness(os.getpid()) == ours
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("text", "niceness"),
    [("/autogroup-4219 nice 0\n", 0), ("/autogroup-7 nice 10\n", 10), ("", None)],
)
def test_an_autogroup_text_gives_its_niceness_and_the_root_group_none(
    text: str, niceness: int | None
) -> None:
    assert parse_autogroup(text) == niceness


@pytest.mark.parametrize("text", ["/autogroup-7 nice\n", "nice 10\n", "/autogroup-7 nice x\n"])
def test_an_autogroup_text_of_another_shape_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_autogroup(text)


@pytest.mark.parametrize("value", [0, -1, 20])
def test_an_autogroup_niceness_outside_1_to_19_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.19"):
        set_autogroup_niceness(os.getpid(), value)


def test_cpu_plans_carry_the_autogroup_niceness_gpu_plans_do_not(tmp_path: Path) -> None:
    def plan(**kwargs: object) -> int:
        return plan_launch("r1", SPEC, data_dir=tmp_path, **kwargs).engine_autogroup_niceness  # type: ignore[arg-type]

    assert plan(cpu=True, engine_autogroup_niceness=10) == 10
    assert plan(cpu=True) == 0
    assert plan(cpu=False, engine_autogroup_niceness=10) == 0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("outcome", "event", "attempts"),
    [
        ("set", "engine_autogroup_reniced", 1),
        ("rate-limited once", "engine_autogroup_reniced", 2),
        ("always rate-limited", "engine_autogroup_renice_failed", 5),
        ("not permitted", "engine_autogroup_renice_failed", 1),
        ("no autogroups", None, 1),
        ("not asked", None, 0),
    ],
)
async def test_the_supervisor_sets_the_autogroup_once_ready_and_a_failure_does_not_stop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str, event: str | None, attempts: int
) -> None:
    calls: list[tuple[int, int]] = []

    def set_niceness(pid: int, niceness: int) -> bool:
        calls.append((pid, niceness))
        if outcome == "always rate-limited" or (outcome == "rate-limited once" and len(calls) == 1):
            raise BlockingIOError(11, "Resource temporarily unavailable")
        if outcome == "not permitted":
            raise PermissionError(1, "Operation not permitted")
        return outcome != "no autogroups"

    monkeypatch.setattr(supervisor, "set_autogroup_niceness", set_niceness)
    monkeypatch.setattr(supervisor, "session_leaders", lambda pid: [pid])  # no real tree
    monkeypatch.setattr(supervisor, "renice_engine_cores", lambda pid, niceness: [pid + 1])
    niceness = 0 if outcome == "not asked" else 10
    manager, _spawner, _clock = make_manager(
        tmp_path, ["ok"], engine_core_niceness=19, engine_autogroup_niceness=niceness
    )
    ready = nodeagent_pb2.Replica.State.STATE_READY
    with structlog.testing.capture_logs() as logs:
        replica = await manager.start("r1", SPEC)
        assert await replica.wait_for_state(ready, timeout=10) == ready
    await manager.close()
    assert calls == [(100, 10)] * attempts  # the fake engine's pid
    events = {entry["event"] for entry in logs} & {
        "engine_autogroup_reniced",
        "engine_autogroup_renice_failed",
    }
    assert events == ({event} if event else set())


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("outcome", "event"),
    [
        ("reniced", "engine_core_reniced"),
        ("none found", "engine_core_not_found"),
        ("not permitted", "engine_core_renice_failed"),
        ("not asked", None),
    ],
)
async def test_the_supervisor_renices_once_ready_and_a_failure_does_not_stop_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str, event: str | None
) -> None:
    calls: list[tuple[int, int]] = []

    def renice(pid: int, niceness: int) -> list[int]:
        calls.append((pid, niceness))
        if outcome == "not permitted":
            raise PermissionError(1, "Operation not permitted")
        return [pid + 1] if outcome == "reniced" else []

    monkeypatch.setattr(supervisor, "renice_engine_cores", renice)
    niceness = 0 if outcome == "not asked" else 19
    manager, _spawner, _clock = make_manager(tmp_path, ["ok"], engine_core_niceness=niceness)
    ready = nodeagent_pb2.Replica.State.STATE_READY
    with structlog.testing.capture_logs() as logs:
        replica = await manager.start("r1", SPEC)
        assert await replica.wait_for_state(ready, timeout=5) == ready
    await manager.close()
    assert calls == ([] if event is None else [(100, 19)])  # the fake engine's pid
    renice_events = {entry["event"] for entry in logs} & {
        "engine_core_reniced",
        "engine_core_not_found",
        "engine_core_renice_failed",
    }
    assert renice_events == ({event} if event else set())

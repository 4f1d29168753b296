"""Supervision of real child processes (the fake engine, engine/fake_engine.py): restart after
a crash, logs per replica, stop escalation, loopback-only listeners, no orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.engine.api import SamplingParams
from inferplane.node_agent.engine.process import (
    is_loopback,
    listening_addresses,
    tree_pids,
)
from inferplane.node_agent.engine.supervisor import ReplicaManager, SupervisorConfig

State = nodeagent_pb2.Replica.State
pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

FAKE = (sys.executable, "-m", "inferplane.node_agent.engine.fake_engine")
SPEC = nodeagent_pb2.ReplicaSpec(
    served_model_name="fake", model_source="/models/fake", transport="grpc"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def manager_for(tmp_path: Path, *fake_args: str, **config: object) -> ReplicaManager:
    settings = {
        "data_dir": tmp_path,
        "engine_command": (*FAKE, *fake_args),
        "startup_timeout_seconds": 20.0,
        "health_interval_seconds": 0.2,
        "startup_poll_seconds": 0.1,
        "backoff_initial_seconds": 0.1,
        "backoff_max_seconds": 0.5,
        "stop_timeout_seconds": 5.0,
        "cpu": True,
        **config,
    }
    return ReplicaManager(SupervisorConfig(**settings))  # type: ignore[arg-type]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


async def eventually(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


async def test_crash_restart_logs_and_clean_stop(tmp_path: Path) -> None:
    """Invariant: a killed engine is restarted with its whole old tree gone, its output lands
    in <data_dir>/replicas/<id>/engine.log, and stop leaves no process behind."""
    manager = manager_for(tmp_path, "--spawn-child")
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    first_tree = tree_pids(replica.pid)
    # The engine, its "EngineCore" child and the procguard reaper of its group.
    assert len(first_tree) == 3, first_tree

    outputs = [
        o async for o in replica.engine.generate("q1", [7, 8, 9], SamplingParams(max_tokens=4))
    ]
    assert [t for o in outputs for t in o.token_ids] == [10, 11, 12, 13]
    assert outputs[-1].finished and outputs[-1].completion_tokens == 4

    os.kill(replica.pid, signal.SIGKILL)
    await eventually(lambda: replica.restart_count == 1 and replica.state == State.STATE_READY)
    await eventually(lambda: not alive(first_tree))
    second_tree = tree_pids(replica.pid)
    assert "exited with code -9" in replica.last_error

    log = (tmp_path / "replicas" / "r1" / "engine.log").read_text()
    assert log.count("fake engine serving") == 2 and log.count("--- starting:") == 2

    await manager.stop("r1", grace_seconds=1)
    assert replica.state == State.STATE_STOPPED and replica.pid == 0
    assert not alive(second_tree)


async def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    manager = manager_for(tmp_path, "--ignore-sigterm", stop_timeout_seconds=0.5)
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    pid = replica.pid
    started = time.monotonic()
    await manager.stop("r1", force=True)
    assert 0.4 < time.monotonic() - started < 5
    assert not alive([pid])


async def test_an_engine_that_keeps_failing_ends_failed(tmp_path: Path) -> None:
    state = tmp_path / "starts"
    manager = manager_for(
        tmp_path, "--fail-starts", "99", "--state-file", str(state), max_start_attempts=3
    )
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_FAILED, timeout=30)
    assert state.read_text() == "3"
    assert "exited with code 3" in replica.last_error and replica.restart_count == 2


async def test_engine_listens_on_loopback_only(tmp_path: Path) -> None:
    manager = manager_for(tmp_path, "--spawn-child")
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    listening = listening_addresses(tree_pids(replica.pid))
    ports = {port for _addr, port in listening}
    assert int(replica.grpc_address.rsplit(":", 1)[1]) in ports
    assert int(replica.metrics_url.rsplit(":", 1)[1].split("/")[0]) in ports
    assert all(is_loopback(addr) for addr, _port in listening), listening
    await manager.close()


AGENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from inferplane.api.nodeagent.v1 import nodeagent_pb2
    from inferplane.node_agent.engine.process import tree_pids
    from inferplane.node_agent.engine.supervisor import ReplicaManager, SupervisorConfig

    async def main():
        cfg = SupervisorConfig(
            data_dir=Path(sys.argv[1]), cpu=True, startup_poll_seconds=0.1,
            engine_command=(sys.executable, "-m", "inferplane.node_agent.engine.fake_engine",
                            *sys.argv[2:]),
        )
        manager = ReplicaManager(cfg)
        replica = await manager.start(
            "r1", nodeagent_pb2.ReplicaSpec(model_source="/m", transport="grpc")
        )
        await replica.wait_for_state(nodeagent_pb2.Replica.STATE_READY, timeout=20)
        print("PIDS", *tree_pids(replica.pid), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize(
    ("how", "engine"),
    [
        (signal.SIGKILL, "graceful"),
        (signal.SIGTERM, "graceful"),
        (signal.SIGKILL, "dies-on-sigterm"),
    ],
)
def test_no_orphan_engines_when_the_agent_dies(tmp_path: Path, how: int, engine: str) -> None:
    """Invariant: however the node-agent process dies (SIGKILL included), no engine process
    of its survives it, the engine's own children included, also when the engine dies of the
    SIGTERM it gets (vLLM's HTTP server re-raises it: no atexit hook, no thread runs then)."""
    fake_args = ["--spawn-child"] + (["--sigterm-kills"] if engine == "dies-on-sigterm" else [])
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), *fake_args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        line = ""
        while not line.startswith("PIDS"):  # structlog also writes to stdout
            line = agent.stdout.readline()
            assert line, "the agent exited before its engine was ready"
        engine_pids = [int(p) for p in line.split()[1:]]
        assert len(engine_pids) >= 2 and alive(engine_pids)
        agent.send_signal(how)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(engine_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(engine_pids), f"orphans left: {alive(engine_pids)}"
    finally:
        agent.kill()
        agent.wait()

"""Supervision of real child processes: the fake replica process
(inferplane.testing.fake_replica, which takes the replica process's exact command line) with
the fake engine (testing/fake_engine.py) as its child: restart after a crash of either, logs
and spec file per replica, drain over ReplicaProcessService, stop escalation, loopback-only
engine listeners, no orphans; and the launch plan of each transport."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inferplane import replica_contract
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.supervisor.manager import ReplicaManager, SupervisorConfig
from inferplane.node_agent.supervisor.process import (
    LAUNCHER_COMMAND,
    REPLICA_COMMAND,
    is_loopback,
    listening_addresses,
    plan_launch,
    tree_pids,
)
from inferplane.replica_contract import ReplicaFlags, Transport
from inferplane.testing import fake_replica

State = nodeagent_pb2.Replica.State
pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

FAKE_REPLICA = (sys.executable, "-m", "inferplane.testing.fake_replica")
FAKE_ENGINE = (sys.executable, "-m", "inferplane.testing.fake_engine")
SPEC = nodeagent_pb2.ReplicaSpec(
    served_model_name="fake", model_source="/models/fake", transport="grpc"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def manager_for(
    tmp_path: Path, *replica_args: str, engine_args: tuple[str, ...] = (), **config: object
) -> ReplicaManager:
    settings = {
        "data_dir": tmp_path,
        "replica_command": (*FAKE_REPLICA, *replica_args),
        "engine_command": (*FAKE_ENGINE, *engine_args),
        "startup_timeout_seconds": 20.0,
        "health_interval_seconds": 0.2,
        "startup_poll_seconds": 0.1,
        "drain_poll_seconds": 0.05,
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


def engine_pid(replica_pid: int) -> int:
    """The fake engine below a replica process (its child whose command is the engine's)."""
    for pid in tree_pids(replica_pid)[1:]:
        if b"fake_engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no engine below {replica_pid}: {tree_pids(replica_pid)}")


async def test_crash_restart_logs_and_clean_stop(tmp_path: Path) -> None:
    """Invariant: a killed replica process is restarted with its whole old tree (engine
    included) gone, so is one whose engine died (it exits non-zero), their output lands in
    <data_dir>/replicas/<id>/replica.log (mode 0600), the spec reaches it through spec.json,
    and stop leaves no process behind."""
    manager = manager_for(tmp_path, engine_args=("--spawn-child",))
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    first_tree = tree_pids(replica.pid)
    # The replica process and its group's procguard reaper; the engine (leading its own group,
    # as the replica process starts it), its reaper and its "EngineCore".
    assert len(first_tree) == 5, first_tree
    spec_file = tmp_path / "replicas" / "r1" / "spec.json"
    assert json.loads(spec_file.read_text())["servedModelName"] == "fake"

    os.kill(replica.pid, signal.SIGKILL)
    await eventually(lambda: replica.restart_count == 1 and replica.state == State.STATE_READY)
    await eventually(lambda: not alive(first_tree))
    assert "exited with code -9" in replica.last_error

    os.kill(engine_pid(replica.pid), signal.SIGKILL)
    await eventually(lambda: replica.restart_count == 2 and replica.state == State.STATE_READY)
    # Its exit (code 1) or, on a loaded machine, the failed load checks that precede it.
    assert "exited with code 1" in replica.last_error or "unhealthy" in replica.last_error, (
        replica.last_error
    )
    third_tree = tree_pids(replica.pid)

    log_path = tmp_path / "replicas" / "r1" / "replica.log"
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600  # engines may log prompts
    log = log_path.read_text()
    assert log.count("fake replica serving") == 3 and log.count("--- starting:") == 3
    assert log.count("fake engine serving") == 3

    await manager.stop("r1", grace_seconds=1)
    assert replica.state == State.STATE_STOPPED and replica.pid == 0
    assert not alive(third_tree)


async def test_drain_waits_for_the_replica_process_in_flight_requests(tmp_path: Path) -> None:
    """Invariant: over the real control port, a drain turns the replica's health NOT_SERVING
    without a restart, reports the replica's own in-flight count, and the stop that follows
    waits for it to reach 0 (here 2 requests that end 0.5 s after the drain)."""
    manager = manager_for(tmp_path, "--fake-in-flight", "2", "--fake-drain-seconds", "0.5")
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    await eventually(lambda: replica.to_proto().in_flight_requests == 2)
    pid = replica.pid
    drained = await manager.drain("r1", grace_seconds=30)
    assert drained.state == State.STATE_DRAINING
    started = time.monotonic()
    await manager.stop("r1", grace_seconds=30)
    assert 0.3 < time.monotonic() - started < 10
    assert replica.restart_count == 0 and replica.state == State.STATE_STOPPED
    assert not alive([pid])


async def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    manager = manager_for(
        tmp_path,
        "--fake-ignore-sigterm",
        engine_args=("--ignore-sigterm",),  # or the engine's exit would end the replica
        stop_timeout_seconds=0.5,
    )
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    pids = tree_pids(replica.pid)
    started = time.monotonic()
    await manager.stop("r1", force=True)
    assert 0.4 < time.monotonic() - started < 5
    # The engine's group is its own: its procguard takes it down once the replica is gone.
    await eventually(lambda: not alive(pids))


async def test_a_replica_that_keeps_failing_ends_failed(tmp_path: Path) -> None:
    state = tmp_path / "starts"
    manager = manager_for(
        tmp_path,
        *("--fake-fail-starts", "99", "--fake-state-file", str(state)),
        max_start_attempts=3,
    )
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_FAILED, timeout=30)
    assert state.read_text() == "3"
    assert "exited with code 3" in replica.last_error and replica.restart_count == 2


async def test_the_replica_serves_its_own_port_and_the_engine_stays_on_loopback(
    tmp_path: Path,
) -> None:
    """Invariant: the replica process listens on its reported inference_address and serves
    the metrics (its own with the engine's) on loopback; its engine (API and metrics) listens
    on loopback ports only."""
    manager = manager_for(tmp_path, engine_args=("--spawn-child",))
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=20)
    ours = listening_addresses([replica.pid])
    port = int(replica.inference_address.rsplit(":", 1)[1])
    assert [addr for addr, p in ours if p == port and is_loopback(addr)], ours
    metrics_port = int(replica.metrics_url.rsplit(":", 1)[1].split("/")[0])
    assert [addr for addr, p in ours if p == metrics_port and is_loopback(addr)], ours
    engine = listening_addresses(tree_pids(engine_pid(replica.pid)))
    ports = {port for _addr, port in engine}
    assert int(replica.engine_address.rsplit(":", 1)[1]) in ports
    assert all(is_loopback(addr) for addr, _port in engine), engine
    await manager.close()


# --- launch plans -----------------------------------------------------------------------


def split(argv: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """A replica command line as (replica flags, engine command up to its `--`, vLLM args)."""
    if "--" not in argv:
        return list(argv), [], []
    cut = argv.index("--")
    engine = list(argv[cut + 1 :])
    inner = engine.index("--")
    return list(argv[:cut]), engine[:inner], engine[inner + 1 :]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("transport", ["grpc", "http-completions"])
def test_the_plan_starts_the_replica_process_with_its_engine_as_child(
    tmp_path: Path, transport: str
) -> None:
    """Invariant: on `http-completions` / `grpc` the plan runs the replica process on a port
    of its own, with the engine's full launcher command line after `--` on another loopback
    port (`--engine-address`); the spec travels as proto JSON in <data_dir>/replicas/<id>/."""
    spec = nodeagent_pb2.ReplicaSpec(
        served_model_name="kimi-tiny", model_source="/m/kimi", transport=transport
    )
    options = ReplicaFlags(
        telemetry_address="127.0.0.1:7000",
        node_name="node-a",
        strict_tool_calls=True,
        gc_freeze=True,
        startup_timeout_seconds=120,
        drain_grace_seconds=3,
    )
    plan = plan_launch("r1", spec, data_dir=tmp_path, cpu=True, options=options)
    ours, engine, vllm = split(plan.argv)
    assert tuple(ours[:3]) == REPLICA_COMMAND and tuple(engine[:3]) == LAUNCHER_COMMAND
    port = flag(ours, "--port")
    assert flag(ours, "--host") == "127.0.0.1" and plan.inference_address == f"127.0.0.1:{port}"
    assert flag(ours, "--replica-id") == "r1" and flag(ours, "--transport") == transport
    assert flag(ours, "--spec-file") == str(plan.spec_path)
    assert plan.spec_path == tmp_path / "replicas" / "r1" / "spec.json"
    assert plan.log_path == tmp_path / "replicas" / "r1" / "replica.log"
    assert json.loads(plan.spec_json)["modelSource"] == "/m/kimi"
    for name, value in [
        ("--telemetry-address", "127.0.0.1:7000"),
        ("--node-name", "node-a"),
        ("--owned-by", "inferplane"),
        ("--startup-timeout-seconds", "120"),
        ("--drain-grace-seconds", "3"),
    ]:
        assert flag(ours, name) == value, name
    assert {"--strict-tool-calls", "--gc-freeze"} <= set(ours)
    assert "--device" not in ours  # the launcher's job here
    # The replica serves its own series with the engine's, which it fetches from there.
    if "--metrics-port" in engine:  # grpc: the launcher serves vLLM's registry
        assert flag(ours, "--metrics-port") != flag(engine, "--metrics-port")
    assert plan.metrics_url == f"http://127.0.0.1:{flag(ours, '--metrics-port')}/metrics"
    engine_metrics = flag(ours, "--engine-metrics-url")
    assert engine_metrics.startswith("http://127.0.0.1:") and engine_metrics != plan.metrics_url
    engine_port = flag(vllm, "--port")
    assert flag(vllm, "--host") == "127.0.0.1" and engine_port != port
    assert plan.engine_address == flag(ours, "--engine-address") == f"127.0.0.1:{engine_port}"
    assert flag(engine, "--device") == "cpu"
    if transport == "grpc":
        assert "--grpc" in vllm
        metrics_port = flag(engine, "--metrics-port")
        assert engine_metrics == f"http://127.0.0.1:{metrics_port}/metrics"
    else:
        assert "--grpc" not in vllm and "--enable-prompt-tokens-details" in vllm
        assert engine_metrics == f"http://127.0.0.1:{engine_port}/metrics"
    # The fake replica parses the replica process's flags strictly: the plan keeps to them.
    opts, engine_argv = fake_replica.parse(list(plan.argv[len(REPLICA_COMMAND) :]))
    assert opts.port == int(port) and engine_argv == [*engine, "--", *vllm]


def test_the_inproc_plan_has_no_engine_command_and_serves_metrics_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant: `inproc` passes the launcher's environment set-up flags to the replica
    process itself and its own metrics port; no engine command line, no engine address."""
    if (
        Transport.INPROC not in replica_contract.TRANSPORTS
    ):  # until the replica process lands with it
        monkeypatch.setattr(
            replica_contract, "TRANSPORTS", (*replica_contract.TRANSPORTS, Transport.INPROC)
        )
    spec = nodeagent_pb2.ReplicaSpec(
        model_source="/m/kimi",
        transport=Transport.INPROC,
        kv_cache_bytes=1 << 30,
        gpu_indices=[2, 3],
    )
    plan = plan_launch(
        "r1", spec, data_dir=tmp_path, cpu=False, cpu_env={"VLLM_CPU_OMP_THREADS_BIND": "1"}
    )
    assert "--" not in plan.argv and plan.engine_address == ""
    ours = list(plan.argv)
    metrics_port = flag(ours, "--metrics-port")
    assert plan.metrics_url == f"http://127.0.0.1:{metrics_port}/metrics"
    assert flag(ours, "--metrics-host") == "127.0.0.1" and flag(ours, "--device") == "gpu"
    assert flag(ours, "--kv-cache-bytes") == str(1 << 30)
    assert flag(ours, "--cache-root") == str(tmp_path / "replicas" / "r1" / "cache")
    assert "--engine-address" not in ours
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_CPU_OMP_THREADS_BIND" not in plan.env
    opts, engine_argv = fake_replica.parse(ours[len(REPLICA_COMMAND) :])
    assert opts.transport == "inproc" and engine_argv == []


def test_cpu_plans_carry_the_bind_and_niceness_and_the_agent_pid(tmp_path: Path) -> None:
    plan = plan_launch(
        "r1",
        SPEC,
        data_dir=tmp_path,
        cpu=True,
        cpu_env={"VLLM_CPU_OMP_THREADS_BIND": "1-2"},
        engine_core_niceness=19,
        engine_autogroup_niceness=10,
    )
    assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "1-2"
    assert plan.env["INFERPLANE_ENGINE_PARENT_PID"] == str(os.getpid())
    assert (plan.engine_core_niceness, plan.engine_autogroup_niceness) == (19, 10)


def test_a_replica_bound_elsewhere_is_reported_at_its_advertised_host(tmp_path: Path) -> None:
    plan = plan_launch(
        "r1", SPEC, data_dir=tmp_path, cpu=True, replica_host="0.0.0.0", advertise_host="10.0.0.7"
    )
    ours, _engine, vllm = split(plan.argv)
    assert flag(ours, "--host") == "0.0.0.0" and flag(vllm, "--host") == "127.0.0.1"
    assert plan.inference_address == f"10.0.0.7:{flag(ours, '--port')}"


AGENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from inferplane.api.nodeagent.v1 import nodeagent_pb2
    from inferplane.node_agent.supervisor.process import tree_pids
    from inferplane.replica_contract import ReplicaFlags
    from inferplane.node_agent.supervisor.manager import ReplicaManager, SupervisorConfig

    async def main():
        cfg = SupervisorConfig(
            data_dir=Path(sys.argv[1]), cpu=True, startup_poll_seconds=0.1,
            replica_command=(sys.executable, "-m", "inferplane.testing.fake_replica"),
            engine_command=(sys.executable, "-m", "inferplane.testing.fake_engine",
                            *sys.argv[2:]),
            replica=ReplicaFlags(drain_grace_seconds=1),
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
    """Invariant: however the node-agent process dies (SIGKILL included), no replica process
    of its survives it, nor its engine and the engine's own children, also when the engine
    dies of the SIGTERM it gets (vLLM's HTTP server re-raises it: no atexit hook, no thread
    runs then)."""
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

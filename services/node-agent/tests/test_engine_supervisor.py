"""Supervisor logic with in-memory engines and a fake clock: no processes, no real sleeps."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.engine.api import EngineOutput, SamplingParams
from inferplane.node_agent.engine.process import LaunchPlan
from inferplane.node_agent.engine.supervisor import ReplicaManager, SupervisorConfig
from inferplane.runtime import AlreadyExistsError, NotFoundError, UnavailableError

State = nodeagent_pb2.Replica.State
pytestmark = [pytest.mark.timeout(30), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeClock:
    """Virtual time: sleep() advances it and yields to the loop once."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.t, dt.UTC)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


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
    """Each spawn consumes the next behaviour: "ok" (healthy), "exit" (dies at start),
    "hang" (never healthy)."""

    def __init__(self, behaviours: Sequence[str]) -> None:
        self.behaviours = list(behaviours)
        self.handles: list[FakeHandle] = []
        self.health: dict[str, bool] = {}

    async def spawn(self, plan: LaunchPlan) -> FakeHandle:
        behaviour = self.behaviours.pop(0) if self.behaviours else "ok"
        handle = FakeHandle(100 + len(self.handles), exit_code=3 if behaviour == "exit" else None)
        self.health[plan.grpc_address] = behaviour == "ok"
        self.handles.append(handle)
        return handle


class FakeClient:
    def __init__(self, spawner: FakeSpawner, address: str) -> None:
        self.spawner = spawner
        self.address = address
        self.closed = False

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        return None

    async def healthy(self) -> bool:
        return self.spawner.health.get(self.address, False)

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
            log_path=tmp_path / rid / "engine.log",
            grpc_address=f"127.0.0.1:{n}",
            metrics_url=f"http://127.0.0.1:{n}/metrics",
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


async def test_a_healthy_engine_becomes_ready_and_is_listed_for_its_model(tmp_path: Path) -> None:
    manager, _spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    assert await replica.wait_for_state(State.STATE_READY, timeout=5) == State.STATE_READY
    assert [r.replica_id for r in manager.ready_replicas("kimi-tiny")] == ["r1"]
    assert manager.ready_replicas("other") == []
    assert [s.served_model_name for s in manager.known_models()] == ["kimi-tiny"]
    proto = replica.to_proto("127.0.0.1:50054")
    assert proto.name == "replicas/r1" and proto.engine_pid == 100
    assert proto.metrics_url.startswith("http://127.0.0.1:")
    await manager.close()
    assert replica.state == State.STATE_STOPPED


async def test_failed_starts_back_off_exponentially_then_succeed(tmp_path: Path) -> None:
    """Invariant: restarts wait 1, 2, 4 ... s (capped), and count in restart_count."""
    manager, spawner, clock = make_manager(tmp_path, ["exit", "exit", "exit", "ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    backoffs = [s for s in clock.sleeps if s >= 1.0]
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
    assert manager.ready_replicas("kimi-tiny") == []
    # A FAILED replica can be started again (StartReplica replaces it).
    spawner.behaviours = ["ok"]
    again = await manager.start("r1", SPEC)
    await again.wait_for_state(State.STATE_READY, timeout=5)
    await manager.close()


async def test_an_engine_that_never_turns_healthy_times_out(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(
        tmp_path, ["hang", "hang"], max_start_attempts=2, startup_timeout_seconds=3.0
    )
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_FAILED, timeout=5)
    assert "not healthy after 3 s" in replica.last_error
    # Every timed-out engine was stopped, not left behind.
    assert all(h.returncode is not None for h in spawner.handles)
    await manager.close()


async def test_a_dead_ready_engine_is_restarted(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    first_client = replica.engine
    spawner.handles[0].die(-9)
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 101)
    assert replica.restart_count == 1
    assert "exited with code -9" in replica.last_error
    assert replica.engine is not first_client
    assert isinstance(first_client, FakeClient) and first_client.closed
    await manager.close()


async def test_a_long_stable_run_earns_a_fresh_restart_budget(tmp_path: Path) -> None:
    """Invariant: only crash loops end FAILED; an engine that served for stable_after_seconds
    is restarted at once however often it died before."""
    manager, spawner, clock = make_manager(
        tmp_path, ["ok"] * 5, max_start_attempts=2, stable_after_seconds=100.0
    )
    replica = await manager.start("r1", SPEC)
    for n in range(3):
        await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 100 + n)  # noqa: B023
        clock.t += 500
        spawner.handles[n].die(1)
        await wait_until(lambda: replica.restart_count == n + 1)  # noqa: B023
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 103)
    assert not [s for s in clock.sleeps if s >= 1.0]  # no backoff: each run was stable
    await manager.close()


async def test_unhealthy_engine_is_replaced(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"], unhealthy_threshold=2)
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    spawner.health["127.0.0.1:1"] = False
    await wait_until(lambda: replica.state == State.STATE_READY and replica.pid == 101)
    assert "unhealthy for 2 consecutive checks" in replica.last_error
    assert spawner.handles[0].signals == ["TERM"]
    await manager.close()


async def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    release = asyncio.Event()

    async def request() -> str:
        async with replica.admit():
            await release.wait()
            return "done"

    in_flight = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert replica.in_flight == 1
    await manager.drain("r1", grace_seconds=60)
    assert replica.state == State.STATE_DRAINING
    assert manager.ready_replicas("kimi-tiny") == []
    with pytest.raises(UnavailableError):
        async with replica.admit():
            pass
    stopping = asyncio.create_task(manager.stop("r1", grace_seconds=1e9))
    await asyncio.sleep(0.05)
    assert not stopping.done() and spawner.handles[0].returncode is None
    release.set()
    assert await in_flight == "done"
    await stopping
    assert replica.state == State.STATE_STOPPED
    assert spawner.handles[0].returncode == 0


async def test_stop_after_the_grace_period_even_with_requests_in_flight(tmp_path: Path) -> None:
    manager, spawner, clock = make_manager(tmp_path, ["ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    stuck = asyncio.Event()

    async def request() -> None:
        async with replica.admit():
            await stuck.wait()

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    before = clock.t
    await manager.stop("r1", grace_seconds=5)
    assert clock.t - before >= 5
    assert replica.state == State.STATE_STOPPED and spawner.handles[0].returncode == 0
    task.cancel()


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
    await manager.close()


async def test_a_drained_replica_that_restarts_stays_draining(tmp_path: Path) -> None:
    manager, spawner, _clock = make_manager(tmp_path, ["ok", "ok"])
    replica = await manager.start("r1", SPEC)
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    await replica.drain(0)
    spawner.handles[0].die(1)
    await asyncio.sleep(0.05)
    for _ in range(50):
        if len(spawner.handles) == 2 and replica.pid:
            break
        await asyncio.sleep(0.01)
    assert replica.state == State.STATE_DRAINING
    await manager.close()

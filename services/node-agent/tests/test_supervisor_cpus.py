"""CPU cores per engine replica on a CPU node (supervisor/cpus.py): disjoint sets while the node
has room (smaller ones when it has less), `nobind` when not even one core per rank is free,
cores back to the pool when a replica stops, and an explicit `VLLM_CPU_OMP_THREADS_BIND` in
the agent's environment left alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.supervisor.cpus import (
    BIND_ENV,
    NOBIND,
    PASSIVE,
    WAIT_POLICY_ENV,
    CpuCorePool,
    format_cpu_list,
    thread_environment,
)
from inferplane.node_agent.supervisor.manager import ReplicaManager, SupervisorConfig
from inferplane.node_agent.supervisor.process import LaunchPlan
from inferplane.testing.clock import FakeClock

from .test_supervisor_manager import FakeClient, FakeSpawner
from .test_supervisor_process import SPEC, manager_for

State = nodeagent_pb2.Replica.State
pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_cpu_lists_use_vllm_range_syntax() -> None:
    assert format_cpu_list([4, 0, 1, 2, 7, 6]) == "0-2,4,6-7"
    assert format_cpu_list([3]) == "3"


def test_replicas_get_disjoint_cores_until_the_node_is_full_then_nobind() -> None:
    pool = CpuCorePool(range(8), cores_per_rank=2, reserved=1)
    assert pool.assign("a") == "1-2"
    assert pool.assign("b") == "3-4"
    assert pool.assign("c") == "5-6"
    assert pool.assign("tp", ranks=2) == NOBIND  # not even one core per rank left
    assert pool.assign("d") == "7"  # one core left: less than wanted, but its own
    assert pool.assign("e") == NOBIND
    assert pool.free == ()
    assert pool.assign("a") == "1-2"  # a restart keeps its cores


def test_ranks_share_what_is_left_equally() -> None:
    pool = CpuCorePool(range(8), cores_per_rank=4, reserved=1)
    assert pool.assign("tp", ranks=2) == "1-3|4-6"  # 8 wanted, 7 free: 3 each
    assert pool.free == (7,)
    assert pool.held("tp") == [[1, 2, 3], [4, 5, 6]]


def test_tensor_parallel_ranks_get_one_list_each() -> None:
    pool = CpuCorePool(range(16), cores_per_rank=3, reserved=2)
    assert pool.assign("tp", ranks=2) == "2-4|5-7"
    assert pool.held("tp") == [[2, 3, 4], [5, 6, 7]]


def test_a_small_node_gives_its_free_core_to_one_engine_and_never_stacks_two() -> None:
    """2 cores (the local stack on a small box): the first engine gets core 1 to itself, the
    next one is left unbound rather than pinned to the same core (vLLM's auto binding would
    put both on core 0)."""
    pool = CpuCorePool([0, 1], cores_per_rank=2, reserved=1)
    assert [pool.assign("a"), pool.assign("b")] == ["1", NOBIND]
    pool.release("a")
    assert pool.assign("c") == "1"
    assert CpuCorePool([0], cores_per_rank=2, reserved=1).assign("a") == NOBIND
    assert CpuCorePool(range(64), cores_per_rank=0).assign("a") == NOBIND


def test_released_cores_go_back_to_the_pool() -> None:
    pool = CpuCorePool(range(6), cores_per_rank=2, reserved=1)
    assert [pool.assign("a"), pool.assign("b")] == ["1-2", "3-4"]
    pool.release("a")
    pool.release("a")  # idempotent
    pool.release("never-held")
    assert pool.free == (1, 2, 5)
    assert pool.assign("c") == "1-2"
    assert pool.held("a") == []


def fake_manager(
    tmp_path: Path, environ: dict[str, str]
) -> tuple[ReplicaManager, list[LaunchPlan]]:
    """The real planner (plan_launch) with in-memory engines; records every plan."""
    plans: list[LaunchPlan] = []

    class RecordingSpawner(FakeSpawner):
        async def spawn(self, plan: LaunchPlan):  # type: ignore[no-untyped-def]
            plans.append(plan)
            return await super().spawn(plan)

    spawner = RecordingSpawner([])
    manager = ReplicaManager(
        SupervisorConfig(data_dir=tmp_path, cpu=True, startup_poll_seconds=0.01),
        clock=FakeClock(),
        spawner=spawner,
        client_factory=lambda address: FakeClient(spawner, address),
        cores=CpuCorePool(range(8), cores_per_rank=2, reserved=1),
        environ=environ,
    )
    return manager, plans


def binds(plans: Sequence[LaunchPlan]) -> list[str | None]:
    return [plan.env.get(BIND_ENV) for plan in plans]


async def test_the_supervisor_binds_each_replica_and_frees_cores_on_stop(tmp_path: Path) -> None:
    manager, plans = fake_manager(tmp_path, environ={})
    spec = nodeagent_pb2.ReplicaSpec(model_source="/m", transport="grpc")
    for rid in ("r1", "r2"):
        await (await manager.start(rid, spec)).wait_for_state(State.STATE_READY, timeout=5)
    assert binds(plans) == ["1-2", "3-4"]
    await manager.stop("r1", force=True)
    assert manager.cores.free == (1, 2, 5, 6, 7)
    await (await manager.start("r3", spec)).wait_for_state(State.STATE_READY, timeout=5)
    assert binds(plans)[-1] == "1-2"
    await manager.close()
    assert manager.cores.free == tuple(range(1, 8))


async def test_an_explicit_bind_in_the_agent_environment_wins(tmp_path: Path) -> None:
    manager, plans = fake_manager(tmp_path, environ={BIND_ENV: "nobind"})
    replica = await manager.start(
        "r1", nodeagent_pb2.ReplicaSpec(model_source="/m", transport="grpc")
    )
    await replica.wait_for_state(State.STATE_READY, timeout=5)
    assert binds(plans) == [None]  # the inherited value reaches the engine unchanged
    assert plans[0].env[WAIT_POLICY_ENV] == PASSIVE  # an inherited nobind shares cores too
    assert manager.cores.held("r1") == []
    await manager.close()


async def test_the_started_engine_process_gets_its_cores(tmp_path: Path) -> None:
    """A real (fake-engine) process: its environment carries the bind list."""
    manager = ReplicaManager(
        manager_for(tmp_path).config,
        cores=CpuCorePool(range(8), cores_per_rank=2, reserved=1),
        environ={},
    )
    replica = await manager.start("r1", SPEC)
    try:
        await replica.wait_for_state(State.STATE_READY, timeout=20)
        environ = Path(f"/proc/{replica.pid}/environ").read_bytes().split(b"\0")
        assert f"{BIND_ENV}=1-2".encode() in environ
    finally:
        await manager.close()


def test_engines_sharing_cores_wait_passively_unless_the_agent_says_otherwise() -> None:
    assert thread_environment("1-2", {}) == {BIND_ENV: "1-2"}  # own cores: vLLM's settings
    assert thread_environment(NOBIND, {}) == {BIND_ENV: NOBIND, WAIT_POLICY_ENV: PASSIVE}
    assert thread_environment(None, {BIND_ENV: NOBIND}) == {WAIT_POLICY_ENV: PASSIVE}
    assert thread_environment(NOBIND, {WAIT_POLICY_ENV: "ACTIVE"}) == {BIND_ENV: NOBIND}
    assert thread_environment(None, {}) == {}


async def test_a_replica_beyond_the_free_cores_shares_them_and_waits_passively(
    tmp_path: Path,
) -> None:
    manager, plans = fake_manager(tmp_path, environ={})
    manager.cores = CpuCorePool(range(2), cores_per_rank=2, reserved=1)
    spec = nodeagent_pb2.ReplicaSpec(model_source="/m", transport="grpc")
    for rid in ("r1", "r2"):
        await (await manager.start(rid, spec)).wait_for_state(State.STATE_READY, timeout=5)
    assert binds(plans) == ["1", NOBIND]
    assert [p.env.get(WAIT_POLICY_ENV) for p in plans] == [None, PASSIVE]
    await manager.close()

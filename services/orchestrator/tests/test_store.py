"""The orchestrator's SQL stores (`SqlStateStore`, `SqlReleaseStore`) against real databases:
SQLite always, PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL` is set (`scripts/postgres.sh`
prints one). Only the orchestrator's own tables are dropped before each test, so the database
can be shared with other services' store tests (auth's).

Invariants: everything committed is loaded back equal (every field, aware UTC times with
microseconds, fractional GPU shares, byte counts past 2^32, the longest names validation
allows), by this store and by a new store on the same URL; a change that fails (a taken
deployment id or alias) writes nothing; the service keeps its state across a restart on
PostgreSQL as on SQLite.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, inspect, make_url
from sqlalchemy.exc import DBAPIError

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import (
    MAX_OWNED_BY,
    Accelerator,
    Autoscaling,
    Deployment,
    DeploymentProfile,
    RolloutStrategy,
)
from inferplane.orchestrator.fleet.model import (
    MAX_AGENT_VERSION,
    MAX_NODE_ADDRESS,
    MAX_NODE_NAME,
    EngineInstall,
    Gpu,
    GpuPartition,
    Node,
    NodeCapabilities,
    NodeCondition,
)
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.placement.model import Decision, Placement
from inferplane.orchestrator.release import matrix as compatibility_matrix
from inferplane.orchestrator.release import store as release_store
from inferplane.orchestrator.release.progress import Progress
from inferplane.orchestrator.release.store import ManagedReplica, Release, SqlReleaseStore, Stage
from inferplane.orchestrator.store import lease as lease_store
from inferplane.orchestrator.store import sql as state_store
from inferplane.orchestrator.store.base import StateChange, StateSnapshot
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.runtime import AlreadyExistsError
from inferplane.testing.clock import FakeClock
from inferplane.testing.databases import drop_schema

POSTGRES_URL = os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "")
GB = 10**9
# Microseconds, and a zone other than UTC going in: the store must give back the same instant
# as aware UTC.
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30)))
UINT32_MAX = 2**32 - 1  # counts are uint32 in the contract (replicas, max_replicas, cpu_count)
ORCHESTRATOR_TABLES = {
    "deployments",
    "deployment_aliases",
    "nodes",
    "placements",
    "managed_replicas",
    "releases",
    "leader_leases",
    "routing_tables",
    "router_grants",
    "autoscaler_decisions",
    "lora_adapters",
    "compatibility_verdicts",
    "forced_changes",
    "compatibility_grandfathered",
}
_METADATAS = (
    state_store._Base.metadata,
    release_store._Base.metadata,
    lease_store.METADATA,
    compatibility_matrix.METADATA,
)


def drop_orchestrator_tables(url: str) -> None:
    """Drops the orchestrator's tables and migration state only (other services' tables in the
    database stay)."""
    drop_schema(url, MIGRATIONS, _METADATAS)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'orchestrator.db'}"
    if not POSTGRES_URL:
        pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run the store tests on PostgreSQL")
    drop_orchestrator_tables(POSTGRES_URL)
    return POSTGRES_URL


@pytest.fixture
def open_store(url: str) -> Iterator[Callable[[], SqlStateStore]]:
    """Opens stores on the test's database (schema created twice: idempotent); all are closed
    at the end. Each call is a fresh store, as after a restart."""
    opened: list[SqlStateStore] = []

    def open_() -> SqlStateStore:
        s = SqlStateStore(url)
        opened.append(s)
        s.create_schema()
        s.create_schema()
        return s

    yield open_
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store: Callable[[], SqlStateStore]) -> SqlStateStore:
    return open_store()


def assert_no_defaults(value: Any) -> None:
    """Every field of the dataclass `value` differs from its default, so a round trip shows it
    is stored (a field added later without a column fails here first)."""
    for field in dataclasses.fields(value):
        if field.default is not dataclasses.MISSING:
            assert getattr(value, field.name) != field.default, (
                f"{type(value).__name__}.{field.name} is left at its default"
            )


def profile(n: int = 0, **changes: Any) -> DeploymentProfile:
    p = DeploymentProfile(
        model_source=f"/models/Llama-3.1-8B-Instruct-{n}",
        engine="vllm-cpu",
        engine_version="0.32.0",
        precision="fp32",
        parameter_count=8_030_000_000 + n,
        active_parameter_count=1_000_000_000,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_cache_dtype="fp8",
        tensor_parallel_size=2,
        max_model_len=8192,
        max_num_seqs=16,
        expected_context_tokens=4096,
        reasoning_parser="kimi_k2",
        tool_parser="qwen3",
        speculative_method="eagle",
        speculative_model="yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
        num_speculative_tokens=3,  # the store keeps what it is given (validation is apart)
        speculative_prompt_lookup_max=6,
        speculative_prompt_lookup_min=2,
        transport="grpc",
        stream_interval=4,
        constrain_tool_choice_auto=True,
        extra_engine_args=("--enforce-eager", "--seed=7", '--json={"a": [1, 2]}'),
        task="embed",
        sampling_defaults=(("repetition_penalty", 1.3), ("top_k", 20)),
        max_loras=4,
        max_lora_rank=64,
        ttft_slo_seconds=0.75,
        release_gates=(("min_tool_call_rate", 0.9), ("performance", True)),
    )
    return dataclasses.replace(p, **changes)


def deployment(deployment_id: str, *aliases: str, **changes: Any) -> Deployment:
    p = changes.pop("profile", profile())
    d = Deployment(
        deployment_id=deployment_id,
        profile=p,
        replicas=3,
        min_replicas=2,
        max_replicas=5,
        aliases=aliases,
        rollout=RolloutStrategy(
            max_surge=2,
            max_unavailable=1,
            max_error_rate=0.05,
            max_ttft_p99_seconds=1.25,
            gate_window_seconds=60,
            drain_grace_period_seconds=45,
            canary_percent=10,
            canary_window_seconds=90,
            canary_min_requests=30,
            max_canary_error_rate_increase=0.01,
            max_canary_ttft_p99_ratio=1.25,
            max_canary_tool_call_validity_drop=0.02,
        ),
        owned_by="team-ä/research",
        routing_policy="prefix_affinity",
        revision=p.revision(),
        create_time=T0,
        update_time=T0 + timedelta(seconds=1, microseconds=1),
        autoscaling=Autoscaling(True, True, 90, 600, 30, 6.5, 0.85),
    )
    return dataclasses.replace(d, **changes)


def gpu_node(name: str, **changes: Any) -> Node:
    n = Node(
        name=name,
        address="10.0.0.7:50052",
        gpus=(
            Gpu(0, 80 * GB, True, "NVIDIA H100 80GB HBM3", f"GPU-{name}-0", 3 * GB),
            Gpu(1, 80 * GB, True, "NVIDIA H100 80GB HBM3", f"GPU-{name}-1", 0),
            Gpu(
                2,
                80 * GB,
                False,
                "NVIDIA H100 80GB HBM3",
                f"GPU-{name}-2",
                1,
                (
                    GpuPartition(f"MIG-{name}-2-0", "3g.40gb", 40 * GB),
                    GpuPartition(f"MIG-{name}-2-1", "1g.10gb", 10 * GB),
                ),
            ),
        ),
        cpu_count=224,
        memory_bytes=2 * 10**12,
        labels=(("tier", "prod"), ("topology.kubernetes.io/zone", "eu-west-1a")),  # sorted
        agent_version="0.1.0+abcdef",
        condition=NodeCondition.DRAINING,
        unschedulable=True,
        last_heartbeat_time=T0 + timedelta(seconds=30, microseconds=999999),
        register_time=T0 - timedelta(days=1),
        engines=(
            EngineInstall("vllm", "0.32.0", "/opt/vllm-0.32/bin/python", True),
            EngineInstall("vllm", "0.31.0", "/opt/vllm-0.31/bin/python", False),
        ),
        capabilities=NodeCapabilities(
            cpu_features=("amx_bf16", "avx512f"),
            cpu_model="Intel(R) Xeon(R) Platinum 8480+",
            kv_cache_dtypes=("auto", "bf16", "fp16", "fp8"),
            speculative_methods=("eagle", "ngram"),
        ),
    )
    return dataclasses.replace(n, **changes)


def cpu_node(name: str) -> Node:
    """A CPU node as first registered: no GPUs, no labels, no times yet."""
    return Node(name=name, address="127.0.0.1:50052", cpu_count=2, memory_bytes=32 * GB)


def placement(replica_id: str, deployment_id: str, node: str, **changes: Any) -> Placement:
    p = Placement(
        replica_id=replica_id,
        deployment_id=deployment_id,
        revision=profile().revision(),
        node=node,
        accelerator=Accelerator.CPU,
        gpu_indices=(0, 2),
        memory_bytes_per_device=34_567_890_123,
        memory_fraction=0.4321,
        kv_cache_bytes=8_589_934_592,
        decision=Decision.KEPT,
        free_before_bytes=79_999_999_999,
        spread_rank=2,
    )
    return dataclasses.replace(p, **changes)


def full_state() -> StateSnapshot:
    """Three deployments (aliases in a non-sorted order; the longest id, alias and owner
    validation allows; the largest max_replicas), GPU nodes (one with the longest name, address
    and agent version registration allows and the largest CPU count) and a CPU node, and
    placements sharing GPU 0 of a GPU node."""
    long_id = "L" + "x" * 127
    long_alias = "moonshotai/" + "k" * 245
    deployments = (
        deployment("Model-B", "zz/last", "org/Model-B:v2", "a@1+x"),
        deployment(
            long_id,
            long_alias,
            profile=profile(1),
            owned_by="o" * MAX_OWNED_BY,
            max_replicas=UINT32_MAX,  # "no real bound" as a client may say it
        ),
        deployment("model-a", "a-alias", update_time=T0 + timedelta(hours=1)),
    )
    nodes = (
        gpu_node("gpu-a"),
        cpu_node("cpu-b"),
        gpu_node(
            "n" * MAX_NODE_NAME,
            address="a" * MAX_NODE_ADDRESS,
            agent_version="v" * MAX_AGENT_VERSION,
            cpu_count=UINT32_MAX,
            condition=NodeCondition.READY,
        ),
    )
    placements = (
        placement("Model-B-0", "Model-B", "gpu-a"),
        placement(
            "Model-B-1",
            "Model-B",
            "gpu-a",
            accelerator=Accelerator.GPU,
            gpu_indices=(0,),
            memory_fraction=0.25,
            decision=Decision.PLACED,
            spread_rank=1,
        ),
        placement(f"{long_id}-0", long_id, "cpu-b", gpu_indices=(), memory_fraction=0.8),
    )
    return StateSnapshot(deployments, nodes, placements)


def sorted_snapshot(s: StateSnapshot) -> StateSnapshot:
    return StateSnapshot(
        tuple(sorted(s.deployments, key=lambda d: d.deployment_id)),
        tuple(sorted(s.nodes, key=lambda n: n.name)),
        tuple(sorted(s.placements, key=lambda p: p.replica_id)),
    )


def commit_all(store: SqlStateStore, state: StateSnapshot) -> None:
    store.commit(
        StateChange(
            create_deployments=state.deployments,
            put_nodes=state.nodes,
            put_placements=state.placements,
        )
    )


def test_only_the_orchestrator_tables_are_created_and_dropped(url: str) -> None:
    """The orchestrator's table names are its own, and dropping them (as these tests do before
    each test) leaves another service's tables in a shared database alone."""
    engine = create_engine(url)
    neighbour = Table("not_the_orchestrators", MetaData(), Column("id", Integer, primary_key=True))
    try:
        neighbour.create(engine, checkfirst=True)
        s = SqlStateStore(url)
        s.create_schema()
        SqlReleaseStore(s.engine).create_schema()
        s.close()
        tables = set(inspect(engine).get_table_names())
        assert tables >= ORCHESTRATOR_TABLES
        assert {t for m in _METADATAS for t in m.tables} == ORCHESTRATOR_TABLES
        drop_orchestrator_tables(url)
        assert set(inspect(engine).get_table_names()) & ORCHESTRATOR_TABLES == set()
        assert "not_the_orchestrators" in inspect(engine).get_table_names()
    finally:
        neighbour.drop(engine, checkfirst=True)
        engine.dispose()


def test_round_trip_keeps_every_field(
    store: SqlStateStore, open_store: Callable[[], SqlStateStore]
) -> None:
    state = full_state()
    for value in (
        state.deployments[0],
        state.deployments[0].profile,
        state.deployments[0].rollout,
        state.nodes[0],
        state.nodes[0].gpus[2],
        state.placements[0],
    ):
        assert_no_defaults(value)
    assert store.load() == StateSnapshot()
    commit_all(store, state)

    expected = sorted_snapshot(state)
    loaded = store.load()
    assert loaded == expected
    assert open_store().load() == expected  # a new store on the same database: a restart
    got = next(d for d in loaded.deployments if d.deployment_id == "Model-B")
    assert got.aliases == ("zz/last", "org/Model-B:v2", "a@1+x")  # in the order given
    for when in (got.create_time, got.update_time, loaded.nodes[1].last_heartbeat_time):
        assert when is not None and when.tzinfo is UTC
    assert got.create_time is not None and got.create_time.microsecond == 123456
    assert got.create_time.hour == 6 and got.create_time.minute == 30  # 12:00 +05:30 in UTC
    shares = [p.memory_fraction for p in loaded.placements if p.deployment_id == "Model-B"]
    assert shares == [0.4321, 0.25]  # two replicas on GPU 0 of gpu-a


@pytest.fixture
def en_us_url(url: str) -> Iterator[str]:
    """The test's database on SQLite; on PostgreSQL a fresh database that collates like en-US
    (ICU), as servers initialised in an en_US locale do; dropped afterwards."""
    if not url.startswith("postgresql"):
        yield url
        return
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"{admin.url.database}_orchestrator_en_us"
    try:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
            try:
                c.exec_driver_sql(
                    f'CREATE DATABASE "{name}" TEMPLATE template0 '
                    "LOCALE_PROVIDER icu ICU_LOCALE 'en-US'"
                )
            except DBAPIError as exc:
                pytest.skip(f"this PostgreSQL cannot create an ICU en-US database: {exc.orig}")
        yield admin.url.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def test_load_sorts_by_key_in_code_point_order(en_us_url: str) -> None:
    """`StateSnapshot` tuples are sorted by key as Python sorts strings, whatever the database's
    collation (in en-US "model-a" comes before "Model-B"; SQLite sorts by code point)."""
    names = ["model-a", "Model-B", "a_b", "a-c", "Z9", "z10", "é", "e"]
    store = SqlStateStore(en_us_url)
    try:
        store.create_schema()
        commit_all(
            store,
            StateSnapshot(
                tuple(deployment(n) for n in names),
                tuple(cpu_node(n) for n in names),
                tuple(placement(f"{n}-0", n, n) for n in names),
            ),
        )
        loaded = store.load()
    finally:
        store.close()
    assert [d.deployment_id for d in loaded.deployments] == sorted(names)
    assert [n.name for n in loaded.nodes] == sorted(names)
    assert [p.replica_id for p in loaded.placements] == sorted(f"{n}-0" for n in names)


@pytest.mark.skipif(not POSTGRES_URL, reason="set INFERPLANE_TEST_POSTGRES_URL (a PostgreSQL test)")
def test_times_are_utc_whatever_the_postgresql_session_time_zone() -> None:
    """A server or role set to a local time zone hands timestamps back in that zone; the store
    gives the same instants as aware UTC (St John's: -03:30, a half-hour offset)."""
    drop_orchestrator_tables(POSTGRES_URL)
    url = make_url(POSTGRES_URL).update_query_dict({"options": "-c timezone=America/St_Johns"})
    local = SqlStateStore(url.render_as_string(hide_password=False))
    try:
        local.create_schema()
        with local.engine.connect() as c:
            assert c.exec_driver_sql("SHOW timezone").scalar() == "America/St_Johns"
        state = full_state()
        commit_all(local, state)
        loaded = local.load()
    finally:
        local.close()
    assert loaded == sorted_snapshot(state)
    times = [t for d in loaded.deployments for t in (d.create_time, d.update_time)]
    times += [n.last_heartbeat_time for n in loaded.nodes if n.last_heartbeat_time]
    assert times and all(t is not None and t.tzinfo is UTC for t in times)


def test_updates_and_deletions(
    store: SqlStateStore, open_store: Callable[[], SqlStateStore]
) -> None:
    state = full_state()
    commit_all(store, state)
    _, long_one, a = state.deployments
    gpu_a, cpu_b, _ = state.nodes
    b0, b1, long0 = state.placements

    # b gives "org/Model-B:v2" to a in the same change and changes its profile; a node turns
    # NotReady and uncordoned; b's replica 1 moves to the CPU node; the long one is deleted with
    # its placement.
    new_b = deployment(
        "Model-B",
        "a@1+x",
        "new/alias",
        profile=profile(2),
        replicas=1,
        min_replicas=0,
        max_replicas=0,
        update_time=T0 + timedelta(days=2, microseconds=7),
    )
    new_a = dataclasses.replace(a, aliases=("org/Model-B:v2", "a-alias"))
    new_gpu_a = dataclasses.replace(
        gpu_a,
        condition=NodeCondition.NOT_READY,
        unschedulable=False,
        gpus=gpu_a.gpus[:1],
        labels=(),
        last_heartbeat_time=None,
    )
    moved = dataclasses.replace(
        b1, node="cpu-b", gpu_indices=(), accelerator=Accelerator.CPU, decision=Decision.PLACED
    )
    store.commit(
        StateChange(
            put_deployments=(new_b, new_a),
            delete_deployments=(long_one.deployment_id,),
            put_nodes=(new_gpu_a,),
            put_placements=(moved,),
            delete_placements=(long0.replica_id, "never-existed-0"),
        )
    )
    expected = StateSnapshot((new_b, new_a), (cpu_b, new_gpu_a, state.nodes[2]), (b0, moved))
    assert store.load() == sorted_snapshot(expected)
    assert open_store().load() == sorted_snapshot(expected)

    # The deleted deployment's aliases are free again; a put of an unknown id inserts it.
    again = deployment("again", long_one.aliases[0])
    store.commit(StateChange(create_deployments=(again,)))
    fresh = deployment("fresh", "fresh-alias")
    store.commit(StateChange(put_deployments=(fresh,)))
    expected = dataclasses.replace(expected, deployments=(*expected.deployments, again, fresh))
    assert open_store().load() == sorted_snapshot(expected)


@pytest.mark.parametrize(
    "case",
    [
        "duplicate id",
        "alias taken by another deployment",
        "alias equal to another deployment's alias in the same change",
        "put takes another deployment's alias",
    ],
)
def test_a_failing_change_writes_nothing(
    store: SqlStateStore, open_store: Callable[[], SqlStateStore], case: str
) -> None:
    """A change refused for a taken id or alias leaves the store exactly as before: no
    deployment row, no alias, no node or placement of the same change, and the aliases a put
    deployment had are still there."""
    state = full_state()
    commit_all(store, state)
    before = store.load()
    b = state.deployments[0]
    a = state.deployments[2]
    if case == "duplicate id":
        bad = StateChange(
            create_deployments=(deployment("new", "new-alias"), deployment("model-a", "free"))
        )
    elif case == "alias taken by another deployment":
        bad = StateChange(create_deployments=(deployment("new", "new-alias", "org/Model-B:v2"),))
    elif case == "alias equal to another deployment's alias in the same change":
        bad = StateChange(
            create_deployments=(deployment("new1", "same"), deployment("new2", "same"))
        )
    else:
        bad = StateChange(put_deployments=(dataclasses.replace(b, aliases=(*a.aliases, "new")),))
    bad = dataclasses.replace(
        bad,
        delete_deployments=(state.deployments[1].deployment_id,),
        put_nodes=(cpu_node("gpu-a"), cpu_node("new-node")),
        put_placements=(placement("new-0", "new", "new-node"),),
        delete_placements=("Model-B-0",),
    )
    with pytest.raises(AlreadyExistsError) as info:
        store.commit(bad)
    assert info.value.reason == "DEPLOYMENT_EXISTS"
    assert store.load() == before
    assert open_store().load() == before
    store.commit(StateChange(create_deployments=(deployment("new", "new-alias"),)))  # still usable
    assert [d.deployment_id for d in store.load().deployments].count("new") == 1


def test_empty_change_writes_nothing(store: SqlStateStore) -> None:
    store.commit(StateChange())
    assert store.load() == StateSnapshot()


# ---- release store -------------------------------------------------------------------------


@pytest.fixture
def open_releases(url: str) -> Iterator[Callable[[], SqlReleaseStore]]:
    """Release stores on the state store's engine, as the service wires them; each call is a
    fresh pair (a restart)."""
    opened: list[SqlStateStore] = []

    def open_() -> SqlReleaseStore:
        s = SqlStateStore(url)
        opened.append(s)
        s.create_schema()
        releases = SqlReleaseStore(s.engine)
        releases.create_schema()
        releases.create_schema()
        return releases

    yield open_
    for s in opened:
        s.close()


def replica(node: str, replica_id: str, stage: Stage, **changes: Any) -> ManagedReplica:
    spec = nodeagent_pb2.ReplicaSpec(
        model_source="/models/kimi-tiny", extra_engine_args=["--seed", "\x00ü"]
    )
    r = ManagedReplica(
        node=node,
        replica_id=replica_id,
        deployment_id="Model-B",
        slot="Model-B-0",
        address="10.0.0.7:50052",
        revision=profile().revision(),
        stage=stage,
        stage_since=T0 + timedelta(microseconds=654321),
        spec=spec.SerializeToString(),
    )
    return dataclasses.replace(r, **changes)


def sorted_releases(
    loaded: tuple[list[ManagedReplica], list[Release]],
) -> tuple[list[ManagedReplica], list[Release]]:
    replicas, releases = loaded
    return sorted(replicas, key=lambda r: r.key), sorted(releases, key=lambda r: r.deployment_id)


def test_release_store_round_trip_updates_and_deletions(
    open_releases: Callable[[], SqlReleaseStore],
) -> None:
    store = open_releases()
    assert store.load() == ([], [])
    replicas = [
        replica("gpu-a", "model-b-0-0123abcd", Stage.STARTING),
        replica("gpu-a", "model-b-1-0123abcd", Stage.SERVING, slot="Model-B-1"),
        replica("n" * MAX_NODE_NAME, "r" * 63, Stage.RETIRING, spec=b"", address="a" * 300),
        # the same id on another node; any bytes, NULs included
        replica("cpu-b", "model-b-0-0123abcd", Stage.DRAINING, spec=b"\x00\xff\x00"),
    ]
    assert_no_defaults(replicas[0])
    verdict = pb.GateVerdict(
        gate="conformance",
        result="failed",
        reason="leaked \x00 markers",
        seconds=1.5,
        measurements={"tool_call_rate": 0.5},
        revision=profile(3).revision(),
    )
    verdict.decide_time.FromDatetime(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    pipeline = Progress(
        candidate_revision=profile(3).revision(),
        stage="RolledBack",
        canary_percent=10,
        verdicts=(verdict,),
        message="conformance gate failed",
        canary_since=datetime(2026, 1, 2, 3, 0, tzinfo=UTC),
        extensions=2,
        artifacts=replica_pb2.ReplicaArtifacts(engine="vllm-cpu", engine_version="0.32.0"),
    )
    releases = [
        Release(
            "Model-B",
            profile().revision(),
            profile(),
            profile(3).revision(),
            "x" * 5000,
            dataclasses.replace(pipeline, verdicts=(verdict,)),
        ),
        Release("model-a", serving_revision="abc", serving_profile=None),
        Release("L" + "x" * 127),
    ]
    assert_no_defaults(releases[0])
    for r in replicas:
        store.put_replica(r)
    for rel in releases:
        store.put_release(rel)

    shown_verdict = pb.GateVerdict()
    shown_verdict.CopyFrom(verdict)
    shown_verdict.reason = "leaked \ufffd markers"  # no NUL reaches PostgreSQL text
    releases[0] = dataclasses.replace(
        releases[0], progress=dataclasses.replace(pipeline, verdicts=(shown_verdict,))
    )
    expected = sorted_releases((replicas, releases))
    assert sorted_releases(store.load()) == expected
    assert sorted_releases(open_releases().load()) == expected
    loaded = sorted_releases(open_releases().load())[0]
    assert all(type(r.spec) is bytes and r.stage_since.tzinfo is UTC for r in loaded)
    assert loaded[1].spec_proto().extra_engine_args == ["--seed", "\x00ü"]

    # Upserts replace whole records; deletions remove one record; unknown ones are no-ops.
    moved_on = dataclasses.replace(
        replicas[0], stage=Stage.SERVING, stage_since=T0 + timedelta(minutes=3), spec=b"new"
    )
    store.put_replica(moved_on)
    store.delete_replica("gpu-a", "model-b-1-0123abcd")
    store.delete_replica("gpu-a", "never-existed")
    failed = dataclasses.replace(releases[0], failed_revision="", failure="", serving_profile=None)
    store.put_release(failed)
    store.delete_release("model-a")
    store.delete_release("never-existed")
    engine_said = Release("with-nul", "abc", failure="engine: \x00\x00 garbage")
    store.put_release(engine_said)  # PostgreSQL text cannot hold NUL: it becomes U+FFFD
    shown = dataclasses.replace(engine_said, failure="engine: \ufffd\ufffd garbage")
    expected = sorted_releases(([moved_on, replicas[2], replicas[3]], [failed, releases[2], shown]))
    assert sorted_releases(store.load()) == expected
    assert sorted_releases(open_releases().load()) == expected


# ---- the service on PostgreSQL -------------------------------------------------------------


@pytest.mark.skipif(
    not POSTGRES_URL,
    reason="set INFERPLANE_TEST_POSTGRES_URL to run the orchestrator service on PostgreSQL",
)
def test_service_keeps_its_state_across_a_restart_on_postgresql(tmp_path: Path, fx: Any) -> None:
    drop_orchestrator_tables(POSTGRES_URL)
    settings = fx.make_settings(tmp_path, database_url=POSTGRES_URL, reconcile=False)
    clock = FakeClock()
    request = pb.CreateDeploymentRequest(
        deployment_id="Llama-8B",
        deployment=fx.llama8b_proto(
            replicas=3, max_replicas=UINT32_MAX, aliases=["meta-llama/Llama-3.1-8B-Instruct"]
        ),
    )

    def state(orch: Any) -> tuple[Any, ...]:
        return (
            orch.deployments.GetDeployment(
                pb.GetDeploymentRequest(name="deployments/meta-llama/Llama-3.1-8B-Instruct"),
                timeout=10,
            ),
            orch.deployments.ListDeploymentReplicas(
                pb.ListDeploymentReplicasRequest(parent="deployments/Llama-8B"), timeout=10
            ),
            orch.nodes.ListNodes(pb.ListNodesRequest(), timeout=10),
        )

    with fx.running(settings, clock) as orch:
        for name in ("gpu-a", "gpu-b"):
            orch.nodes.RegisterNode(
                pb.RegisterNodeRequest(status=fx.gpu_status(name, gpus=2)), timeout=10
            )
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("cpu-c")), timeout=10)
        orch.nodes.DrainNode(pb.DrainNodeRequest(name="nodes/gpu-b"), timeout=10)
        created = orch.deployments.CreateDeployment(request, timeout=10).deployment
        clock.advance(0.000123)
        orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id="tiny", deployment=fx.tiny_cpu_proto()),
            timeout=10,
        )
        before = state(orch)
        placements = before[1].placements
        assert created.status.phase != "Unplaceable"
        assert [p.node for p in placements] == ["gpu-a"] * 3  # gpu-b is drained
        gpus = [i for p in placements for i in p.gpu_indices]
        assert len(gpus) > len(set(gpus))  # two replicas share one GPU
        assert all(0 < p.memory_fraction < 0.5 for p in placements)
    assert not list(tmp_path.glob("orchestrator.db*"))  # it ran on PostgreSQL, not SQLite

    clock.advance(3600)
    with fx.running(settings, clock) as orch:
        assert state(orch) == before
        assert orch.components.control.sweep() == []  # nodes get a fresh heartbeat timeout


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_values_a_column_cannot_hold_are_refused_alike(
    database: str, tmp_path: Path, fx: Any
) -> None:
    """A node name, address or agent version, or a deployment owner, longer than its column or
    with a NUL character is INVALID_ARGUMENT naming the field on every database (SQLite kept
    it; PostgreSQL refused it and the call failed with INTERNAL); values at the limit are
    kept."""
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'orchestrator.db'}"
    elif not POSTGRES_URL:
        pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run the service on PostgreSQL")
    else:
        url = POSTGRES_URL
        drop_orchestrator_tables(url)
    settings = fx.make_settings(tmp_path, database_url=url, reconcile=False)

    def refused(call: Callable[[str], Any], value: str, field: str, limit: int) -> None:
        with pytest.raises(grpc.RpcError) as info:
            call(value)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        if "\x00" in value:
            assert info.value.details() == f"{field} must not contain NUL characters"
        else:
            assert info.value.details().startswith(f"{field} must be at most {limit} characters")

    with fx.running(settings, FakeClock()) as orch:

        def register(**changes: str) -> Any:
            status = fx.gpu_status("gpu-a")
            for name, value in changes.items():
                setattr(status, name, value)
            return orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=status), timeout=10)

        def heartbeat(**changes: str) -> Any:
            status = fx.gpu_status("gpu-a")
            for name, value in changes.items():
                setattr(status, name, value)
            beats = iter([pb.StreamHeartbeatsRequest(status=status)])
            return list(orch.nodes.StreamHeartbeats(beats, timeout=10))

        limits = (
            ("node", MAX_NODE_NAME),
            ("address", MAX_NODE_ADDRESS),
            ("agent_version", MAX_AGENT_VERSION),
        )
        for field, limit in limits:
            too_long = "x" * (limit + 1)
            refused(lambda v, f=field: register(**{f: v}), too_long, f"status.{field}", limit)
            refused(lambda v, f=field: heartbeat(**{f: v}), too_long, f"status.{field}", limit)
            refused(lambda v, f=field: register(**{f: v}), "a\x00b", f"status.{field}", limit)
            register(**{field: "x" * limit})
        heartbeat(address="y" * MAX_NODE_ADDRESS, agent_version="y" * MAX_AGENT_VERSION)

        def create(owned_by: str) -> Any:
            deployment = fx.llama8b_proto(owned_by=owned_by)
            request = pb.CreateDeploymentRequest(deployment_id="m", deployment=deployment)
            return orch.deployments.CreateDeployment(request, timeout=10)

        def set_owner(owned_by: str) -> Any:
            request = pb.UpdateDeploymentRequest(
                deployment=pb.Deployment(name="deployments/m", owned_by=owned_by),
                update_mask=field_mask_pb2.FieldMask(paths=["owned_by"]),
            )
            return orch.deployments.UpdateDeployment(request, timeout=10)

        refused(create, "o" * (MAX_OWNED_BY + 1), "owned_by", MAX_OWNED_BY)
        create("o" * MAX_OWNED_BY)
        refused(set_owner, "p" * (MAX_OWNED_BY + 1), "owned_by", MAX_OWNED_BY)
        refused(set_owner, "acme\x00", "owned_by", MAX_OWNED_BY)
        nodes = {n.name for n in orch.components.store.load().nodes}
    assert nodes == {"gpu-a", "x" * MAX_NODE_NAME}
    with fx.running(settings, FakeClock()) as orch:
        got = orch.deployments.GetDeployment(pb.GetDeploymentRequest(name="deployments/m"))
        assert got.deployment.owned_by == "o" * MAX_OWNED_BY
        node = orch.nodes.GetNode(pb.GetNodeRequest(name="nodes/gpu-a"), timeout=10).node
        assert node.status.address == "y" * MAX_NODE_ADDRESS
        assert node.status.agent_version == "y" * MAX_AGENT_VERSION

"""The orchestrator database's migrations (`services/orchestrator/migrations/`) on SQLite, and on
PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL` is set (each test gets a database of its own).

Invariants: a fresh database migrated to head has exactly the models' schema (what `alembic
check` checks); a database made by the code before migrations (`previous_schema`, a frozen copy
of what its `create_all` made, in both of its versions: INTEGER counts until 2026-11-23, BIGINT
after) is upgraded in place when the stores start: every row loads back equal, its schema is
then the models' exactly, and it holds the contract's uint32 maximum (the INTEGER version on
PostgreSQL refused it: 0002); the service starts on it and serves what it held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    insert,
)

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import (
    Accelerator,
    Deployment,
    DeploymentProfile,
    RolloutStrategy,
)
from inferplane.orchestrator.fleet.model import Node, NodeCondition
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.placement.model import Decision, Placement
from inferplane.orchestrator.release import matrix as compatibility_matrix
from inferplane.orchestrator.release import store as release_store
from inferplane.orchestrator.release.store import ManagedReplica, Release, SqlReleaseStore, Stage
from inferplane.orchestrator.store import lease as lease_store
from inferplane.orchestrator.store import sql as state_store
from inferplane.orchestrator.store.base import StateChange, StateSnapshot
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.storage import schema_differences
from inferplane.testing.clock import FakeClock
from inferplane.testing.databases import database_or_skip, version_rows

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
GB = 10**9
UINT32_MAX = 2**32 - 1
HEAD = "0009"
METADATA = [
    state_store.METADATA,
    release_store.METADATA,
    lease_store.METADATA,
    compatibility_matrix.METADATA,
]


def previous_schema(count: type[Integer]) -> MetaData:
    """The tables `create_all` made before migrations existed (until 2026-11-25), frozen here:
    the models may change, this may not. `count` is the type of a deployment's replica counts
    and a node's cpu_count: Integer until 2026-11-23, BigInteger after."""
    md = MetaData()
    time = DateTime(timezone=True)
    Table(
        "deployments",
        md,
        Column("deployment_id", String(128), primary_key=True),
        Column("profile", JSON, nullable=False),
        Column("revision", String(32), nullable=False),
        Column("replicas", count, nullable=False),
        Column("min_replicas", count, nullable=False),
        Column("max_replicas", count, nullable=False),
        Column("rollout", JSON, nullable=False),
        Column("owned_by", String(200), nullable=False),
        Column("routing_policy", String(64), nullable=False),
        Column("create_time", time, nullable=False),
        Column("update_time", time, nullable=False),
    )
    Table(
        "deployment_aliases",
        md,
        Column("alias", String(256), primary_key=True),
        Column("deployment_id", String(128), nullable=False, index=True),
        Column("position", Integer, nullable=False),
    )
    Table(
        "nodes",
        md,
        Column("name", String(253), primary_key=True),
        Column("address", String(300), nullable=False),
        Column("gpus", JSON, nullable=False),
        Column("cpu_count", count, nullable=False),
        Column("memory_bytes", BigInteger, nullable=False),
        Column("labels", JSON, nullable=False),
        Column("agent_version", String(64), nullable=False),
        Column("condition", String(16), nullable=False),
        Column("unschedulable", Boolean, nullable=False),
        Column("last_heartbeat_time", time),
        Column("register_time", time),
    )
    Table(
        "placements",
        md,
        Column("replica_id", String(160), primary_key=True),
        Column("deployment_id", String(128), nullable=False, index=True),
        Column("revision", String(32), nullable=False),
        Column("node", String(253), nullable=False, index=True),
        Column("accelerator", String(8), nullable=False),
        Column("gpu_indices", JSON, nullable=False),
        Column("memory_bytes_per_device", BigInteger, nullable=False),
        Column("memory_fraction", Float, nullable=False),
        Column("kv_cache_bytes", BigInteger, nullable=False),
        Column("decision", String(16), nullable=False),
        Column("free_before_bytes", BigInteger, nullable=False),
        Column("spread_rank", Integer, nullable=False),
    )
    Table(
        "managed_replicas",
        md,
        Column("node", String(253), primary_key=True),
        Column("replica_id", String(63), primary_key=True),
        Column("deployment_id", String(128), nullable=False, index=True),
        Column("slot", String(160), nullable=False),
        Column("address", String(300), nullable=False),
        Column("revision", String(32), nullable=False),
        Column("stage", String(16), nullable=False),
        Column("stage_since", time, nullable=False),
        Column("spec", LargeBinary, nullable=False),
    )
    Table(
        "releases",
        md,
        Column("deployment_id", String(128), primary_key=True),
        Column("serving_revision", String(32), nullable=False),
        Column("serving_profile", JSON, nullable=True),
        Column("failed_revision", String(32), nullable=False),
        Column("failure", Text, nullable=False),
    )
    return md


PROFILE = DeploymentProfile(
    model_source="/models/kimi-tiny",
    engine="vllm-cpu",
    precision="fp32",
    parameter_count=750_000,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    max_model_len=512,
    max_num_seqs=4,
    extra_engine_args=("--enforce-eager",),
)
DEPLOYMENT = Deployment(
    deployment_id="tiny",
    profile=PROFILE,
    replicas=1,
    min_replicas=1,
    max_replicas=3,
    aliases=("kimi-tiny", "tiny-latest"),
    rollout=RolloutStrategy(max_surge=2),
    owned_by="team-a",
    routing_policy="least_load",
    revision=PROFILE.revision(),
    create_time=T0,
    update_time=T0,
)
NODE = Node(
    name="cpu-a",
    address="127.0.0.1:50052",
    gpus=(),
    cpu_count=2,
    memory_bytes=32 * GB,
    labels=(("zone", "a"),),
    agent_version="0.1.0",
    condition=NodeCondition.READY,
    unschedulable=False,
    last_heartbeat_time=T0,
    register_time=T0,
)
PLACEMENT = Placement(
    replica_id="tiny-0",
    deployment_id="tiny",
    revision=DEPLOYMENT.revision,
    node="cpu-a",
    accelerator=Accelerator.CPU,
    gpu_indices=(),
    memory_bytes_per_device=2 * GB,
    memory_fraction=0.0625,
    kv_cache_bytes=GB,
    decision=Decision.PLACED,
    free_before_bytes=25 * GB,
    spread_rank=0,
)
REPLICA = ManagedReplica(
    node="cpu-a",
    replica_id=f"tiny-0-{DEPLOYMENT.revision[:8]}",
    deployment_id="tiny",
    slot="tiny-0",
    address="127.0.0.1:50052",
    revision=DEPLOYMENT.revision,
    stage=Stage.SERVING,
    stage_since=T0,
    spec=b"\x00\x01spec",
)
RELEASE = Release(
    deployment_id="tiny",
    serving_revision=DEPLOYMENT.revision,
    serving_profile=PROFILE,
    failed_revision="f" * 32,
    failure="warm-up failed",
)


def profile_json(profile: DeploymentProfile) -> dict[str, Any]:
    return {**dataclasses.asdict(profile), "extra_engine_args": list(profile.extra_engine_args)}


def make_previous_database(url: str, count: type[Integer]) -> None:
    """A database as the previous code left it: its tables and one row of each kind."""
    md = previous_schema(count)
    t = md.tables
    engine = create_engine(url)
    try:
        md.create_all(engine)
        with engine.begin() as conn:
            d = DEPLOYMENT
            conn.execute(
                insert(t["deployments"]).values(
                    deployment_id=d.deployment_id,
                    profile=profile_json(d.profile),
                    revision=d.revision,
                    replicas=d.replicas,
                    min_replicas=d.min_replicas,
                    max_replicas=d.max_replicas,
                    rollout=dataclasses.asdict(d.rollout),
                    owned_by=d.owned_by,
                    routing_policy=d.routing_policy,
                    create_time=d.create_time,
                    update_time=d.update_time,
                )
            )
            for position, alias in enumerate(d.aliases):
                conn.execute(
                    insert(t["deployment_aliases"]).values(
                        alias=alias, deployment_id=d.deployment_id, position=position
                    )
                )
            n = NODE
            conn.execute(
                insert(t["nodes"]).values(
                    name=n.name,
                    address=n.address,
                    gpus=[],
                    cpu_count=n.cpu_count,
                    memory_bytes=n.memory_bytes,
                    labels=dict(n.labels),
                    agent_version=n.agent_version,
                    condition=n.condition.value,
                    unschedulable=n.unschedulable,
                    last_heartbeat_time=n.last_heartbeat_time,
                    register_time=n.register_time,
                )
            )
            p = PLACEMENT
            conn.execute(
                insert(t["placements"]).values(
                    replica_id=p.replica_id,
                    deployment_id=p.deployment_id,
                    revision=p.revision,
                    node=p.node,
                    accelerator=p.accelerator.value,
                    gpu_indices=list(p.gpu_indices),
                    memory_bytes_per_device=p.memory_bytes_per_device,
                    memory_fraction=p.memory_fraction,
                    kv_cache_bytes=p.kv_cache_bytes,
                    decision=p.decision.value,
                    free_before_bytes=p.free_before_bytes,
                    spread_rank=p.spread_rank,
                )
            )
            r = REPLICA
            conn.execute(
                insert(t["managed_replicas"]).values(
                    node=r.node,
                    replica_id=r.replica_id,
                    deployment_id=r.deployment_id,
                    slot=r.slot,
                    address=r.address,
                    revision=r.revision,
                    stage=r.stage.value,
                    stage_since=r.stage_since,
                    spec=r.spec,
                )
            )
            conn.execute(
                insert(t["releases"]).values(
                    deployment_id=RELEASE.deployment_id,
                    serving_revision=RELEASE.serving_revision,
                    serving_profile=profile_json(PROFILE),
                    failed_revision=RELEASE.failed_revision,
                    failure=RELEASE.failure,
                )
            )
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_or_skip(request.param, tmp_path) as database:
        yield database


def test_a_fresh_database_has_exactly_the_models_schema(url: str) -> None:
    store = SqlStateStore(url)
    try:
        store.create_schema()
        SqlReleaseStore(store.engine).create_schema()  # the same database: finds it at head
        assert schema_differences(store.engine, MIGRATIONS, METADATA) == []
    finally:
        store.close()
    assert version_rows(url, MIGRATIONS) == [(HEAD,)]


@pytest.mark.parametrize("count", [Integer, BigInteger], ids=["integer-counts", "bigint-counts"])
def test_a_database_from_before_migrations_is_upgraded_in_place(
    url: str, count: type[Integer]
) -> None:
    make_previous_database(url, count)
    store = SqlStateStore(url)
    try:
        releases = SqlReleaseStore(store.engine)
        store.create_schema()  # as the service's start-up does
        releases.create_schema()
        assert version_rows(url, MIGRATIONS) == [(HEAD,)]
        assert schema_differences(store.engine, MIGRATIONS, METADATA) == []

        assert store.load() == StateSnapshot((DEPLOYMENT,), (NODE,), (PLACEMENT,))
        assert releases.load() == ([REPLICA], [RELEASE])
        # 0007: what existed is grandfathered (recorded "unqualified" once its replicas report).
        matrix = compatibility_matrix.CompatibilityMatrix(store.engine)
        assert matrix.grandfathered() == {(DEPLOYMENT.deployment_id, DEPLOYMENT.revision)}

        wide = dataclasses.replace(DEPLOYMENT, max_replicas=UINT32_MAX)
        big = dataclasses.replace(NODE, cpu_count=UINT32_MAX)
        store.commit(StateChange(put_deployments=(wide,), put_nodes=(big,)))
        assert store.load() == StateSnapshot((wide,), (big,), (PLACEMENT,))
    finally:
        store.close()


def test_the_service_starts_on_a_database_from_before_migrations(
    url: str, tmp_path: Path, fx: Any
) -> None:
    make_previous_database(url, Integer)
    settings = fx.make_settings(tmp_path, database_url=url, reconcile=False)
    with fx.running(settings, FakeClock()) as orch:
        got = orch.deployments.GetDeployment(
            pb.GetDeploymentRequest(name="deployments/kimi-tiny"), timeout=10
        ).deployment
        assert (got.name, list(got.aliases)) == ("deployments/tiny", ["kimi-tiny", "tiny-latest"])
        created = orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(
                deployment_id="wide", deployment=fx.tiny_cpu_proto(max_replicas=UINT32_MAX)
            ),
            timeout=10,
        ).deployment
        assert created.max_replicas == UINT32_MAX
    assert version_rows(url, MIGRATIONS) == [(HEAD,)]

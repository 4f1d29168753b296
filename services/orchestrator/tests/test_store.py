"""The orchestrator's SQL stores (`SqlStateStore`, `SqlReleaseStore`) against real databases:
SQLite always, PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL` is set (`scripts/postgres.sh`
prints one). Only the orchestrator's own tables are dropped before each test, so the database
can be shared with other services' store tests (auth's).

Invariants: everything committed is loaded back equal (every field, aware UTC times with
microseconds, fractional GPU shares, byte counts past 2^32, the longest names validation
allows), by this store and by a new store on the same URL; a change that fails (a taken
deployment id or alias) writes nothing. The service on each database is in
`test_store_service.py`, the builders in `store_data.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, inspect, make_url
from sqlalchemy.exc import DBAPIError

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import Accelerator
from inferplane.orchestrator.fleet.model import MAX_NODE_NAME, NodeCondition
from inferplane.orchestrator.placement.model import Decision
from inferplane.orchestrator.release.progress import Progress
from inferplane.orchestrator.release.store import ManagedReplica, Release, SqlReleaseStore, Stage
from inferplane.orchestrator.store.base import StateChange, StateSnapshot
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.runtime import AlreadyExistsError

from .store_data import (
    METADATAS,
    ORCHESTRATOR_TABLES,
    POSTGRES_URL,
    T0,
    assert_no_defaults,
    commit_all,
    cpu_node,
    deployment,
    drop_orchestrator_tables,
    full_state,
    placement,
    profile,
    sorted_snapshot,
)


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
        assert {t for m in METADATAS for t in m.tables} == ORCHESTRATOR_TABLES
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

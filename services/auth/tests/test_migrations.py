"""The auth database's migrations (`services/auth/migrations/`) on SQLite, and on PostgreSQL when
`INFERPLANE_TEST_POSTGRES_URL` is set (each test gets a database of its own).

Invariants: a fresh database migrated to head has exactly the models' schema (what `alembic
check` checks); a database made by the code before migrations (`previous_schema`, a frozen copy
of what its `create_all` made) is upgraded in place when a store starts: its keys, audit log,
counters and leases stay readable and in force, and its schema is then the models' exactly,
also when it lacked the counter tables (`limits_store` "memory"); the service starts on it and
a key created before the upgrade still authenticates.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
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
    Index,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    inspect,
)

from inferplane.auth import schema
from inferplane.auth.counters import SqlCounterStore
from inferplane.auth.domain import ApiKey, AuditAction, AuditEvent, Limits, SecretHasher
from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.sql_store import SqlApiKeyStore
from inferplane.storage import schema_differences
from inferplane.testing.databases import database_or_skip, version_rows

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
HEAD = "0008"
PEPPER = "pepper-for-the-migration-tests"
SECRET = "ip-" + "a" * 43
METADATA = list(schema.METADATA)


def previous_schema(*, with_counters: bool) -> MetaData:
    """The tables `create_all` made before migrations existed (until 2026-11-25), frozen here:
    the models may change, this may not. The counter tables existed only with `limits_store`
    "sql"."""
    md = MetaData()
    time = DateTime(timezone=True)
    Table(
        "api_keys",
        md,
        Column("key_id", String(32), primary_key=True),
        Column("display_name", String(200), nullable=False),
        Column("tenant", String(128), nullable=False, index=True),
        Column("scopes", JSON, nullable=False),
        Column("has_admin_scope", Boolean, nullable=False),
        Column("allowed_models", JSON, nullable=False),
        Column("expire_time", time),
        Column("requests_per_minute", Integer, nullable=False),
        Column("tokens_per_minute", Integer, nullable=False),
        Column("max_concurrent_requests", Integer, nullable=False),
        Column("tier", String(32), nullable=False),
        Column("key_prefix", String(16), nullable=False),
        Column("secret_hash", String(64), nullable=False, unique=True),
        Column("previous_secret_hash", String(64), index=True),
        Column("previous_secret_expire_time", time),
        Column("create_time", time, nullable=False),
        Column("update_time", time, nullable=False),
        Column("last_used_time", time),
        Column("revoke_time", time),
        Index("ix_api_keys_create_time_key_id", "create_time", "key_id"),
    )
    Table(
        "api_key_audit_log",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("time", time, nullable=False),
        Column("action", String(16), nullable=False),
        Column("key_id", String(32), nullable=False, index=True),
        Column("actor_key_id", String(32), nullable=False),
        Column("tenant", String(128), nullable=False),
        Column("detail", JSON, nullable=False),
    )
    if with_counters:
        count = BigInteger().with_variant(Integer, "sqlite")
        Table(
            "rate_counters",
            md,
            Column("key_id", String(32), primary_key=True),
            Column("window", count, primary_key=True),
            Column("requests", count, nullable=False),
            Column("tokens", count, nullable=False),
        )
        Table(
            "concurrency_leases",
            md,
            Column("key_id", String(32), primary_key=True),
            Column("request_id", String(128), primary_key=True),
            Column("expire_at", Float, nullable=False, index=True),
        )
    return md


KEY = ApiKey(
    key_id="k1",
    display_name="made before migrations",
    tenant="acme",
    scopes=("inference", "admin"),
    allowed_models=("llama",),
    expire_time=None,
    limits=Limits(requests_per_minute=2, tokens_per_minute=10, max_concurrent_requests=1),
    tier="standard",
    key_prefix=SECRET[:8],
    secret_hash=SecretHasher(PEPPER.encode()).hash(SECRET),
    create_time=T0,
    update_time=T0,
    last_used_time=T0 + timedelta(minutes=1),
)
AUDIT = AuditEvent(T0, AuditAction.CREATE, "k1", "admin0", "acme", {"why": "before"})


def make_previous_database(url: str, *, with_counters: bool) -> None:
    """A database as the previous code left it: its tables, one key, its audit entry, and (with
    counters) a window at the key's request limit and a live lease."""
    md = previous_schema(with_counters=with_counters)
    engine = create_engine(url)
    try:
        md.create_all(engine)
        with engine.begin() as conn:
            conn.execute(
                insert(md.tables["api_keys"]).values(
                    key_id=KEY.key_id,
                    display_name=KEY.display_name,
                    tenant=KEY.tenant,
                    scopes=list(KEY.scopes),
                    has_admin_scope=True,
                    allowed_models=list(KEY.allowed_models),
                    expire_time=None,
                    requests_per_minute=2,
                    tokens_per_minute=10,
                    max_concurrent_requests=1,
                    tier=KEY.tier,
                    key_prefix=KEY.key_prefix,
                    secret_hash=KEY.secret_hash,
                    create_time=T0,
                    update_time=T0,
                    last_used_time=KEY.last_used_time,
                )
            )
            conn.execute(
                insert(md.tables["api_key_audit_log"]).values(
                    time=T0,
                    action="create",
                    key_id="k1",
                    actor_key_id="admin0",
                    tenant="acme",
                    detail={"why": "before"},
                )
            )
            if with_counters:
                conn.execute(
                    insert(md.tables["rate_counters"]).values(
                        key_id="k1", window=100, requests=2, tokens=7
                    )
                )
                conn.execute(
                    insert(md.tables["concurrency_leases"]).values(
                        key_id="k1", request_id="r1", expire_at=500.0
                    )
                )
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_or_skip(request.param, tmp_path) as database:
        yield database


def test_a_fresh_database_has_exactly_the_models_schema(url: str) -> None:
    keys, limits = SqlApiKeyStore(url), SqlCounterStore(url)
    try:
        keys.create_schema()
        limits.create_schema()  # the same database: finds it at head
        assert schema_differences(keys.engine, MIGRATIONS, METADATA) == []
        assert set(inspect(keys.engine).get_table_names()) == {
            "api_keys",
            "api_key_audit_log",
            "rate_counters",
            "concurrency_leases",
            "usage_ledger",
            "usage_monthly",
            "stored_responses",
            "peer_key_entries",
            MIGRATIONS.version_table,
        }
    finally:
        keys.close()
        limits.close()
    assert version_rows(url, MIGRATIONS) == [(HEAD,)]


@pytest.mark.parametrize("with_counters", [True, False], ids=["sql-limits", "memory-limits"])
def test_a_database_from_before_migrations_is_upgraded_in_place(
    url: str, with_counters: bool
) -> None:
    make_previous_database(url, with_counters=with_counters)
    keys, limits = SqlApiKeyStore(url), SqlCounterStore(url)
    try:
        keys.create_schema()
        limits.create_schema()
        assert version_rows(url, MIGRATIONS) == [(HEAD,)]
        assert schema_differences(keys.engine, MIGRATIONS, METADATA) == []

        assert keys.get("k1") == KEY
        assert keys.find_by_secret_hash(KEY.secret_hash) == KEY
        assert keys.has_active_admin(T0)
        assert keys.audit_events("k1") == [AUDIT]

        rpm = limits.try_admit("k1", "r2", Limits(requests_per_minute=2), 100, 0.0, 600.0)
        conc = limits.try_admit("k1", "r3", Limits(max_concurrent_requests=1), 101, 0.0, 600.0)
        if with_counters:  # the window's count and the live lease are still in force
            assert (rpm.refused, rpm.requests, rpm.tokens) == ("requests", 2, 7)
            assert conc.refused == "concurrency"
        else:  # the counter tables were created empty
            assert (rpm.refused, conc.refused) == (None, None)
    finally:
        keys.close()
        limits.close()


def test_the_service_starts_on_a_database_from_before_migrations(
    url: str, tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    make_previous_database(url, with_counters=True)
    settings = make_settings(tmp_path, database_url=url, pepper=PEPPER)
    with start_auth(settings) as auth:
        assert auth.check(SECRET).status.code == 0  # the key made before still authenticates
    assert version_rows(url, MIGRATIONS) == [(HEAD,)]

"""SqlApiKeyStore against real databases: SQLite always, PostgreSQL when
`INFERPLANE_TEST_POSTGRES_URL` is set (e.g. `postgresql+psycopg://postgres@127.0.0.1:5432/auth_test`;
the tables are dropped before each test, so point it at a throw-away database).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from inferplane.auth import schema
from inferplane.auth.domain import ApiKey, AuditAction, AuditEvent, Limits
from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.sql_store import SqlApiKeyStore
from inferplane.auth.store import ListQuery
from inferplane.runtime import AlreadyExistsError, NotFoundError
from inferplane.testing.databases import drop_schema

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
POSTGRES_URL = os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlApiKeyStore]:
    if request.param == "sqlite":
        s = SqlApiKeyStore(f"sqlite:///{tmp_path / 'auth.db'}")
    else:
        if not POSTGRES_URL:
            pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run the store tests on PostgreSQL")
        # Every auth table (other tests share the server's database), so it migrates afresh.
        drop_schema(POSTGRES_URL, MIGRATIONS, schema.METADATA)
        s = SqlApiKeyStore(POSTGRES_URL)
    s.create_schema()
    s.create_schema()  # idempotent
    yield s
    s.close()


def key(n: int, **changes: object) -> ApiKey:
    base = ApiKey(
        key_id=f"k{n:04d}",
        display_name=f"key {n}",
        tenant="acme",
        scopes=("inference",),
        allowed_models=(),
        expire_time=None,
        limits=Limits(),
        tier="standard",
        key_prefix="ip-abcde",
        secret_hash=f"{n:064x}",
        create_time=T0 + timedelta(seconds=n),
        update_time=T0 + timedelta(seconds=n),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def event(k: ApiKey, action: AuditAction = AuditAction.CREATE) -> AuditEvent:
    return AuditEvent(k.update_time, action, k.key_id, "admin1", k.tenant, {"why": "test"})


def test_round_trip_keeps_every_field_and_utc(store: SqlApiKeyStore) -> None:
    k = key(
        1,
        scopes=("inference", "admin"),
        allowed_models=("kimi-tiny", "org/model:v2"),
        expire_time=T0 + timedelta(days=30),
        limits=Limits(1, 2, 3),
        previous_secret_hash="f" * 64,
        previous_secret_expire_time=T0 + timedelta(minutes=5),
    )
    store.insert(k, event(k))
    assert store.get(k.key_id) == k
    assert store.get("nope") is None
    assert store.find_by_secret_hash(k.secret_hash) == k
    assert store.find_by_secret_hash("f" * 64) == k  # the rotated-out secret
    assert store.find_by_secret_hash("0" * 64) is None
    assert store.get(k.key_id).create_time.tzinfo is not None  # type: ignore[union-attr]


def test_list_orders_filters_and_pages(store: SqlApiKeyStore) -> None:
    keys = [key(i, tenant="a" if i % 2 else "b") for i in range(6)]
    keys[3] = dataclasses.replace(keys[3], revoke_time=T0)
    keys[4] = dataclasses.replace(keys[4], expire_time=T0 + timedelta(hours=1))
    for k in keys:
        store.insert(k, event(k))
    now = T0 + timedelta(hours=2)  # key 4 has expired by then

    def ids(**kw: object) -> list[str]:
        query = ListQuery(**{"limit": 100, "now": now, **kw})  # type: ignore[arg-type]
        return [k.key_id for k in store.list_keys(query)]

    assert ids() == ["k0005", "k0002", "k0001", "k0000"]
    assert ids(include_inactive=True) == [f"k{i:04d}" for i in range(5, -1, -1)]
    assert ids(tenant="a") == ["k0005", "k0001"]
    after = (keys[2].create_time, keys[2].key_id)
    assert ids(include_inactive=True, after=after, limit=2) == ["k0001", "k0000"]


def test_same_create_time_pages_by_key_id(store: SqlApiKeyStore) -> None:
    for i in range(3):
        k = key(i, create_time=T0)
        store.insert(k, event(k))
    first = store.list_keys(ListQuery(limit=2, now=T0))
    rest = store.list_keys(ListQuery(limit=2, now=T0, after=(T0, first[-1].key_id)))
    assert [k.key_id for k in [*first, *rest]] == ["k0002", "k0001", "k0000"]


def test_a_failing_change_writes_nothing(store: SqlApiKeyStore) -> None:
    k = key(1)
    store.insert(k, event(k))

    def change(current: ApiKey) -> tuple[ApiKey, AuditEvent | None]:
        raise ValueError("refused half-way")

    with pytest.raises(ValueError):
        store.update(k.key_id, change)
    assert store.get(k.key_id) == k
    assert [e.action for e in store.audit_events(k.key_id)] == [AuditAction.CREATE]
    with pytest.raises(NotFoundError):
        store.update("missing", lambda c: (c, None))


def test_update_and_its_audit_event_commit_together(store: SqlApiKeyStore) -> None:
    k = key(1)
    store.insert(k, event(k))
    new = store.update(
        k.key_id,
        lambda c: (
            dataclasses.replace(c, display_name="renamed"),
            event(c, AuditAction.UPDATE),
        ),
    )
    assert store.get(k.key_id) == new and new.display_name == "renamed"
    unchanged = store.update(k.key_id, lambda c: (dataclasses.replace(c, tier="x"), None))
    assert unchanged.tier == "x" and store.get(k.key_id).tier == "standard"  # type: ignore[union-attr]
    events = store.audit_events(k.key_id)
    assert [e.action for e in events] == [AuditAction.CREATE, AuditAction.UPDATE]
    assert events[1] == event(k, AuditAction.UPDATE)


def test_duplicate_secret_hash_is_refused_without_an_audit_row(store: SqlApiKeyStore) -> None:
    k = key(1)
    store.insert(k, event(k))
    twin = key(2, secret_hash=k.secret_hash)
    with pytest.raises(AlreadyExistsError):
        store.insert(twin, event(twin))
    assert store.get("k0002") is None and store.audit_events("k0002") == []


def test_delete_keeps_the_audit_log(store: SqlApiKeyStore) -> None:
    k = key(1)
    store.insert(k, event(k))
    deleted = store.delete(k.key_id, lambda c: event(c, AuditAction.DELETE))
    assert deleted == k and store.get(k.key_id) is None
    assert [e.action for e in store.audit_events(k.key_id)] == [
        AuditAction.CREATE,
        AuditAction.DELETE,
    ]
    with pytest.raises(NotFoundError):
        store.delete(k.key_id, lambda c: event(c, AuditAction.DELETE))


def test_last_used_never_moves_back(store: SqlApiKeyStore) -> None:
    k = key(1)
    store.insert(k, event(k))
    later = T0 + timedelta(minutes=5)
    store.record_last_used({k.key_id: later, "gone": later})
    store.record_last_used({k.key_id: T0})
    assert store.get(k.key_id).last_used_time == later  # type: ignore[union-attr]


def test_has_active_admin(store: SqlApiKeyStore) -> None:
    assert not store.has_active_admin(T0)
    user = key(1)
    store.insert(user, event(user))
    assert not store.has_active_admin(T0)
    admin = key(2, scopes=("admin",), expire_time=T0 + timedelta(hours=1))
    store.insert(admin, event(admin))
    assert store.has_active_admin(T0)
    assert not store.has_active_admin(T0 + timedelta(hours=1))
    store.update(
        admin.key_id,
        lambda c: (dataclasses.replace(c, revoke_time=T0), event(c, AuditAction.REVOKE)),
    )
    assert not store.has_active_admin(T0)


def test_the_key_tables_reads(store: SqlApiKeyStore) -> None:
    """What the key table follows (`inferplane.auth.key_table`): every key (revoked too),
    some keys by id (absent when deleted), and the audit log's events after an id, oldest
    first, one per write."""
    assert store.last_audit_id() == 0 and store.all_keys() == []
    keys = [key(n) for n in range(1, 4)]
    for k in keys:
        store.insert(k, event(k))
    first = store.last_audit_id()
    store.update(
        "k0002",
        lambda c: (
            dataclasses.replace(c, revoke_time=T0),
            event(c, AuditAction.REVOKE),
        ),
    )
    store.delete("k0003", lambda c: event(c, AuditAction.DELETE))
    assert sorted(k.key_id for k in store.all_keys()) == ["k0001", "k0002"]
    assert {k.key_id: k.revoke_time for k in store.get_many(["k0002", "k0003", "zz"])} == {
        "k0002": T0
    }
    assert store.all_keys()[0] == store.get(store.all_keys()[0].key_id)
    after = store.audit_after(first, 10)
    assert [k for _, k in after] == ["k0002", "k0003"]
    assert [i for i, _ in after] == sorted(i for i, _ in after) and after[0][0] > first
    assert store.last_audit_id() == after[-1][0]
    assert [k for _, k in store.audit_after(0, 2)] == ["k0001", "k0002"]
    assert len(store.get_many([f"k{n:04d}" for n in range(1, 1200)])) == 2  # chunked IN

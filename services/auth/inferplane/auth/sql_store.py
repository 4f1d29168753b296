"""SQLAlchemy 2 adapter of `ApiKeyStore`: SQLite by default, PostgreSQL with the same code.

Portable on purpose: no dialect-specific SQL except connection pragmas for SQLite (WAL and a
busy timeout, so the last-used writer and admin writes do not fail with "database is locked").
Timestamps are stored in UTC (naive on SQLite, `timestamptz` on PostgreSQL) and always come
back timezone-aware.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Engine,
    Index,
    Integer,
    String,
    and_,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from inferplane.auth.domain import SCOPE_ADMIN, ApiKey, AuditAction, AuditEvent, Limits
from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.store import ListQuery
from inferplane.runtime import AlreadyExistsError, NotFoundError
from inferplane.storage import SqlDatabase, UtcDateTime


class _Base(DeclarativeBase):
    pass


class _KeyRow(_Base):
    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    display_name: Mapped[str] = mapped_column(String(200), default="")
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    # Denormalised from `scopes` so "is there an active admin?" is a portable indexed query.
    has_admin_scope: Mapped[bool] = mapped_column(Boolean, default=False)
    allowed_models: Mapped[list[str]] = mapped_column(JSON)
    expire_time: Mapped[datetime | None] = mapped_column(UtcDateTime)
    requests_per_minute: Mapped[int] = mapped_column(Integer, default=0)
    tokens_per_minute: Mapped[int] = mapped_column(Integer, default=0)
    max_concurrent_requests: Mapped[int] = mapped_column(Integer, default=0)
    monthly_token_budget: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), default=0
    )
    tier: Mapped[str] = mapped_column(String(32))
    key_prefix: Mapped[str] = mapped_column(String(16))
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    previous_secret_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    previous_secret_expire_time: Mapped[datetime | None] = mapped_column(UtcDateTime)
    create_time: Mapped[datetime] = mapped_column(UtcDateTime)
    update_time: Mapped[datetime] = mapped_column(UtcDateTime)
    last_used_time: Mapped[datetime | None] = mapped_column(UtcDateTime)
    revoke_time: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Regions (migration 0008): the creating auth's region ("" before regions) and the pin.
    home_region: Mapped[str] = mapped_column(String(16), default="")
    region_pinned: Mapped[bool] = mapped_column(Boolean, default=False)

    __table_args__ = (Index("ix_api_keys_create_time_key_id", "create_time", "key_id"),)


class _AuditRow(_Base):
    __tablename__ = "api_key_audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(UtcDateTime)
    action: Mapped[str] = mapped_column(String(16))
    # No foreign key: the log outlives deleted keys.
    key_id: Mapped[str] = mapped_column(String(32), index=True)
    actor_key_id: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str] = mapped_column(String(128))
    detail: Mapped[dict[str, str]] = mapped_column(JSON)


#: The tables this store maps: a target of the auth database's migrations (`migrations/`).
METADATA = _Base.metadata
_KEYS = _KeyRow.__table__
_AUDIT = _AuditRow.__table__
# Key ids per `IN (...)` (well under SQLite's and PostgreSQL's bound-parameter limits).
_IN_CHUNK = 500


def _to_domain(row: Any) -> ApiKey:
    """A key from an ORM row or a Core row of `api_keys` (the same attribute names)."""
    return ApiKey(
        key_id=row.key_id,
        display_name=row.display_name,
        tenant=row.tenant,
        scopes=tuple(row.scopes),
        allowed_models=tuple(row.allowed_models),
        expire_time=row.expire_time,
        limits=Limits(
            row.requests_per_minute,
            row.tokens_per_minute,
            row.max_concurrent_requests,
            row.monthly_token_budget,
        ),
        tier=row.tier,
        key_prefix=row.key_prefix,
        secret_hash=row.secret_hash,
        create_time=row.create_time,
        update_time=row.update_time,
        last_used_time=row.last_used_time,
        revoke_time=row.revoke_time,
        previous_secret_hash=row.previous_secret_hash,
        previous_secret_expire_time=row.previous_secret_expire_time,
        home_region=row.home_region,
        region_pinned=row.region_pinned,
    )


def _fill_row(row: _KeyRow, key: ApiKey, *, with_last_used: bool = True) -> None:
    row.key_id = key.key_id
    row.display_name = key.display_name
    row.tenant = key.tenant
    row.scopes = list(key.scopes)
    row.has_admin_scope = SCOPE_ADMIN in key.scopes
    row.allowed_models = list(key.allowed_models)
    row.expire_time = key.expire_time
    row.requests_per_minute = key.limits.requests_per_minute
    row.tokens_per_minute = key.limits.tokens_per_minute
    row.max_concurrent_requests = key.limits.max_concurrent_requests
    row.monthly_token_budget = key.limits.monthly_token_budget
    row.tier = key.tier
    row.key_prefix = key.key_prefix
    row.secret_hash = key.secret_hash
    row.previous_secret_hash = key.previous_secret_hash
    row.previous_secret_expire_time = key.previous_secret_expire_time
    row.create_time = key.create_time
    row.update_time = key.update_time
    if with_last_used:  # updates leave it to record_last_used, so neither clobbers the other
        row.last_used_time = key.last_used_time
    row.revoke_time = key.revoke_time
    row.home_region = key.home_region
    row.region_pinned = key.region_pinned


def _audit_row(ev: AuditEvent) -> _AuditRow:
    return _AuditRow(
        time=ev.time,
        action=ev.action.value,
        key_id=ev.key_id,
        actor_key_id=ev.actor_key_id,
        tenant=ev.tenant,
        detail=dict(ev.detail),
    )


class SqlApiKeyStore:
    """`ApiKeyStore` on SQLAlchemy. `url` is any SQLAlchemy URL, e.g.
    `sqlite:////var/lib/inferplane/auth.db` or `postgresql+psycopg://user@host:5432/auth`.
    """

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self._db = SqlDatabase(
            url, what="API key database", reason="AUTH_STORE_UNAVAILABLE", echo=echo
        )
        self._tx = self._db.transaction

    @property
    def engine(self) -> Engine:
        return self._db.engine

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        """A plain connection for reads (no ORM session).

        Raises:
            UnavailableError: the database cannot be reached.
        """
        try:
            with self._db.engine.connect() as conn:
                yield conn
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc

    def create_schema(self) -> None:
        """Migrates the auth database to the latest schema revision (`migrations/`)."""
        self._db.migrate(MIGRATIONS)

    def insert(self, key: ApiKey, event: AuditEvent) -> None:
        try:
            with self._tx() as s:
                row = _KeyRow()
                _fill_row(row, key)
                s.add(row)
                s.add(_audit_row(event))
        except IntegrityError as exc:  # same key id or secret hash: nothing was written
            raise AlreadyExistsError(
                f"{key.name} or its secret exists already", reason="API_KEY_EXISTS"
            ) from exc

    def get(self, key_id: str) -> ApiKey | None:
        with self._tx() as s:
            row = s.get(_KeyRow, key_id)
            return None if row is None else _to_domain(row)

    def find_by_secret_hash(self, secret_hash: str) -> ApiKey | None:
        # Two indexed equality lookups; OR would defeat the unique index on some planners.
        with self._tx() as s:
            row = s.scalars(select(_KeyRow).where(_KeyRow.secret_hash == secret_hash)).first()
            if row is None:
                row = s.scalars(
                    select(_KeyRow).where(_KeyRow.previous_secret_hash == secret_hash)
                ).first()
            return None if row is None else _to_domain(row)

    def list_keys(self, query: ListQuery) -> Sequence[ApiKey]:
        stmt = select(_KeyRow)
        if query.tenant:
            stmt = stmt.where(_KeyRow.tenant == query.tenant)
        if not query.include_inactive:
            stmt = stmt.where(
                _KeyRow.revoke_time.is_(None),
                or_(_KeyRow.expire_time.is_(None), _KeyRow.expire_time > query.now),
            )
        if query.after is not None:
            after_time, after_id = query.after
            stmt = stmt.where(
                or_(
                    _KeyRow.create_time < after_time,
                    and_(_KeyRow.create_time == after_time, _KeyRow.key_id < after_id),
                )
            )
        stmt = stmt.order_by(_KeyRow.create_time.desc(), _KeyRow.key_id.desc()).limit(query.limit)
        with self._tx() as s:
            return [_to_domain(r) for r in s.scalars(stmt)]

    def update(
        self, key_id: str, change: Callable[[ApiKey], tuple[ApiKey, AuditEvent | None]]
    ) -> ApiKey:
        with self._tx() as s:
            row = s.scalars(
                select(_KeyRow).where(_KeyRow.key_id == key_id).with_for_update()
            ).first()
            if row is None:
                raise NotFoundError(f"api-keys/{key_id} not found", reason="API_KEY_NOT_FOUND")
            new, audit = change(_to_domain(row))
            if audit is not None:
                _fill_row(row, new, with_last_used=False)
                s.add(_audit_row(audit))
            return new

    def delete(self, key_id: str, event: Callable[[ApiKey], AuditEvent]) -> ApiKey:
        with self._tx() as s:
            row = s.scalars(
                select(_KeyRow).where(_KeyRow.key_id == key_id).with_for_update()
            ).first()
            if row is None:
                raise NotFoundError(f"api-keys/{key_id} not found", reason="API_KEY_NOT_FOUND")
            key = _to_domain(row)
            s.delete(row)
            s.add(_audit_row(event(key)))
            return key

    def record_last_used(self, times: Mapping[str, datetime]) -> None:
        if not times:
            return
        with self._tx() as s:
            for key_id, when in times.items():
                s.execute(
                    update(_KeyRow)
                    .where(
                        _KeyRow.key_id == key_id,
                        or_(_KeyRow.last_used_time.is_(None), _KeyRow.last_used_time < when),
                    )
                    .values(last_used_time=when)
                )

    def audit_events(self, key_id: str | None = None, limit: int = 100) -> Sequence[AuditEvent]:
        stmt = select(_AuditRow).order_by(_AuditRow.id).limit(limit)
        if key_id is not None:
            stmt = stmt.where(_AuditRow.key_id == key_id)
        with self._tx() as s:
            return [
                AuditEvent(
                    time=r.time,
                    action=AuditAction(r.action),
                    key_id=r.key_id,
                    actor_key_id=r.actor_key_id,
                    tenant=r.tenant,
                    detail=dict(r.detail),
                )
                for r in s.scalars(stmt)
            ]

    def all_keys(self) -> list[ApiKey]:
        """Every stored key (revoked and expired ones too), read without the ORM's identity
        map: the key table's full load and resync (`inferplane.auth.key_table`)."""
        with self._read() as conn:
            return [_to_domain(r) for r in conn.execute(select(_KEYS))]

    def get_many(self, key_ids: Collection[str]) -> list[ApiKey]:
        """The keys among `key_ids` that exist (any order; a deleted one is absent)."""
        ids = sorted(set(key_ids))
        found: list[ApiKey] = []
        with self._read() as conn:
            for start in range(0, len(ids), _IN_CHUNK):
                chunk = ids[start : start + _IN_CHUNK]
                rows = conn.execute(select(_KEYS).where(_KEYS.c.key_id.in_(chunk)))
                found.extend(_to_domain(r) for r in rows)
        return found

    def last_audit_id(self) -> int:
        """The newest audit event's id (0 when none): where following changes starts."""
        with self._read() as conn:
            return int(conn.execute(select(func.max(_AUDIT.c.id))).scalar() or 0)

    def audit_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        """(id, key id) of the audit events after `after_id`, oldest first, at most `limit`:
        which keys changed since (one indexed range read; every write to a key adds one
        event in its own transaction)."""
        statement = (
            select(_AUDIT.c.id, _AUDIT.c.key_id)
            .where(_AUDIT.c.id > after_id)
            .order_by(_AUDIT.c.id)
            .limit(limit)
        )
        with self._read() as conn:
            return [(int(i), str(k)) for i, k in conn.execute(statement)]

    def has_active_admin(self, now: datetime) -> bool:
        stmt = (
            select(_KeyRow.key_id)
            .where(
                _KeyRow.has_admin_scope.is_(True),
                _KeyRow.revoke_time.is_(None),
                or_(_KeyRow.expire_time.is_(None), _KeyRow.expire_time > now),
            )
            .limit(1)
        )
        with self._tx() as s:
            return s.scalars(stmt).first() is not None

    def close(self) -> None:
        self._db.close()

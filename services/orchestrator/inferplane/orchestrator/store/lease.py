"""The leader's rows in the orchestrator database: the lease orchestrators elect their leader
with (`leader_leases`), the fence every write of the leader runs first, and the routing table
the leader publishes for standbys to serve (`routing_tables`), and what the leader granted routers
of the replicas' concurrency caps (`router_grants`), so that its successor can adopt it.

Each lease operation is ONE conditional statement in a transaction of its own, so it is atomic
on SQLite (the writer holds the database's write lock) and on PostgreSQL (the row's lock) with
the same portable SQL:

- `insert`: the first holder, term 1; a second inserter hits the primary key and loses.
- `take`: `UPDATE leader_leases SET holder = :me, term = term + 1, version = version + 1 WHERE
  name = :name AND term = :seen_term AND version = :seen_version`, a compare-and-swap on the row
  the caller saw: a renewal or another taker in between makes it match nothing.
- `renew`: `UPDATE ... SET version = version + 1 WHERE name AND holder = :me AND term = :mine`.
- `release`: the same, setting `holder = ''` (a standby may take a released lease at once).
- `fence(session, holder, term)`: `UPDATE ... SET term = term WHERE name AND holder AND term` as
  the FIRST statement of a write's transaction. No row: the term is stale (another orchestrator
  took the lease, or this one released it) and `NotLeaderError` rolls the write back. One row:
  the lease row stays locked until the write commits, so no `take` can commit in between
  (SQLite: this UPDATE takes the database's write lock; PostgreSQL: the row lock, and a `take`
  waiting on it evaluates its WHERE again on the row as the write left it).

`term` is the fencing token (Kleppmann, "How to do distributed locking", 2016): it grows by one
at every change of holder and is never reused; `version` grows at every acquisition, renewal
and release, so a standby can tell a live holder (the version moves) from a dead one. When a
lease may be taken is the caller's rule: `inferplane.orchestrator.leadership`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

from sqlalchemy import BigInteger, Float, LargeBinary, String, Table, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.runtime import UnavailableError
from inferplane.storage import SqlDatabase, UtcDateTime

#: The longest holder id the lease row stores.
MAX_HOLDER = 255


class NotLeaderError(UnavailableError):
    """This orchestrator does not hold the leader lease (a standby, or a leader deposed since):
    it refuses writes and the catalogue and fleet RPCs. gRPC: UNAVAILABLE, reason NOT_LEADER,
    ErrorInfo metadata `leader` (the holder's id, "" when none holds it) and `term`."""

    default_reason = "NOT_LEADER"

    def __init__(self, me: str, leader: str, term: int) -> None:
        if leader:
            message = (
                f"orchestrator {me} is not the leader; {leader} leads (term {term}): "
                "send catalogue and fleet calls there"
            )
        else:
            message = (
                f"orchestrator {me} is not the leader and no orchestrator leads now "
                "(an election is under way); retry shortly"
            )
        super().__init__(message, metadata={"leader": leader, "term": str(term)})
        self.leader = leader
        self.term = term


class Fence(Protocol):
    """What a fenced store runs first in each write's transaction."""

    def fence(self, session: Session) -> None:
        """Raises NotLeaderError (the write is rolled back) unless this orchestrator's term is
        the lease's current one; otherwise holds the lease row until the transaction ends."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The lease row: `holder` ("" once released), `term` (fencing token), `version` (moves at
    every acquisition, renewal and release), the holder's `duration_seconds`, and its wall-clock
    `renew_time` (aware UTC; for operators, never compared across hosts)."""

    name: str
    holder: str
    term: int
    version: int
    duration_seconds: float
    renew_time: datetime


class _Base(DeclarativeBase):
    pass


class _LeaseRow(_Base):
    __tablename__ = "leader_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(MAX_HOLDER))
    term: Mapped[int] = mapped_column(BigInteger)
    version: Mapped[int] = mapped_column(BigInteger)
    duration_seconds: Mapped[float] = mapped_column(Float)
    renew_time: Mapped[datetime] = mapped_column(UtcDateTime)


class _RoutingTableRow(_Base):
    __tablename__ = "routing_tables"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(32))
    data: Mapped[bytes] = mapped_column(LargeBinary)
    term: Mapped[int] = mapped_column(BigInteger)
    update_time: Mapped[datetime] = mapped_column(UtcDateTime)


class _RouterGrantsRow(_Base):
    __tablename__ = "router_grants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    term: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    update_time: Mapped[datetime] = mapped_column(UtcDateTime)


#: The tables this module maps: a target of the orchestrator database's migrations.
METADATA = _Base.metadata

_LEASE: Table = _LeaseRow.__table__  # type: ignore[assignment]


def _record(row: _LeaseRow) -> LeaseRecord:
    return LeaseRecord(
        row.name, row.holder, row.term, row.version, row.duration_seconds, row.renew_time
    )


class SqlLeaseStore:
    """The lease rows on their own engine (`url` as `SqlStateStore`'s), so a renewal never
    waits for a connection that a long write holds. Every method raises UnavailableError when
    the database cannot be reached."""

    def __init__(self, url: str) -> None:
        self._db = SqlDatabase(
            url, what="orchestrator database", reason="ORCHESTRATOR_STORE_UNAVAILABLE"
        )

    @property
    def database(self) -> SqlDatabase:
        """The lease's own engine and transactions (`SqlRoutingTables` shares them)."""
        return self._db

    def create_schema(self) -> None:
        """Migrates the orchestrator database to the latest schema revision (`migrations/`)."""
        self._db.migrate(MIGRATIONS)

    def read(self, name: str) -> LeaseRecord | None:
        """The lease called `name`, None before anyone acquired it."""
        with self._db.transaction() as s:
            row = s.get(_LeaseRow, name)
            return None if row is None else _record(row)

    def insert(self, name: str, holder: str, duration_seconds: float, now: datetime) -> bool:
        """Creates the lease held by `holder` at term 1; False when it exists already."""
        try:
            with self._db.transaction() as s:
                s.execute(
                    insert(_LEASE).values(
                        name=name,
                        holder=holder,
                        term=1,
                        version=1,
                        duration_seconds=duration_seconds,
                        renew_time=now,
                    )
                )
        except IntegrityError:
            return False
        return True

    def take(self, seen: LeaseRecord, holder: str, duration_seconds: float, now: datetime) -> bool:
        """Gives the lease to `holder` at term `seen.term + 1` if its row is still `seen`."""
        return self._update(
            (_LEASE.c.name == seen.name)
            & (_LEASE.c.term == seen.term)
            & (_LEASE.c.version == seen.version),
            holder=holder,
            term=_LEASE.c.term + 1,
            version=_LEASE.c.version + 1,
            duration_seconds=duration_seconds,
            renew_time=now,
        )

    def renew(
        self, name: str, holder: str, term: int, duration_seconds: float, now: datetime
    ) -> bool:
        """Extends `holder`'s lease at `term`; False when it holds that term no longer."""
        return self._update(
            (_LEASE.c.name == name) & (_LEASE.c.holder == holder) & (_LEASE.c.term == term),
            version=_LEASE.c.version + 1,
            duration_seconds=duration_seconds,
            renew_time=now,
        )

    def release(self, name: str, holder: str, term: int, now: datetime) -> bool:
        """Gives the lease up (holder ""; the term stays); False when `holder` did not hold it
        at `term`."""
        return self._update(
            (_LEASE.c.name == name) & (_LEASE.c.holder == holder) & (_LEASE.c.term == term),
            holder="",
            version=_LEASE.c.version + 1,
            renew_time=now,
        )

    def _update(self, where: object, **values: object) -> bool:
        with self._db.transaction() as s:
            result = s.execute(update(_LEASE).where(where).values(**values))  # type: ignore[arg-type]
            return int(result.rowcount) == 1  # type: ignore[attr-defined]

    @staticmethod
    def fence(session: Session, name: str, holder: str, term: int) -> None:
        """Run FIRST in a write's transaction (see the module docstring).

        Raises:
            NotLeaderError: `holder` does not hold lease `name` at `term` (naming who does).
        """
        result = session.execute(
            update(_LEASE)
            .where((_LEASE.c.name == name) & (_LEASE.c.holder == holder) & (_LEASE.c.term == term))
            .values(term=_LEASE.c.term)
        )
        if int(result.rowcount) == 1:  # type: ignore[attr-defined]
            return
        row = session.get(_LeaseRow, name)
        raise NotLeaderError(holder, row.holder if row else "", row.term if row else 0)

    def close(self) -> None:
        self._db.close()


class SqlRoutingTables:
    """The routing table the leader publishes (serialized `WatchRoutingTableResponse` bytes
    and its content version) for standbys to serve, on `database` (the lease store's).
    `publish` is fenced by `fence` when one is given."""

    def __init__(self, database: SqlDatabase, *, fence: Fence | None = None) -> None:
        self._db = database
        self._fence = fence

    def publish(self, name: str, version: str, table: bytes, term: int, now: datetime) -> None:
        """Stores the table under `name` unless the stored one has `version` already.

        Raises:
            NotLeaderError: the fence refused the write.
            UnavailableError: the database cannot be reached.
        """
        with self._db.transaction() as s:
            if self._fence is not None:
                self._fence.fence(s)
            row = s.get(_RoutingTableRow, name)
            if row is not None and row.version == version:
                return
            s.merge(
                _RoutingTableRow(name=name, version=version, data=table, term=term, update_time=now)
            )

    def version(self, name: str) -> str | None:
        """The stored table's version (None: nothing published yet)."""
        with self._db.transaction() as s:
            return s.scalar(select(_RoutingTableRow.version).where(_RoutingTableRow.name == name))

    def read(self, name: str) -> tuple[str, bytes] | None:
        """The stored table's version and bytes (None: nothing published yet)."""
        with self._db.transaction() as s:
            row = s.get(_RoutingTableRow, name)
            return None if row is None else (row.version, row.data)


Grants = dict[str, dict[tuple[str, str], int]]
"""router id → replica (address, replica id) → the most the router may have in flight there."""


@dataclasses.dataclass(frozen=True, slots=True)
class StoredGrants:
    """The grants a leader stored last: its `term` and `held` (`Grants`)."""

    term: int
    held: Grants


class SqlRouterGrants:
    """What the leader's routing hub lets each router have in flight per replica
    (`inferplane.orchestrator.routing.shares`), one row per lease name holding all routers
    (JSON), on `database` (the lease store's). `save` is fenced by `fence` when one is given, so
    a row's `term` is the term of the leader that wrote it."""

    def __init__(self, database: SqlDatabase, *, fence: Fence | None = None) -> None:
        self._db = database
        self._fence = fence

    def save(
        self, name: str, held: Mapping[str, Mapping[tuple[str, str], int]], term: int, now: datetime
    ) -> None:
        """Replaces the stored grants under `name` with `held` (routers with nothing held may
        be left out).

        Raises:
            NotLeaderError: the fence refused the write.
            UnavailableError: the database cannot be reached.
        """
        data = json.dumps(
            {
                router: sorted([address, replica, n] for (address, replica), n in keys.items())
                for router, keys in sorted(held.items())
                if keys
            },
            separators=(",", ":"),
        ).encode()
        with self._db.transaction() as s:
            if self._fence is not None:
                self._fence.fence(s)
            s.merge(_RouterGrantsRow(name=name, term=term, data=data, update_time=now))

    def load(self, name: str) -> StoredGrants | None:
        """The grants stored under `name` (None: no leader stored any yet)."""
        with self._db.transaction() as s:
            row = s.get(_RouterGrantsRow, name)
            if row is None:
                return None
            raw = json.loads(row.data)
            return StoredGrants(
                row.term,
                {
                    router: {(str(a), str(r)): int(n) for a, r, n in entries}
                    for router, entries in raw.items()
                },
            )

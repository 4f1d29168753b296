"""What every SQL-backed store of inferplane shares (SQLAlchemy 2; SQLite and PostgreSQL).

- `UtcDateTime`: timezone-aware UTC datetimes in and out on every dialect;
- `SqlDatabase`: the engine (SQLite connections get WAL and a busy timeout so several
  processes can share one file), sessions in one transaction each, and connection failures
  turned into `UnavailableError` so the caller answers UNAVAILABLE (HTTP 503), never 500;
- `Migrations`, `migrate`: the schema brought to the latest Alembic revision at start-up, one
  process at a time (`_migrate.py`); `run_env` is the body of each environment's `env.py`.

Stores keep their own tables, mapping and migration scripts; only these mechanics live here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Engine, create_engine, event
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.types import TypeDecorator

from inferplane.runtime import UnavailableError
from inferplane.storage._migrate import Migrations, migrate, run_env, schema_differences

__all__ = [
    "Migrations",
    "SqlDatabase",
    "UtcDateTime",
    "migrate",
    "run_env",
    "schema_differences",
]


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, on every dialect.

    Raises:
        ValueError: a naive datetime is bound (its zone would be a guess).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use timezone-aware UTC")
        value = value.astimezone(UTC)
        # SQLite has no time zones: store naive UTC so string comparisons order correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


class SqlDatabase:
    """One database behind a SQLAlchemy URL, e.g. `sqlite:////var/lib/inferplane/x.db` or
    `postgresql+psycopg://user@host:5432/x`.

    `what` names the database in errors ("the API key database is unavailable"); `reason` is
    the ErrorInfo reason of those errors.
    """

    def __init__(self, url: str, *, what: str, reason: str, echo: bool = False) -> None:
        self.engine: Engine = create_engine(url, echo=echo, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._what = what
        self._reason = reason

    def unavailable(self, exc: BaseException) -> UnavailableError:
        """The error to raise when the database cannot be reached."""
        error = UnavailableError(f"the {self._what} is unavailable", reason=self._reason)
        error.__cause__ = exc
        return error

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error.

        Raises:
            UnavailableError: the database cannot be reached.
        """
        try:
            with self._sessions.begin() as session:
                yield session
        except OperationalError as exc:
            raise self.unavailable(exc) from exc

    def migrate(self, migrations: Migrations) -> None:
        """Brings the schema to the latest revision of `migrations` (see `migrate`).

        Raises:
            UnavailableError: the database cannot be reached.
            FailedPreconditionError: the database is at a revision these scripts do not know.
        """
        try:
            migrate(self.engine, migrations)
        except OperationalError as exc:
            raise self.unavailable(exc) from exc

    def close(self) -> None:
        self.engine.dispose()

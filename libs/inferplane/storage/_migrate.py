"""Schema migrations with Alembic, run by each SQL store at start-up (no alembic.ini needed).

One migration environment per service database (`services/<name>/migrations/`: `env.py`,
`versions/`); the revision a database is at lives in that environment's own version table, so
several services may share one database. `migrate` brings a database to the latest revision
under a lock (PostgreSQL: a transaction-scoped advisory lock; SQLite: `BEGIN IMMEDIATE`), in one
transaction on both: of several processes starting at once, one migrates, the others wait and
then find nothing to do; a migration that fails leaves the schema as it was.

A database made before migrations existed (by `create_all`) has no version table: it is
migrated from the start, and each environment's baseline revision creates only the tables that
are missing (the existing ones are the baseline's already), so it is adopted in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, MetaData, create_engine, event, text
from sqlalchemy.pool import ConnectionPoolEntry, NullPool
from sqlalchemy.types import TypeDecorator
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from inferplane.runtime import FailedPreconditionError

__all__ = ["Migrations", "migrate", "run_env", "schema_differences"]

log = structlog.get_logger("inferplane.storage")

#: How long a process waits for another one's migration (or a writer) before it gives up.
LOCK_WAIT_SECONDS = 300


@dataclasses.dataclass(frozen=True, slots=True)
class Migrations:
    """One database's migration environment.

    Attributes:
        script_location: the folder with `env.py` and `versions/`.
        version_table: the table that records the revision applied (one per environment).
    """

    script_location: Path
    version_table: str

    def config(self, connection: Connection | None = None) -> Config:
        """An Alembic `Config` for this environment; `env.py` migrates on `connection` when
        given (already locked, in a transaction), else on the CLI's `-x url=...`."""
        config = Config()
        # ConfigParser interpolation: a literal % must be doubled.
        config.set_main_option("script_location", str(self.script_location).replace("%", "%%"))
        config.attributes["connection"] = connection
        return config


def migrate(engine: Engine, migrations: Migrations) -> str | None:
    """Upgrades the database behind `engine` to the latest revision of `migrations`.

    Returns the revision the database was at before (None: fresh, or made before migrations).

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached (or the lock was not
            granted within `LOCK_WAIT_SECONDS`).
        FailedPreconditionError: the database is at a revision these scripts do not know (a
            newer version of inferplane migrated it).
    """
    migration_engine = _migration_engine(engine)
    try:
        with _locked(migration_engine, migrations.version_table) as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": migrations.version_table}
            )
            before = context.get_current_revision()
            config = migrations.config(conn)
            scripts = ScriptDirectory.from_config(config)
            head = scripts.get_current_head()
            if before == head:
                return before
            if before is not None:
                try:
                    scripts.get_revision(before)
                except CommandError as exc:
                    raise FailedPreconditionError(
                        f"the database is at schema revision {before!r} "
                        f"({migrations.version_table}), which this version does not know: "
                        "run the version that migrated it",
                        reason="SCHEMA_REVISION_UNKNOWN",
                    ) from exc
            command.upgrade(config, "head")
            log.info(
                "schema_migrated",
                version_table=migrations.version_table,
                from_revision=before,
                to_revision=head,
            )
            return before
    finally:
        if migration_engine is not engine:
            migration_engine.dispose()


def run_env(migrations: Migrations, target_metadata: Sequence[MetaData]) -> None:
    """The body of an environment's `env.py` (Alembic calls it in `upgrade`, `revision`, ...).

    Programmatic runs (`migrate`) pass a locked connection; the `alembic` command line names the
    database with `-x url=SQLALCHEMY_URL` and takes the same lock.
    """
    from alembic import context  # set by Alembic only while it runs env.py

    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run_migrations(context, connection, migrations, target_metadata)
        return
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("name the database: alembic -c ... -x url=SQLALCHEMY_URL <command>")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = _migration_engine(create_engine(url))
    try:
        with _locked(engine, migrations.version_table) as conn:
            _run_migrations(context, conn, migrations, target_metadata)
    finally:
        engine.dispose()


def schema_differences(
    engine: Engine, migrations: Migrations, metadata: Sequence[MetaData]
) -> list[Any]:
    """What `alembic check` would report: differences between the tables of `metadata` and
    the database (Alembic's diff tuples; empty when they agree). Other tables are ignored."""
    merged = MetaData()
    for md in metadata:
        for table in md.tables.values():
            table.to_metadata(merged)
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts=_compare_options(migrations, merged.tables.keys())
        )
        return list(compare_metadata(context, merged))


def _run_migrations(
    context: Any, conn: Connection, migrations: Migrations, target_metadata: Sequence[MetaData]
) -> None:
    tables = {name for md in target_metadata for name in md.tables}
    context.configure(
        connection=conn,
        target_metadata=list(target_metadata),
        # SQLite alters a column by copying the table; batch mode writes that for us.
        render_as_batch=True,
        render_item=_render_item,
        **_compare_options(migrations, tables),
    )
    with context.begin_transaction():
        context.run_migrations()


def _render_item(type_: str, obj: Any, _autogen_context: Any) -> str | bool:
    # A revision must not import the models' Python-side types (`UtcDateTime`): it stays as
    # written while they change. It names the column type they create instead.
    if type_ == "type" and isinstance(obj, TypeDecorator):
        return f"sa.{obj.impl!r}"
    return False


def _compare_options(migrations: Migrations, tables: Any) -> dict[str, Any]:
    names = set(tables)

    def include_name(name: str | None, type_: str, _parents: Any) -> bool:
        # Another service's tables in a shared database are none of this environment's business.
        return type_ != "table" or name in names

    return {
        "version_table": migrations.version_table,
        "include_name": include_name,
        "compare_type": True,
        "compare_server_default": True,
    }


def _is_memory_sqlite(engine: Engine) -> bool:
    url = engine.url
    return url.get_backend_name() == "sqlite" and (
        url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"
    )


def _migration_engine(engine: Engine) -> Engine:
    """An engine for migrating only: no pool, and on SQLite transactions that take the write
    lock at BEGIN (pysqlite would begin lazily, and not at all before DDL)."""
    if _is_memory_sqlite(engine):
        return engine  # one connection's private database: nothing to lock, nothing to share
    if engine.dialect.name != "sqlite":
        return create_engine(engine.url, poolclass=NullPool)
    migration_engine = create_engine(
        engine.url, poolclass=NullPool, connect_args={"timeout": LOCK_WAIT_SECONDS}
    )
    event.listen(migration_engine, "connect", _sqlite_autocommit_driver)
    event.listen(migration_engine, "begin", _sqlite_begin_immediate)
    return migration_engine


def _sqlite_autocommit_driver(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
    cursor = dbapi_connection.cursor()
    try:
        # As the stores' connections: readers never wait. Switching a database to WAL needs an
        # exclusive lock, and SQLite answers "database is locked" at once (no busy wait) while
        # another process migrates under BEGIN IMMEDIATE: wait for that lock like the others.
        for attempt in Retrying(
            retry=retry_if_exception(_sqlite_locked),
            wait=wait_exponential(multiplier=0.01, max=0.5),
            stop=stop_after_delay(LOCK_WAIT_SECONDS),
            reraise=True,
        ):
            with attempt:
                cursor.execute("PRAGMA journal_mode=WAL")
    finally:
        cursor.close()


def _sqlite_locked(exc: BaseException) -> bool:
    return "database is locked" in str(exc)


def _sqlite_begin_immediate(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def _lock_key(version_table: str) -> int:
    digest = hashlib.sha256(b"inferplane.storage.migrate:" + version_table.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextlib.contextmanager
def _locked(engine: Engine, version_table: str) -> Iterator[Connection]:
    """A connection in a transaction that holds the environment's migration lock until it
    commits (on success) or rolls back."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT_SECONDS}s'"))
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_key(version_table)}
            )
        else:
            conn.begin()
        yield conn
        conn.commit()

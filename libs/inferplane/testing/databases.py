"""Databases for the SQL store tests: SQLite always, PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL`
names one (`scripts/postgres.sh start DIR` prints it).

`fresh_database` gives an empty database of its own to a test (a new PostgreSQL database beside
the configured one, dropped afterwards), so tests of schemas never see another test's tables;
`drop_schema` empties a shared database of one service's tables and migration state.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, Table, create_engine, text
from sqlalchemy.exc import DBAPIError

from inferplane.storage import Migrations

POSTGRES_ENV = "INFERPLANE_TEST_POSTGRES_URL"


def postgres_url() -> str:
    """The configured PostgreSQL test database's URL, or "" when none is."""
    return os.environ.get(POSTGRES_ENV, "")


@contextlib.contextmanager
def fresh_database(kind: str, directory: Path) -> Iterator[str]:
    """The URL of an empty database: `kind` "sqlite" (a file in `directory`) or "postgresql"
    (created on the configured server, dropped on exit).

    Raises:
        LookupError: "postgresql" without `INFERPLANE_TEST_POSTGRES_URL`, or a server that
            refuses to create a database (callers skip).
        ValueError: another `kind`.
    """
    if kind == "sqlite":
        yield f"sqlite:///{directory / f'{uuid.uuid4().hex[:8]}.db'}"
        return
    if kind != "postgresql":
        raise ValueError(f"unknown database kind {kind!r}; known: postgresql, sqlite")
    if not postgres_url():
        raise LookupError(f"set {POSTGRES_ENV} to run this test on PostgreSQL")
    admin = create_engine(postgres_url(), isolation_level="AUTOCOMMIT")
    name = f"{admin.url.database}_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            try:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
            except DBAPIError as exc:  # e.g. a role without CREATEDB
                raise LookupError(f"cannot create a test database: {exc.orig}") from exc
        try:
            yield admin.url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def drop_schema(url: str, migrations: Migrations, metadata: Sequence[MetaData]) -> None:
    """Drops the tables of `metadata` and the version table of `migrations` (other tables in
    the database stay): the next start-up migrates it as a fresh database."""
    engine = create_engine(url)
    try:
        for md in metadata:
            md.drop_all(engine)
        Table(migrations.version_table, MetaData()).drop(engine, checkfirst=True)
    finally:
        engine.dispose()


@contextlib.contextmanager
def database_or_skip(kind: str, directory: Path) -> Iterator[str]:
    """`fresh_database`, the test skipped (with the reason) when `kind` is "postgresql" and no
    test server is configured: CI's `scripts/test.sh` always starts one, so only a developer's
    bare `pytest` skips."""
    try:
        with fresh_database(kind, directory) as url:
            yield url
    except LookupError as exc:
        pytest.skip(str(exc))


def version_rows(url: str, migrations: Migrations) -> list[Any]:
    """The rows of `migrations`' version table in the database at `url`."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(f"SELECT version_num FROM {migrations.version_table}")))
    finally:
        engine.dispose()

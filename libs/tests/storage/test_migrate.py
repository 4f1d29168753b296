"""`inferplane.storage.migrate` on throw-away Alembic environments, on SQLite and on PostgreSQL
(when `INFERPLANE_TEST_POSTGRES_URL` is set; each test gets a database of its own).

Invariants: a database is brought to the latest revision and a second run changes nothing; a
revision added later upgrades a database in place, keeping its rows; of processes starting at
once, exactly one migrates; a migration that fails leaves the schema as it was; a database at a
revision the scripts do not know is refused; two environments share a database without seeing
each other; the schema check (`schema_differences`) sees a column the database lacks.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, inspect, text

from inferplane.runtime import FailedPreconditionError
from inferplane.storage import Migrations, migrate, schema_differences
from inferplane.testing.databases import database_or_skip

ENV = """\
from pathlib import Path

from sqlalchemy import MetaData

from inferplane.storage import Migrations, run_env

run_env(Migrations(Path(__file__).parent, {version_table!r}), [MetaData()])
"""
CREATE_WIDGETS = """\
import time

import sqlalchemy as sa
from alembic import op

revision = "a"
down_revision = None


def upgrade():
    op.create_table(
        "widgets",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(32), nullable=False),
    )
    time.sleep({sleep})  # widens the window in which a second migrator would run too
"""
ADD_COLOUR = """\
import sqlalchemy as sa
from alembic import op

revision = "b"
down_revision = "a"


def upgrade():
    with op.batch_alter_table("widgets") as batch:
        batch.add_column(
            sa.Column("colour", sa.String(16), nullable=False, server_default="blue")
        )
    {then}
"""


def environment(
    root: Path, *revisions: str, version_table: str = "widgets_version", sleep: float = 0
) -> Migrations:
    """A migration environment in `root` with the given revision sources."""
    (root / "versions").mkdir(parents=True, exist_ok=True)
    (root / "env.py").write_text(ENV.format(version_table=version_table))
    for n, source in enumerate(revisions):
        (root / "versions" / f"{n:04d}.py").write_text(source.format(sleep=sleep, then="pass"))
    return Migrations(root, version_table)


def widgets(*extra: Column[object]) -> MetaData:
    metadata = MetaData()
    Table(
        "widgets",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("name", String(32), nullable=False),
        *extra,
    )
    return metadata


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_or_skip(request.param, tmp_path) as database:
        yield database


def test_a_fresh_database_is_migrated_to_head_then_left_alone(url: str, tmp_path: Path) -> None:
    scripts = environment(tmp_path / "env", CREATE_WIDGETS, ADD_COLOUR)
    engine = create_engine(url)
    try:
        assert migrate(engine, scripts) is None  # was at no revision
        assert migrate(engine, scripts) == "b"  # found at head: nothing to do
        columns = {c["name"] for c in inspect(engine).get_columns("widgets")}
        assert columns == {"id", "name", "colour"}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM widgets_version")).all() == [("b",)]
    finally:
        engine.dispose()


def test_a_later_revision_upgrades_the_database_in_place(url: str, tmp_path: Path) -> None:
    engine = create_engine(url)
    try:
        migrate(engine, environment(tmp_path / "v1", CREATE_WIDGETS))
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO widgets (id, name) VALUES (1, 'one'), (2, 'two')"))
        assert migrate(engine, environment(tmp_path / "v2", CREATE_WIDGETS, ADD_COLOUR)) == "a"
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, name, colour FROM widgets ORDER BY id")).all()
        assert rows == [(1, "one", "blue"), (2, "two", "blue")]
    finally:
        engine.dispose()


def test_of_processes_starting_at_once_exactly_one_migrates(url: str, tmp_path: Path) -> None:
    """Each process waits at a start line, then migrates: one finds no revision and migrates
    (for half a second), the others wait for its lock and find the database at head."""
    scripts = environment(tmp_path / "env", CREATE_WIDGETS, sleep=0.5)
    go = tmp_path / "go"
    program = textwrap.dedent(
        """
        import pathlib, sys, time
        from sqlalchemy import create_engine
        from inferplane.storage import Migrations, migrate
        engine = create_engine(sys.argv[1])
        scripts = Migrations(pathlib.Path(sys.argv[2]), sys.argv[3])
        print("ready", flush=True)
        while not pathlib.Path(sys.argv[4]).exists():
            time.sleep(0.005)
        print(migrate(engine, scripts), flush=True)
        """
    )
    args = [url, str(scripts.script_location), scripts.version_table, str(go)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", program, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    go.touch()
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outcomes.append(out.splitlines()[-1])  # after any log lines
    assert sorted(outcomes) == ["None", "a", "a"]


def test_a_failed_migration_leaves_the_schema_as_it_was(url: str, tmp_path: Path) -> None:
    engine = create_engine(url)
    try:
        migrate(engine, environment(tmp_path / "v1", CREATE_WIDGETS))
        broken = environment(tmp_path / "v2", CREATE_WIDGETS)
        failing = ADD_COLOUR.replace("{then}", 'raise RuntimeError("half-way")')
        (broken.script_location / "versions" / "0001.py").write_text(failing)
        with pytest.raises(RuntimeError, match="half-way"):
            migrate(engine, broken)
        columns = {c["name"] for c in inspect(engine).get_columns("widgets")}
        assert columns == {"id", "name"}
        assert migrate(engine, environment(tmp_path / "v1", CREATE_WIDGETS)) == "a"
    finally:
        engine.dispose()


def test_a_database_migrated_by_a_newer_version_is_refused(url: str, tmp_path: Path) -> None:
    engine = create_engine(url)
    try:
        migrate(engine, environment(tmp_path / "new", CREATE_WIDGETS, ADD_COLOUR))
        with pytest.raises(FailedPreconditionError, match="revision 'b'") as caught:
            migrate(engine, environment(tmp_path / "old", CREATE_WIDGETS))
        assert caught.value.reason == "SCHEMA_REVISION_UNKNOWN"
    finally:
        engine.dispose()


def test_two_environments_share_a_database_and_the_check_sees_only_its_own(
    url: str, tmp_path: Path
) -> None:
    gadgets = CREATE_WIDGETS.replace('"widgets"', '"gadgets"')
    engine = create_engine(url)
    try:
        widgets_env = environment(tmp_path / "w", CREATE_WIDGETS, ADD_COLOUR)
        gadgets_env = environment(tmp_path / "g", gadgets, version_table="gadgets_version")
        assert migrate(engine, widgets_env) is None
        assert migrate(engine, gadgets_env) is None  # its own version table: from scratch
        assert {"widgets", "gadgets"} <= set(inspect(engine).get_table_names())

        def colour() -> Column[str]:
            return Column("colour", String(16), nullable=False, server_default="blue")

        assert schema_differences(engine, widgets_env, [widgets(colour())]) == []
        # Not vacuous: a column the models have and the database lacks is reported.
        size = Column("size", Integer, nullable=True)
        diffs = schema_differences(engine, widgets_env, [widgets(colour(), size)])
        assert [(d[0], d[2], d[3].name) for d in diffs] == [("add_column", "widgets", "size")]
    finally:
        engine.dispose()

"""Schema migrations of the orchestrator database (Alembic): the catalogue, fleet and
placements (`store/sql.py`), the release state (`release/store.py`) and the leader lease
(`store/lease.py`), which share one database. The stores run them at start-up
(`inferplane.storage.migrate`); how to add one: `services/orchestrator/README.md`."""

from pathlib import Path

from inferplane.storage import Migrations

MIGRATIONS = Migrations(Path(__file__).parent, version_table="orchestrator_alembic_version")

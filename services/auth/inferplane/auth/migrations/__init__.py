"""Schema migrations of the auth database (Alembic): API keys and their audit log
(`sql_store.py`), rate counters and concurrency leases (`counters.py`). Every auth store runs
them at start-up (`inferplane.storage.migrate`); how to add one: `services/auth/README.md`."""

from pathlib import Path

from inferplane.storage import Migrations

MIGRATIONS = Migrations(Path(__file__).parent, version_table="auth_alembic_version")

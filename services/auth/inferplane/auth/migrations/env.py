"""Alembic environment of the auth database (run by Alembic, never imported)."""

from inferplane.auth import counters, ledger, responses_store, sql_store
from inferplane.auth.migrations import MIGRATIONS
from inferplane.storage import run_env

run_env(
    MIGRATIONS, [sql_store.METADATA, counters.METADATA, ledger.METADATA, responses_store.METADATA]
)

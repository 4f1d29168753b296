"""Alembic environment of the auth database (run by Alembic, never imported)."""

from inferplane.auth.migrations import MIGRATIONS
from inferplane.auth.schema import METADATA
from inferplane.storage import run_env

run_env(MIGRATIONS, list(METADATA))

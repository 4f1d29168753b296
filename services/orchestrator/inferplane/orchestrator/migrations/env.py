"""Alembic environment of the orchestrator database (run by Alembic, never imported)."""

from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.release import matrix as compatibility_matrix
from inferplane.orchestrator.release import store as release_store
from inferplane.orchestrator.store import lease as lease_store
from inferplane.orchestrator.store import sql as state_store
from inferplane.storage import run_env

run_env(
    MIGRATIONS,
    [
        state_store.METADATA,
        release_store.METADATA,
        lease_store.METADATA,
        compatibility_matrix.METADATA,
    ],
)

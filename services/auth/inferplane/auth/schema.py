"""Every table of the auth database, by the module that owns it: what Alembic's environment
compares the migrations with (`migrations/env.py`) and what a test drops to migrate a shared
database afresh. A module that adds tables adds its `METADATA` here, once."""

from __future__ import annotations

from sqlalchemy import MetaData

from inferplane.auth import counters, ledger, peer_store, responses_store, sql_store

METADATA: tuple[MetaData, ...] = (
    sql_store.METADATA,
    counters.METADATA,
    ledger.METADATA,
    responses_store.METADATA,
    peer_store.METADATA,
)
"""API keys and their audit log, rate counters and leases, the usage ledger, stored
responses, the other regions' keys."""

"""Baseline: the auth schema as `create_all` made it before migrations existed.

A database made by that code has no version table and some or all of these tables (the rate
counters only when `limits_store` was "sql"): the ones present are kept as they are, the
missing ones created, so it is adopted in place.

Revision ID: 0001
Revises:
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)
# The counters' integers are BIGINT, except on SQLite where INTEGER is already 64-bit.
_COUNT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    if "api_keys" not in existing:
        op.create_table(
            "api_keys",
            sa.Column("key_id", sa.String(length=32), nullable=False),
            sa.Column("display_name", sa.String(length=200), nullable=False),
            sa.Column("tenant", sa.String(length=128), nullable=False),
            sa.Column("scopes", sa.JSON(), nullable=False),
            sa.Column("has_admin_scope", sa.Boolean(), nullable=False),
            sa.Column("allowed_models", sa.JSON(), nullable=False),
            sa.Column("expire_time", _TIME, nullable=True),
            sa.Column("requests_per_minute", sa.Integer(), nullable=False),
            sa.Column("tokens_per_minute", sa.Integer(), nullable=False),
            sa.Column("max_concurrent_requests", sa.Integer(), nullable=False),
            sa.Column("tier", sa.String(length=32), nullable=False),
            sa.Column("key_prefix", sa.String(length=16), nullable=False),
            sa.Column("secret_hash", sa.String(length=64), nullable=False),
            sa.Column("previous_secret_hash", sa.String(length=64), nullable=True),
            sa.Column("previous_secret_expire_time", _TIME, nullable=True),
            sa.Column("create_time", _TIME, nullable=False),
            sa.Column("update_time", _TIME, nullable=False),
            sa.Column("last_used_time", _TIME, nullable=True),
            sa.Column("revoke_time", _TIME, nullable=True),
            sa.PrimaryKeyConstraint("key_id"),
            sa.UniqueConstraint("secret_hash"),
        )
        op.create_index("ix_api_keys_create_time_key_id", "api_keys", ["create_time", "key_id"])
        op.create_index("ix_api_keys_previous_secret_hash", "api_keys", ["previous_secret_hash"])
        op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])
    if "api_key_audit_log" not in existing:
        op.create_table(
            "api_key_audit_log",
            sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("time", _TIME, nullable=False),
            sa.Column("action", sa.String(length=16), nullable=False),
            sa.Column("key_id", sa.String(length=32), nullable=False),
            sa.Column("actor_key_id", sa.String(length=32), nullable=False),
            sa.Column("tenant", sa.String(length=128), nullable=False),
            sa.Column("detail", sa.JSON(), nullable=False),
            sa.PrimaryKeyConstraint("id"),
        )
        op.create_index("ix_api_key_audit_log_key_id", "api_key_audit_log", ["key_id"])
    if "rate_counters" not in existing:
        op.create_table(
            "rate_counters",
            sa.Column("key_id", sa.String(length=32), nullable=False),
            sa.Column("window", _COUNT, nullable=False),
            sa.Column("requests", _COUNT, nullable=False),
            sa.Column("tokens", _COUNT, nullable=False),
            sa.PrimaryKeyConstraint("key_id", "window"),
        )
    if "concurrency_leases" not in existing:
        op.create_table(
            "concurrency_leases",
            sa.Column("key_id", sa.String(length=32), nullable=False),
            sa.Column("request_id", sa.String(length=128), nullable=False),
            sa.Column("expire_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("key_id", "request_id"),
        )
        op.create_index("ix_concurrency_leases_expire_at", "concurrency_leases", ["expire_at"])


def downgrade() -> None:
    op.drop_table("concurrency_leases")
    op.drop_table("rate_counters")
    op.drop_table("api_key_audit_log")
    op.drop_table("api_keys")

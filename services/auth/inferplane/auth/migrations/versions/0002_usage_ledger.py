"""The usage ledger: one row per finished request, per-key monthly token totals, and the
monthly token budget limit of API keys (`inferplane.auth.ledger`).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)
# Counts are BIGINT, except on SQLite where INTEGER is already 64-bit.
_COUNT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("monthly_token_budget", _COUNT, nullable=False, server_default="0")
        )
    with op.batch_alter_table("api_keys") as batch:
        # The default only filled the rows that existed; the model sets the value itself.
        batch.alter_column("monthly_token_budget", server_default=None)
    op.create_table(
        "usage_ledger",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("deployment", sa.String(length=256), nullable=False),
        sa.Column("replica", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("prompt_tokens", _COUNT, nullable=False),
        sa.Column("cached_tokens", _COUNT, nullable=False),
        sa.Column("completion_tokens", _COUNT, nullable=False),
        sa.Column("reasoning_tokens", _COUNT, nullable=False),
        sa.Column("ttft_seconds", sa.Float(), nullable=False),
        sa.Column("duration_seconds", sa.Float(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("start_time", _TIME, nullable=True),
        sa.Column("end_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("request_id"),
    )
    op.create_index("ix_usage_ledger_end_time", "usage_ledger", ["end_time", "request_id"])
    op.create_index("ix_usage_ledger_key_id_end_time", "usage_ledger", ["key_id", "end_time"])
    op.create_index("ix_usage_ledger_tenant_end_time", "usage_ledger", ["tenant", "end_time"])
    op.create_table(
        "usage_monthly",
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("month", sa.String(length=7), nullable=False),
        sa.Column("tokens", _COUNT, nullable=False),
        sa.PrimaryKeyConstraint("key_id", "month"),
    )


def downgrade() -> None:
    op.drop_table("usage_monthly")
    op.drop_table("usage_ledger")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("monthly_token_budget")

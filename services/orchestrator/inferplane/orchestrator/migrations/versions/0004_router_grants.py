"""What the leader granted routers of the replicas' concurrency caps (issue 20: a new leader
adopts it instead of granting nothing for a whole router lease).

`router_grants`: one row per lease name ("orchestrator"): the term of the leader that wrote it
and, as JSON, each router's held in-flight bound per replica. Starts empty.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "router_grants",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("update_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("router_grants")

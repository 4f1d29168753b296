"""The leader lease and the routing table the leader publishes (issue 20: several orchestrators
on one database, one leading).

`leader_leases`: one row per lease (the orchestrators' is "orchestrator"): holder id, fencing
term, version, the holder's lease duration and its last renewal time. `routing_tables`: the
table the leader serves, stored for standbys to serve too. Both start empty: the first
orchestrator to start inserts the lease row.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "leader_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("duration_seconds", sa.Float(), nullable=False),
        sa.Column("renew_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "routing_tables",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=32), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("update_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("routing_tables")
    op.drop_table("leader_leases")

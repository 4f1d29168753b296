"""Regions (issue 31; docs/regions.md): every key's home region and its data-residency pin
(`api_keys.home_region`, `region_pinned`; "" and false for keys from before regions), and
`peer_key_entries`, this region's copy of the other regions' keys (`inferplane.auth.peers`):
one row per secret hash, the `KeyEntry` as its peer sent it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("home_region", sa.String(length=16), nullable=False, server_default="")
        )
        batch.add_column(
            sa.Column("region_pinned", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("api_keys") as batch:
        # The defaults only filled the rows that existed; the store sets the values itself.
        batch.alter_column("home_region", server_default=None)
        batch.alter_column("region_pinned", server_default=None)
    op.create_table(
        "peer_key_entries",
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("region", sa.String(length=16), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("entry", sa.LargeBinary(), nullable=False),
        sa.Column("update_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("region", "secret_hash"),
    )


def downgrade() -> None:
    op.drop_table("peer_key_entries")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("region_pinned")
        batch.drop_column("home_region")

"""LoRA adapters (issue 29): catalogue objects on top of a base deployment.

`lora_adapters`: one row per adapter (id, base deployment id, source folder, rank, aliases as
JSON, phase "Ready" or "Deleting", create time, delete time while deleting). Starts empty.
Profiles gain `max_loras` / `max_lora_rank` inside the deployments' profile JSON (no column).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("adapter_id", sa.String(length=128), nullable=False),
        sa.Column("base_deployment", sa.String(length=128), nullable=False),
        sa.Column("source", sa.String(length=4096), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("aliases", sa.JSON(), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("create_time", _TIME, nullable=False),
        sa.Column("delete_time", _TIME, nullable=True),
        sa.PrimaryKeyConstraint("adapter_id"),
    )
    op.create_index("ix_lora_adapters_base_deployment", "lora_adapters", ["base_deployment"])


def downgrade() -> None:
    op.drop_index("ix_lora_adapters_base_deployment", table_name="lora_adapters")
    op.drop_table("lora_adapters")

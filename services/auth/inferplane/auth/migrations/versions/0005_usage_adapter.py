"""The usage ledger's `adapter` column: the LoRA adapter that served a request (its catalogue
name, issue 29); "" for the base model. Rows written before it say "".

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.add_column(
            sa.Column("adapter", sa.String(length=128), nullable=False, server_default="")
        )
    with op.batch_alter_table("usage_ledger") as batch:
        # The default only filled the rows that existed; the writer sets the value itself.
        batch.alter_column("adapter", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("adapter")

"""The usage ledger's `provisional` column: a row a router wrote without hearing how the
request ended (`RequestUsage.provisional`), which the first non-provisional report of the same
request id replaces. Rows written before it are final (false).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.add_column(
            sa.Column("provisional", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("usage_ledger") as batch:
        # The default only filled the rows that existed; the writer sets the value itself.
        batch.alter_column("provisional", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("provisional")

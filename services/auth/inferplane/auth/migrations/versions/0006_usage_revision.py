"""The usage ledger's `revision` column: the profile revision of the replica that served a
request (issue 30: usage per revision during a canary); "" when none did or the reporting
router is older. Rows written before it say "".

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


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.add_column(
            sa.Column("revision", sa.String(length=128), nullable=False, server_default="")
        )
    with op.batch_alter_table("usage_ledger") as batch:
        # The default only filled the rows that existed; the writer sets the value itself.
        batch.alter_column("revision", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("revision")

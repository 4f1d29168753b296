"""The usage ledger's `api` column: which public API a request came through (`chat`,
`completion`, `embedding`, `transcription`, `translation`, `messages`, `responses`:
`inferplane.wire.apis`). Rows written before it say "" (unknown).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.add_column(sa.Column("api", sa.String(length=32), nullable=False, server_default=""))
    with op.batch_alter_table("usage_ledger") as batch:
        # The default only filled the rows that existed; the writer sets the value itself.
        batch.alter_column("api", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("api")

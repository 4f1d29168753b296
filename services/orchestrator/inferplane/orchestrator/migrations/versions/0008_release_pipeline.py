"""The release pipeline (issue 30): a release's stage, candidate revision, gate verdicts and
canary window, as one JSON document on the `releases` row (`release/store.py`,
`Progress` in `release/progress.py`). NULL: no pipeline state (every release from
before this revision, and a deployment that never rolled out).

Revision ID: 0008
Revises: 0007 (the compatibility matrix)
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("releases") as batch:
        batch.add_column(sa.Column("pipeline", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("releases") as batch:
        batch.drop_column("pipeline")

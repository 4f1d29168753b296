"""uint32 counts as BIGINT (replicas, min_replicas, max_replicas of a deployment; cpu_count).

They were INTEGER until 2026-11-23 (commit 91bd438), and `create_all` never alters a table, so a
database made before kept INTEGER: on PostgreSQL a max_replicas past 2^31 - 1 passed validation,
then CreateDeployment failed with INTERNAL. SQLite stored such values (its INTEGER holds 64 bits);
its tables are rebuilt too, so that every database's schema is the models' exactly. A column that
is BIGINT already (every database made by 0001) is left alone.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = {"deployments": ("replicas", "min_replicas", "max_replicas"), "nodes": ("cpu_count",)}


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    for table, columns in _COLUMNS.items():
        types = {c["name"]: c["type"] for c in inspector.get_columns(table)}
        narrow = [c for c in columns if not isinstance(types[c], sa.BigInteger)]
        if not narrow:
            continue
        with op.batch_alter_table(table) as batch:
            for column in narrow:
                batch.alter_column(
                    column,
                    type_=sa.BigInteger(),
                    existing_type=sa.Integer(),
                    existing_nullable=False,
                )


def downgrade() -> None:
    pass  # 0001 declares these columns BIGINT already

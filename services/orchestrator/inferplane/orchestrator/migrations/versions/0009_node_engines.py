"""The engines and capabilities a node reports (issue 30), kept with the node.

`nodes.engines`: the node's `EngineInstall`s as JSON (engine, version, location, default);
`nodes.capabilities`: its `NodeCapabilities` as JSON (cpu_features, cpu_model, kv_cache_dtypes,
speculative_methods). Both nullable: rows from before this revision read as "not reported yet"
until the node's next heartbeat (placement keeps such a node's replicas and places nothing on it
that needs an engine version or a capability).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("engines", sa.JSON(), nullable=True))
    op.add_column("nodes", sa.Column("capabilities", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "capabilities")
    op.drop_column("nodes", "engines")

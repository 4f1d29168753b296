"""The compatibility matrix (issue 30): release verdicts per combination and forced changes.

`compatibility_verdicts`: one row per recorded verdict (engine, engine version, weights digest,
chat template digest, parsers; verdict "qualified"/"failed"/"unqualified"; the gates' verdicts
as JSON; the deployment and revision measured; update time); a combination's verdict is its
newest row. `forced_changes`: creates and updates that overrode a failed verdict (deployment,
revision, actor, reason, the overridden verdict, time). `compatibility_grandfathered`: every
(deployment, revision) existing now, copied from `deployments`: their replicas' combinations
are recorded "unqualified" when first reported (`release/matrix.py`), since digests are not
known here.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)
_FIELD = sa.String(length=256)


def upgrade() -> None:
    op.create_table(
        "compatibility_verdicts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("engine", _FIELD, nullable=False),
        sa.Column("engine_version", _FIELD, nullable=False),
        sa.Column("model_digest", _FIELD, nullable=False),
        sa.Column("chat_template_digest", _FIELD, nullable=False),
        sa.Column("parser", _FIELD, nullable=False),
        sa.Column("verdict", sa.String(length=16), nullable=False),
        sa.Column("gates", sa.JSON(), nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("revision", sa.String(length=32), nullable=False),
        sa.Column("update_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    for column in ("engine_version", "model_digest", "deployment"):
        op.create_index(f"ix_compatibility_verdicts_{column}", "compatibility_verdicts", [column])
    op.create_table(
        "forced_changes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment", sa.String(length=128), nullable=False),
        sa.Column("revision", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("overridden", sa.Text(), nullable=False),
        sa.Column("create_time", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_forced_changes_deployment", "forced_changes", ["deployment"])
    op.create_table(
        "compatibility_grandfathered",
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("revision", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("deployment_id", "revision"),
    )
    op.execute(
        "INSERT INTO compatibility_grandfathered (deployment_id, revision) "
        "SELECT deployment_id, revision FROM deployments"
    )


def downgrade() -> None:
    op.drop_table("compatibility_grandfathered")
    op.drop_index("ix_forced_changes_deployment", table_name="forced_changes")
    op.drop_table("forced_changes")
    for column in ("engine_version", "model_digest", "deployment"):
        op.drop_index(f"ix_compatibility_verdicts_{column}", table_name="compatibility_verdicts")
    op.drop_table("compatibility_verdicts")

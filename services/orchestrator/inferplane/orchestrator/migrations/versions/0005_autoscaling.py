"""Autoscaling (issue 29): a deployment's autoscaling settings and the autoscaler's recent
decisions.

`deployments.autoscaling`: JSON, NULL when the deployment never had autoscaling set (its
`replicas` stays the operator's). `autoscaler_decisions`: one row per decision that changed a
deployment's replicas (deployment, time, decision, replicas before and after, reason, the
signals read as JSON), newest by id; the autoscaler keeps a bounded number per deployment.
Starts empty.

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

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("autoscaling", sa.JSON(), nullable=True))
    op.create_table(
        "autoscaler_decisions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment_id", sa.String(length=128), nullable=False),
        sa.Column("time", _TIME, nullable=False),
        sa.Column("decision", sa.String(length=32), nullable=False),
        sa.Column("from_replicas", sa.BigInteger(), nullable=False),
        sa.Column("to_replicas", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("signals", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_autoscaler_decisions_deployment_id", "autoscaler_decisions", ["deployment_id"]
    )


def downgrade() -> None:
    op.drop_index("ix_autoscaler_decisions_deployment_id", table_name="autoscaler_decisions")
    op.drop_table("autoscaler_decisions")
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("autoscaling")

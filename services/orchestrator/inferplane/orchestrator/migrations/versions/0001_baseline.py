"""Baseline: the orchestrator schema as `create_all` made it before migrations existed.

A database made by that code has no version table and these tables: the ones present are kept
as they are (0002 widens what an older one lacks), the missing ones created, so it is adopted in
place.

Revision ID: 0001
Revises:
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `inferplane.storage.UtcDateTime` in the models: this is the column type it creates.
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    if "deployments" not in existing:
        op.create_table(
            "deployments",
            sa.Column("deployment_id", sa.String(length=128), nullable=False),
            sa.Column("profile", sa.JSON(), nullable=False),
            sa.Column("revision", sa.String(length=32), nullable=False),
            sa.Column("replicas", sa.BigInteger(), nullable=False),
            sa.Column("min_replicas", sa.BigInteger(), nullable=False),
            sa.Column("max_replicas", sa.BigInteger(), nullable=False),
            sa.Column("rollout", sa.JSON(), nullable=False),
            sa.Column("owned_by", sa.String(length=200), nullable=False),
            sa.Column("routing_policy", sa.String(length=64), nullable=False),
            sa.Column("create_time", _TIME, nullable=False),
            sa.Column("update_time", _TIME, nullable=False),
            sa.PrimaryKeyConstraint("deployment_id"),
        )
    if "deployment_aliases" not in existing:
        op.create_table(
            "deployment_aliases",
            sa.Column("alias", sa.String(length=256), nullable=False),
            sa.Column("deployment_id", sa.String(length=128), nullable=False),
            sa.Column("position", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("alias"),
        )
        op.create_index(
            "ix_deployment_aliases_deployment_id", "deployment_aliases", ["deployment_id"]
        )
    if "nodes" not in existing:
        op.create_table(
            "nodes",
            sa.Column("name", sa.String(length=253), nullable=False),
            sa.Column("address", sa.String(length=300), nullable=False),
            sa.Column("gpus", sa.JSON(), nullable=False),
            sa.Column("cpu_count", sa.BigInteger(), nullable=False),
            sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
            sa.Column("labels", sa.JSON(), nullable=False),
            sa.Column("agent_version", sa.String(length=64), nullable=False),
            sa.Column("condition", sa.String(length=16), nullable=False),
            sa.Column("unschedulable", sa.Boolean(), nullable=False),
            sa.Column("last_heartbeat_time", _TIME, nullable=True),
            sa.Column("register_time", _TIME, nullable=True),
            sa.PrimaryKeyConstraint("name"),
        )
    if "placements" not in existing:
        op.create_table(
            "placements",
            sa.Column("replica_id", sa.String(length=160), nullable=False),
            sa.Column("deployment_id", sa.String(length=128), nullable=False),
            sa.Column("revision", sa.String(length=32), nullable=False),
            sa.Column("node", sa.String(length=253), nullable=False),
            sa.Column("accelerator", sa.String(length=8), nullable=False),
            sa.Column("gpu_indices", sa.JSON(), nullable=False),
            sa.Column("memory_bytes_per_device", sa.BigInteger(), nullable=False),
            sa.Column("memory_fraction", sa.Float(), nullable=False),
            sa.Column("kv_cache_bytes", sa.BigInteger(), nullable=False),
            sa.Column("decision", sa.String(length=16), nullable=False),
            sa.Column("free_before_bytes", sa.BigInteger(), nullable=False),
            sa.Column("spread_rank", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("replica_id"),
        )
        op.create_index("ix_placements_deployment_id", "placements", ["deployment_id"])
        op.create_index("ix_placements_node", "placements", ["node"])
    if "managed_replicas" not in existing:
        op.create_table(
            "managed_replicas",
            sa.Column("node", sa.String(length=253), nullable=False),
            sa.Column("replica_id", sa.String(length=63), nullable=False),
            sa.Column("deployment_id", sa.String(length=128), nullable=False),
            sa.Column("slot", sa.String(length=160), nullable=False),
            sa.Column("address", sa.String(length=300), nullable=False),
            sa.Column("revision", sa.String(length=32), nullable=False),
            sa.Column("stage", sa.String(length=16), nullable=False),
            sa.Column("stage_since", _TIME, nullable=False),
            sa.Column("spec", sa.LargeBinary(), nullable=False),
            sa.PrimaryKeyConstraint("node", "replica_id"),
        )
        op.create_index("ix_managed_replicas_deployment_id", "managed_replicas", ["deployment_id"])
    if "releases" not in existing:
        op.create_table(
            "releases",
            sa.Column("deployment_id", sa.String(length=128), nullable=False),
            sa.Column("serving_revision", sa.String(length=32), nullable=False),
            sa.Column("serving_profile", sa.JSON(), nullable=True),
            sa.Column("failed_revision", sa.String(length=32), nullable=False),
            sa.Column("failure", sa.Text(), nullable=False),
            sa.PrimaryKeyConstraint("deployment_id"),
        )


def downgrade() -> None:
    op.drop_table("releases")
    op.drop_table("managed_replicas")
    op.drop_table("placements")
    op.drop_table("nodes")
    op.drop_table("deployment_aliases")
    op.drop_table("deployments")

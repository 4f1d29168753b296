"""SQLAlchemy 2 adapter of `StateStore`: SQLite by default, PostgreSQL with the same code.

Portable SQL only (no dialect-specific statements beyond SQLite's connection pragmas: WAL and a
busy timeout). With a `fence` (the leader lease, `store/lease.py`), every commit runs the fence
first in its transaction: a deposed leader's change is refused with NotLeaderError and nothing
of it is written. Nested values (profile, rollout, GPUs, labels) are JSON columns; byte counts and
the contract's uint32 counts are BIGINT (they pass 2^31). Alias uniqueness is a primary key on
`deployment_aliases.alias`, so two deployments can never claim one name even if two writers
raced.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Engine,
    Float,
    Integer,
    String,
    Text,
    delete,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from inferplane.orchestrator.autoscale.model import DECISIONS_KEPT, ScaleDecision, Signals
from inferplane.orchestrator.catalog.model import (
    MAX_OWNED_BY,
    Accelerator,
    Autoscaling,
    Deployment,
    DeploymentProfile,
    LoraAdapter,
    RolloutStrategy,
)
from inferplane.orchestrator.fleet.model import (
    MAX_AGENT_VERSION,
    MAX_NODE_ADDRESS,
    MAX_NODE_NAME,
    EngineInstall,
    Gpu,
    GpuPartition,
    Node,
    NodeCapabilities,
    NodeCondition,
)
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.placement.model import Decision, Placement
from inferplane.orchestrator.store.base import StateChange, StateSnapshot
from inferplane.orchestrator.store.lease import Fence
from inferplane.runtime import AlreadyExistsError
from inferplane.storage import SqlDatabase, UtcDateTime


class _Base(DeclarativeBase):
    pass


class _DeploymentRow(_Base):
    __tablename__ = "deployments"

    deployment_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    profile: Mapped[dict[str, Any]] = mapped_column(JSON)
    revision: Mapped[str] = mapped_column(String(32))
    # uint32 in the contract: past INTEGER's 2^31 - 1 on PostgreSQL.
    replicas: Mapped[int] = mapped_column(BigInteger)
    min_replicas: Mapped[int] = mapped_column(BigInteger)
    max_replicas: Mapped[int] = mapped_column(BigInteger)
    rollout: Mapped[dict[str, Any]] = mapped_column(JSON)
    owned_by: Mapped[str] = mapped_column(String(MAX_OWNED_BY))
    routing_policy: Mapped[str] = mapped_column(String(64))
    create_time: Mapped[datetime] = mapped_column(UtcDateTime)
    update_time: Mapped[datetime] = mapped_column(UtcDateTime)
    # `Autoscaling` as JSON; NULL: never set (migration 0005).
    autoscaling: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class _AutoscalerDecisionRow(_Base):
    """One autoscaler decision that changed a deployment's replicas (migration 0005)."""

    __tablename__ = "autoscaler_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment_id: Mapped[str] = mapped_column(String(128), index=True)
    time: Mapped[datetime] = mapped_column(UtcDateTime)
    decision: Mapped[str] = mapped_column(String(32))
    from_replicas: Mapped[int] = mapped_column(BigInteger)
    to_replicas: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    signals: Mapped[dict[str, Any]] = mapped_column(JSON)


class _AliasRow(_Base):
    __tablename__ = "deployment_aliases"

    alias: Mapped[str] = mapped_column(String(256), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(String(128), index=True)
    position: Mapped[int] = mapped_column(Integer)


class _NodeRow(_Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(MAX_NODE_NAME), primary_key=True)
    address: Mapped[str] = mapped_column(String(MAX_NODE_ADDRESS))
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    cpu_count: Mapped[int] = mapped_column(BigInteger)  # uint32 in the contract
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    agent_version: Mapped[str] = mapped_column(String(MAX_AGENT_VERSION))
    # Issue 30 (migration 0009); NULL: not reported since before that revision.
    engines: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    capabilities: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    condition: Mapped[str] = mapped_column(String(16))
    unschedulable: Mapped[bool] = mapped_column(Boolean)
    last_heartbeat_time: Mapped[datetime | None] = mapped_column(UtcDateTime)
    register_time: Mapped[datetime | None] = mapped_column(UtcDateTime)


class _PlacementRow(_Base):
    __tablename__ = "placements"

    replica_id: Mapped[str] = mapped_column(String(160), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(String(128), index=True)
    revision: Mapped[str] = mapped_column(String(32))
    node: Mapped[str] = mapped_column(String(MAX_NODE_NAME), index=True)
    accelerator: Mapped[str] = mapped_column(String(8))
    gpu_indices: Mapped[list[int]] = mapped_column(JSON)
    memory_bytes_per_device: Mapped[int] = mapped_column(BigInteger)
    memory_fraction: Mapped[float] = mapped_column(Float)
    kv_cache_bytes: Mapped[int] = mapped_column(BigInteger)
    decision: Mapped[str] = mapped_column(String(16))
    free_before_bytes: Mapped[int] = mapped_column(BigInteger)
    spread_rank: Mapped[int] = mapped_column(Integer)


class _AdapterRow(_Base):
    """A LoRA adapter (migration 0006). Its model names are checked unique against every
    deployment's and adapter's by the catalogue under its lock (one fenced writer)."""

    __tablename__ = "lora_adapters"

    adapter_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_deployment: Mapped[str] = mapped_column(String(128), index=True)
    source: Mapped[str] = mapped_column(String(4096))
    rank: Mapped[int] = mapped_column(BigInteger)
    aliases: Mapped[list[str]] = mapped_column(JSON)
    phase: Mapped[str] = mapped_column(String(16))
    create_time: Mapped[datetime] = mapped_column(UtcDateTime)
    delete_time: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)


#: The tables this store maps: a target of the orchestrator database's migrations.
METADATA = _Base.metadata


def _deployment_row(d: Deployment, row: _DeploymentRow) -> None:
    profile = dataclasses.asdict(d.profile)
    profile["extra_engine_args"] = list(d.profile.extra_engine_args)
    row.deployment_id = d.deployment_id
    row.profile = profile
    row.revision = d.revision
    row.replicas = d.replicas
    row.min_replicas = d.min_replicas
    row.max_replicas = d.max_replicas
    row.rollout = dataclasses.asdict(d.rollout)
    row.owned_by = d.owned_by
    row.routing_policy = d.routing_policy
    assert d.create_time is not None and d.update_time is not None
    row.create_time = d.create_time
    row.update_time = d.update_time
    row.autoscaling = None if d.autoscaling == Autoscaling() else dataclasses.asdict(d.autoscaling)


def _deployment(row: _DeploymentRow, aliases: tuple[str, ...]) -> Deployment:
    profile = dict(row.profile)
    profile["extra_engine_args"] = tuple(profile.get("extra_engine_args", ()))
    return Deployment(
        deployment_id=row.deployment_id,
        profile=DeploymentProfile(**profile),
        replicas=row.replicas,
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        aliases=aliases,
        rollout=RolloutStrategy(**row.rollout),
        owned_by=row.owned_by,
        routing_policy=row.routing_policy,
        revision=row.revision,
        create_time=row.create_time,
        update_time=row.update_time,
        autoscaling=Autoscaling(**row.autoscaling) if row.autoscaling else Autoscaling(),
    )


def _gpu_json(g: Gpu) -> dict[str, Any]:
    data = dataclasses.asdict(g)
    data["partitions"] = [dataclasses.asdict(p) for p in g.partitions]
    return data


def _gpu(data: dict[str, Any]) -> Gpu:
    parts = tuple(GpuPartition(**p) for p in data.get("partitions", ()))
    return Gpu(**{**data, "partitions": parts})


def _node_row(n: Node, row: _NodeRow) -> None:
    row.name = n.name
    row.address = n.address
    row.gpus = [_gpu_json(g) for g in n.gpus]
    row.cpu_count = n.cpu_count
    row.memory_bytes = n.memory_bytes
    row.labels = dict(n.labels)
    row.agent_version = n.agent_version
    row.engines = None if n.engines is None else [dataclasses.asdict(e) for e in n.engines]
    row.capabilities = None if n.capabilities is None else dataclasses.asdict(n.capabilities)
    row.condition = n.condition.value
    row.unschedulable = n.unschedulable
    row.last_heartbeat_time = n.last_heartbeat_time
    row.register_time = n.register_time


def _tuple_if_list(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _node(row: _NodeRow) -> Node:
    return Node(
        name=row.name,
        address=row.address,
        gpus=tuple(_gpu(g) for g in row.gpus),
        cpu_count=row.cpu_count,
        memory_bytes=row.memory_bytes,
        labels=tuple(sorted(row.labels.items())),
        agent_version=row.agent_version,
        engines=None if row.engines is None else tuple(EngineInstall(**e) for e in row.engines),
        capabilities=None
        if row.capabilities is None
        else NodeCapabilities(**{k: _tuple_if_list(v) for k, v in row.capabilities.items()}),
        condition=NodeCondition(row.condition),
        unschedulable=row.unschedulable,
        last_heartbeat_time=row.last_heartbeat_time,
        register_time=row.register_time,
    )


def _placement_row(p: Placement, row: _PlacementRow) -> None:
    row.replica_id = p.replica_id
    row.deployment_id = p.deployment_id
    row.revision = p.revision
    row.node = p.node
    row.accelerator = p.accelerator.value
    row.gpu_indices = list(p.gpu_indices)
    row.memory_bytes_per_device = p.memory_bytes_per_device
    row.memory_fraction = p.memory_fraction
    row.kv_cache_bytes = p.kv_cache_bytes
    row.decision = p.decision.value
    row.free_before_bytes = p.free_before_bytes
    row.spread_rank = p.spread_rank


def _adapter_row(a: LoraAdapter, row: _AdapterRow) -> None:
    row.adapter_id = a.adapter_id
    row.base_deployment = a.base_deployment
    row.source = a.source
    row.rank = a.rank
    row.aliases = list(a.aliases)
    row.phase = a.phase
    assert a.create_time is not None
    row.create_time = a.create_time
    row.delete_time = a.delete_time


def _adapter(row: _AdapterRow) -> LoraAdapter:
    return LoraAdapter(
        adapter_id=row.adapter_id,
        base_deployment=row.base_deployment,
        source=row.source,
        rank=row.rank,
        aliases=tuple(row.aliases),
        phase=row.phase,
        create_time=row.create_time,
        delete_time=row.delete_time,
    )


def _placement(row: _PlacementRow) -> Placement:
    return Placement(
        replica_id=row.replica_id,
        deployment_id=row.deployment_id,
        revision=row.revision,
        node=row.node,
        accelerator=Accelerator(row.accelerator),
        gpu_indices=tuple(row.gpu_indices),
        memory_bytes_per_device=row.memory_bytes_per_device,
        memory_fraction=row.memory_fraction,
        kv_cache_bytes=row.kv_cache_bytes,
        decision=Decision(row.decision),
        free_before_bytes=row.free_before_bytes,
        spread_rank=row.spread_rank,
    )


class SqlStateStore:
    """`StateStore` on SQLAlchemy; `url` e.g. `sqlite:////var/lib/inferplane/orchestrator.db`
    or `postgresql+psycopg://user@host:5432/orchestrator`; `fence`: run first in every commit's
    transaction (None: writes are not fenced)."""

    def __init__(self, url: str, *, echo: bool = False, fence: Fence | None = None) -> None:
        self._db = SqlDatabase(
            url, what="orchestrator database", reason="ORCHESTRATOR_STORE_UNAVAILABLE", echo=echo
        )
        self._tx = self._db.transaction
        self._fence = fence

    @property
    def engine(self) -> Engine:
        return self._db.engine

    def create_schema(self) -> None:
        """Migrates the orchestrator database to the latest schema revision (`migrations/`)."""
        self._db.migrate(MIGRATIONS)

    def load(self) -> StateSnapshot:
        with self._tx() as s:
            aliases: dict[str, list[str]] = {}
            for alias in s.scalars(select(_AliasRow).order_by(_AliasRow.position)):
                aliases.setdefault(alias.deployment_id, []).append(alias.alias)
            deployments = [
                _deployment(r, tuple(aliases.get(r.deployment_id, ())))
                for r in s.scalars(select(_DeploymentRow))
            ]
            nodes = [_node(r) for r in s.scalars(select(_NodeRow))]
            placements = [_placement(r) for r in s.scalars(select(_PlacementRow))]
            adapters = [_adapter(r) for r in s.scalars(select(_AdapterRow))]
        # Sorted here, not by ORDER BY: that order is the database's collation (PostgreSQL in
        # an en_US locale puts "model-a" before "Model-B"; SQLite sorts by code point).
        return StateSnapshot(
            tuple(sorted(deployments, key=lambda d: d.deployment_id)),
            tuple(sorted(nodes, key=lambda n: n.name)),
            tuple(sorted(placements, key=lambda p: p.replica_id)),
            adapters=tuple(sorted(adapters, key=lambda a: a.adapter_id)),
        )

    def commit(self, change: StateChange) -> None:
        """See `StateStore.commit`; also raises NotLeaderError when the fence refuses it."""
        if change.is_empty():
            return
        try:
            with self._tx() as s:
                if self._fence is not None:
                    self._fence.fence(s)
                self._apply(s, change)
        except IntegrityError as exc:
            names = [d.deployment_id for d in change.create_deployments + change.put_deployments]
            raise AlreadyExistsError(
                f"a deployment id or alias of {', '.join(names)} is taken",
                reason="DEPLOYMENT_EXISTS",
            ) from exc

    def _apply(self, s: Session, change: StateChange) -> None:
        for deployment_id in change.delete_deployments:
            s.execute(delete(_AliasRow).where(_AliasRow.deployment_id == deployment_id))
            s.execute(delete(_DeploymentRow).where(_DeploymentRow.deployment_id == deployment_id))
            s.execute(
                delete(_AutoscalerDecisionRow).where(
                    _AutoscalerDecisionRow.deployment_id == deployment_id
                )
            )
        for replica_id in change.delete_placements:
            s.execute(delete(_PlacementRow).where(_PlacementRow.replica_id == replica_id))
        for d in change.create_deployments:
            row = _DeploymentRow()
            _deployment_row(d, row)
            s.add(row)
        for d in change.put_deployments:
            row = s.get(_DeploymentRow, d.deployment_id) or _DeploymentRow()
            _deployment_row(d, row)
            s.add(row)
            s.execute(delete(_AliasRow).where(_AliasRow.deployment_id == d.deployment_id))
        s.flush()  # alias rows freed above must be gone before they are re-inserted
        for d in change.create_deployments + change.put_deployments:
            for position, alias in enumerate(d.aliases):
                s.add(_AliasRow(alias=alias, deployment_id=d.deployment_id, position=position))
        for adapter_id in change.delete_adapters:
            s.execute(delete(_AdapterRow).where(_AdapterRow.adapter_id == adapter_id))
        for a in change.put_adapters:
            adapter_row = s.get(_AdapterRow, a.adapter_id) or _AdapterRow()
            _adapter_row(a, adapter_row)
            s.add(adapter_row)
        for n in change.put_nodes:
            node_row = s.get(_NodeRow, n.name) or _NodeRow()
            _node_row(n, node_row)
            s.add(node_row)
        for p in change.put_placements:
            placement_row = s.get(_PlacementRow, p.replica_id) or _PlacementRow()
            _placement_row(p, placement_row)
            s.add(placement_row)
        for decision in change.add_decisions:
            s.add(_decision_row(decision))
        for deployment_id in sorted({d.deployment_id for d in change.add_decisions}):
            _trim_decisions(s, deployment_id)

    def list_decisions(self, deployment_id: str, limit: int) -> tuple[ScaleDecision, ...]:
        """See `StateStore.list_decisions` (by insertion order: ids grow)."""
        query = select(_AutoscalerDecisionRow).order_by(_AutoscalerDecisionRow.id.desc())
        if deployment_id:
            query = query.where(_AutoscalerDecisionRow.deployment_id == deployment_id)
        with self._tx() as s:
            return tuple(_decision(r) for r in s.scalars(query.limit(limit)))

    def close(self) -> None:
        self._db.close()


def _decision_row(d: ScaleDecision) -> _AutoscalerDecisionRow:
    return _AutoscalerDecisionRow(
        deployment_id=d.deployment_id,
        time=d.time,
        decision=d.decision,
        from_replicas=d.from_replicas,
        to_replicas=d.to_replicas,
        reason=d.reason,
        signals=d.signals.to_json(),
    )


def _decision(row: _AutoscalerDecisionRow) -> ScaleDecision:
    return ScaleDecision(
        deployment_id=row.deployment_id,
        time=row.time,
        decision=row.decision,
        from_replicas=row.from_replicas,
        to_replicas=row.to_replicas,
        reason=row.reason,
        signals=Signals.from_json(row.signals),
    )


def _trim_decisions(s: Session, deployment_id: str) -> None:
    """Keeps the newest `DECISIONS_KEPT` decisions of the deployment."""
    s.flush()
    oldest_kept = s.scalar(
        select(_AutoscalerDecisionRow.id)
        .where(_AutoscalerDecisionRow.deployment_id == deployment_id)
        .order_by(_AutoscalerDecisionRow.id.desc())
        .offset(DECISIONS_KEPT - 1)
        .limit(1)
    )
    if oldest_kept is not None:
        s.execute(
            delete(_AutoscalerDecisionRow).where(
                _AutoscalerDecisionRow.deployment_id == deployment_id,
                _AutoscalerDecisionRow.id < oldest_kept,
            )
        )

"""What the reconciler must remember across restarts: every replica it manages on a node-agent
(with its stage in the release) and, per deployment, the revision that serves and its profile
(needed to roll back). SQLAlchemy tables beside the catalogue's, on the same engine; with a
`fence` (the leader lease, `store/lease.py`) every write runs it first in its transaction, so a
deposed leader's release progress is refused (NotLeaderError) and nothing of it is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Engine, LargeBinary, String, Text, delete, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.types import JSON

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.orchestrator.catalog.model import DeploymentProfile
from inferplane.orchestrator.fleet.model import MAX_NODE_ADDRESS, MAX_NODE_NAME
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.release.progress import Progress
from inferplane.orchestrator.store.lease import Fence
from inferplane.storage import UtcDateTime, migrate


class Stage(enum.Enum):
    """Where a managed replica is in its life, as the orchestrator drives it.

    STARTING: StartReplica sent; routable only after READY + warm-up (+ gate in a rollout).
    QUALIFYING: a release's candidate replica under its qualifying gates (release/gates.py):
    in the routing table, but its revision has no share of live traffic (only requests pinned
    to the revision reach it). SERVING: in the routing table. RETIRING: marked draining in the
    routing table; DrainReplica follows after the propagation delay. DRAINING: DrainReplica
    sent; StopReplica when nothing is in flight or the grace period is over; then the record
    is deleted.
    """

    STARTING = "starting"
    QUALIFYING = "qualifying"
    SERVING = "serving"
    RETIRING = "retiring"
    DRAINING = "draining"


@dataclasses.dataclass(frozen=True, slots=True)
class ManagedReplica:
    """One replica the orchestrator started (or adopted) on a node-agent.

    `replica_id` is the node-agent's id (`release.spec.agent_replica_id`); `slot` the desired
    replica (`{deployment}-{ordinal}`); `address` the node-agent's; `spec` the serialized
    `nodeagent.v1.ReplicaSpec` it was started with; times are timezone-aware UTC.
    """

    node: str
    replica_id: str
    deployment_id: str
    slot: str
    address: str
    revision: str
    stage: Stage
    stage_since: datetime
    spec: bytes = b""

    @property
    def key(self) -> tuple[str, str]:
        return (self.node, self.replica_id)

    def spec_proto(self) -> nodeagent_pb2.ReplicaSpec:
        return nodeagent_pb2.ReplicaSpec.FromString(self.spec)


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    """A deployment's release state: the revision serving (and its profile, for rollbacks), and
    the revision whose rollout failed (the reconciler holds at the serving one until the profile
    changes again), with the reason; `progress`: the release pipeline's state of the last
    candidate revision (release/progress.py; None: no pipeline ran)."""

    deployment_id: str
    serving_revision: str = ""
    serving_profile: DeploymentProfile | None = None
    failed_revision: str = ""
    failure: str = ""
    progress: Progress | None = None


class ReleaseStore(Protocol):
    """Persistence of managed replicas and releases (each call is one transaction)."""

    def create_schema(self) -> None: ...

    def load(self) -> tuple[list[ManagedReplica], list[Release]]: ...

    def put_replica(self, replica: ManagedReplica) -> None: ...

    def delete_replica(self, node: str, replica_id: str) -> None: ...

    def put_release(self, release: Release) -> None: ...

    def delete_release(self, deployment_id: str) -> None: ...


class MemoryReleaseStore:
    """`ReleaseStore` in a dict (tests; a restart is a new reconciler over the same object)."""

    def __init__(self) -> None:
        self.replicas: dict[tuple[str, str], ManagedReplica] = {}
        self.releases: dict[str, Release] = {}

    def create_schema(self) -> None:
        return None

    def load(self) -> tuple[list[ManagedReplica], list[Release]]:
        return list(self.replicas.values()), list(self.releases.values())

    def put_replica(self, replica: ManagedReplica) -> None:
        self.replicas[replica.key] = replica

    def delete_replica(self, node: str, replica_id: str) -> None:
        self.replicas.pop((node, replica_id), None)

    def put_release(self, release: Release) -> None:
        self.releases[release.deployment_id] = release

    def delete_release(self, deployment_id: str) -> None:
        self.releases.pop(deployment_id, None)


def profile_to_json(profile: DeploymentProfile | None) -> dict[str, Any] | None:
    if profile is None:
        return None
    data = dataclasses.asdict(profile)
    data["extra_engine_args"] = list(profile.extra_engine_args)
    return data


def profile_from_json(data: dict[str, Any] | None) -> DeploymentProfile | None:
    if not data:
        return None
    known = {f.name for f in dataclasses.fields(DeploymentProfile)}
    values = {k: v for k, v in data.items() if k in known}
    values["extra_engine_args"] = tuple(values.get("extra_engine_args", ()))
    return DeploymentProfile(**values)


class _Base(DeclarativeBase):
    pass


class _ReplicaRow(_Base):
    __tablename__ = "managed_replicas"

    node: Mapped[str] = mapped_column(String(MAX_NODE_NAME), primary_key=True)
    replica_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(String(128), index=True)
    slot: Mapped[str] = mapped_column(String(160))
    address: Mapped[str] = mapped_column(String(MAX_NODE_ADDRESS))
    revision: Mapped[str] = mapped_column(String(32))
    stage: Mapped[str] = mapped_column(String(16))
    stage_since: Mapped[datetime] = mapped_column(UtcDateTime())
    spec: Mapped[bytes] = mapped_column(LargeBinary)


class _ReleaseRow(_Base):
    __tablename__ = "releases"

    deployment_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    serving_revision: Mapped[str] = mapped_column(String(32))
    serving_profile: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    failed_revision: Mapped[str] = mapped_column(String(32))
    failure: Mapped[str] = mapped_column(Text)
    pipeline: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


#: The tables this store maps: a target of the orchestrator database's migrations.
METADATA = _Base.metadata


class SqlReleaseStore:
    """`ReleaseStore` on a SQLAlchemy engine (the catalogue's: `SqlStateStore.engine`). A NUL
    in `Release.failure` is stored as U+FFFD on every database. `fence`: run first in every
    write's transaction (None: writes are not fenced); a refused write raises NotLeaderError."""

    def __init__(self, engine: Engine, *, fence: Fence | None = None) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence

    def _write(self) -> contextlib.AbstractContextManager[Session]:
        return _fenced(self._sessions.begin(), self._fence)

    def create_schema(self) -> None:
        """Migrates the orchestrator database to the latest schema revision (`migrations/`);
        the state store on the same engine does it too: the second finds nothing to do."""
        migrate(self._engine, MIGRATIONS)

    def load(self) -> tuple[list[ManagedReplica], list[Release]]:
        with self._sessions() as s:
            replicas = [
                ManagedReplica(
                    node=r.node,
                    replica_id=r.replica_id,
                    deployment_id=r.deployment_id,
                    slot=r.slot,
                    address=r.address,
                    revision=r.revision,
                    stage=Stage(r.stage),
                    stage_since=r.stage_since,
                    spec=r.spec,
                )
                for r in s.scalars(select(_ReplicaRow))
            ]
            releases = [
                Release(
                    deployment_id=r.deployment_id,
                    serving_revision=r.serving_revision,
                    serving_profile=profile_from_json(r.serving_profile),
                    failed_revision=r.failed_revision,
                    failure=r.failure,
                    progress=Progress.from_json(r.pipeline),
                )
                for r in s.scalars(select(_ReleaseRow))
            ]
        return replicas, releases

    def put_replica(self, replica: ManagedReplica) -> None:
        with self._write() as s:
            s.merge(
                _ReplicaRow(
                    node=replica.node,
                    replica_id=replica.replica_id,
                    deployment_id=replica.deployment_id,
                    slot=replica.slot,
                    address=replica.address,
                    revision=replica.revision,
                    stage=replica.stage.value,
                    stage_since=replica.stage_since,
                    spec=replica.spec,
                )
            )

    def delete_replica(self, node: str, replica_id: str) -> None:
        with self._write() as s:
            s.execute(
                delete(_ReplicaRow).where(
                    _ReplicaRow.node == node, _ReplicaRow.replica_id == replica_id
                )
            )

    def put_release(self, release: Release) -> None:
        with self._write() as s:
            s.merge(
                _ReleaseRow(
                    deployment_id=release.deployment_id,
                    serving_revision=release.serving_revision,
                    serving_profile=profile_to_json(release.serving_profile),
                    failed_revision=release.failed_revision,
                    # A message from an engine or node-agent may hold NULs; PostgreSQL text
                    # cannot (the whole row would be refused).
                    failure=release.failure.replace("\x00", "\ufffd"),
                    pipeline=_pipeline_json(release.progress),
                )
            )

    def delete_release(self, deployment_id: str) -> None:
        with self._write() as s:
            s.execute(delete(_ReleaseRow).where(_ReleaseRow.deployment_id == deployment_id))


def _pipeline_json(progress: Progress | None) -> dict[str, Any] | None:
    if progress is None:
        return None
    data = progress.to_json()
    # Reasons and messages quote engines and node-agents: no NUL reaches PostgreSQL text.
    data["message"] = data["message"].replace("\x00", "\ufffd")
    for verdict in data["verdicts"]:
        verdict["reason"] = verdict.get("reason", "").replace("\x00", "\ufffd")
    return data


@contextlib.contextmanager
def _fenced(
    transaction: contextlib.AbstractContextManager[Session], fence: Fence | None
) -> Iterator[Session]:
    with transaction as s:
        if fence is not None:
            fence.fence(s)
        yield s

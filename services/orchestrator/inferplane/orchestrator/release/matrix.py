"""The compatibility matrix (issue 30): every release verdict per combination of engine and
engine version, weights digest, chat template digest and parsers (`ReplicaArtifacts`), and the
creates and updates that overrode a failed verdict (`force`).

Tables (migration 0007), on the catalogue's engine, written through the leader's `fence`:

- `compatibility_verdicts`: one row per recorded verdict (history kept, a few rows per
  release). A combination's verdict is its newest row (highest id): `lookup` and `list` read
  only those.
- `forced_changes`: one row per forced create or update (the audit trail).
- `compatibility_grandfathered`: the (deployment, revision) pairs that existed when migration
  0007 ran. When a ready replica of such a pair first reports artifacts for a combination that
  has no row, `grandfather` records it "unqualified" (the migration could not know digests).

Verdicts: "qualified" (every gate passed), "failed" (a gate failed or could not run) and
"unqualified" (grandfathered: it served before the matrix existed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from sqlalchemy import JSON, Engine, Integer, String, Text, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.store.lease import Fence
from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.pagination.page_tokens import decode_page_token, encode_page_token
from inferplane.runtime.time.clock import Clock, SystemClock
from inferplane.storage import UtcDateTime, migrate

QUALIFIED = "qualified"
FAILED = "failed"
UNQUALIFIED = "unqualified"
VERDICTS = (QUALIFIED, FAILED, UNQUALIFIED)

#: ListCompatibility / ListForcedChanges: rows per page when page_size is 0, and at most.
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
#: Longest value of each combination column (digests are "sha256:" + 64 hex characters).
MAX_ARTIFACT_FIELD = 256
#: Longest actor and forced-change reason kept.
MAX_ACTOR = 256
MAX_REASON = 2048

_COMBINATION = ("engine", "engine_version", "model_digest", "chat_template_digest", "parser")


def verdict_of(gates: Sequence[orchestrator_pb2.GateVerdict]) -> str:
    """A release's verdict from its gates': QUALIFIED when there are some and every one
    "passed", else FAILED (a gate that "error"ed counts as failed: the release stopped,
    orchestrator.proto `GateVerdict.result`)."""
    return QUALIFIED if gates and all(g.result == "passed" for g in gates) else FAILED


class _Base(DeclarativeBase):
    pass


class _VerdictRow(_Base):
    """One recorded verdict of a combination (migration 0007)."""

    __tablename__ = "compatibility_verdicts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    engine: Mapped[str] = mapped_column(String(MAX_ARTIFACT_FIELD))
    engine_version: Mapped[str] = mapped_column(String(MAX_ARTIFACT_FIELD), index=True)
    model_digest: Mapped[str] = mapped_column(String(MAX_ARTIFACT_FIELD), index=True)
    chat_template_digest: Mapped[str] = mapped_column(String(MAX_ARTIFACT_FIELD))
    parser: Mapped[str] = mapped_column(String(MAX_ARTIFACT_FIELD))
    verdict: Mapped[str] = mapped_column(String(16))
    # The serialised GateVerdict list (protobuf JSON mapping).
    gates: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    deployment: Mapped[str] = mapped_column(String(128), index=True)
    revision: Mapped[str] = mapped_column(String(32))
    update_time: Mapped[datetime] = mapped_column(UtcDateTime)


class _ForcedRow(_Base):
    """One create or update that overrode a failed verdict (migration 0007)."""

    __tablename__ = "forced_changes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(String(128), index=True)
    revision: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(MAX_ACTOR))
    reason: Mapped[str] = mapped_column(Text)
    overridden: Mapped[str] = mapped_column(Text)
    create_time: Mapped[datetime] = mapped_column(UtcDateTime)


class _GrandfatheredRow(_Base):
    """A (deployment, revision) that existed when migration 0007 ran."""

    __tablename__ = "compatibility_grandfathered"

    deployment_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    revision: Mapped[str] = mapped_column(String(32), primary_key=True)


#: The tables this module maps: a target of the orchestrator database's migrations.
METADATA = _Base.metadata


def _clean(text: str) -> str:
    """PostgreSQL text cannot hold NUL (the whole row would be refused)."""
    return text.replace("\x00", "\ufffd")


def _combination(artifacts: replica_pb2.ReplicaArtifacts) -> dict[str, str]:
    values = {name: getattr(artifacts, name) for name in _COMBINATION}
    for name, value in values.items():
        if len(value) > MAX_ARTIFACT_FIELD or "\x00" in value:
            raise ValueError(
                f"artifacts.{name} must be at most {MAX_ARTIFACT_FIELD} characters without NUL"
            )
    return values


def _entry(row: _VerdictRow) -> orchestrator_pb2.CompatibilityEntry:
    entry = orchestrator_pb2.CompatibilityEntry(
        artifacts=replica_pb2.ReplicaArtifacts(**{n: getattr(row, n) for n in _COMBINATION}),
        verdict=row.verdict,
        gates=[json_format.ParseDict(g, orchestrator_pb2.GateVerdict()) for g in row.gates],
        deployment=row.deployment,
        revision=row.revision,
    )
    entry.update_time.FromDatetime(row.update_time)
    return entry


def _forced(row: _ForcedRow) -> orchestrator_pb2.ForcedChange:
    change = orchestrator_pb2.ForcedChange(
        deployment=row.deployment,
        revision=row.revision,
        actor=row.actor,
        reason=row.reason,
        overridden=row.overridden,
    )
    change.create_time.FromDatetime(row.create_time)
    return change


def _page_size(page_size: int) -> int:
    return min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


class CompatibilityMatrix:
    """The matrix on a SQLAlchemy engine (the catalogue's: `SqlStateStore.engine`); with a
    `fence` (the leader lease) every write runs it first in its transaction, so a deposed
    leader writes nothing (NotLeaderError). All methods block (database I/O)."""

    def __init__(
        self, engine: Engine, *, fence: Fence | None = None, clock: Clock | None = None
    ) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence
        self._clock = clock or SystemClock()

    @classmethod
    def in_memory(cls, *, clock: Clock | None = None) -> CompatibilityMatrix:
        """A matrix in a private in-memory SQLite database (the orchestrator's memory mode and
        tests), migrated already."""
        engine = create_engine(
            "sqlite://", connect_args={"check_same_thread": False}, poolclass=StaticPool
        )
        matrix = cls(engine, clock=clock)
        matrix.create_schema()
        return matrix

    def create_schema(self) -> None:
        """Migrates the orchestrator database to the latest schema revision (`migrations/`);
        idempotent (the other stores on the same engine do it too)."""
        migrate(self._engine, MIGRATIONS)

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        with self._sessions.begin() as s:
            if self._fence is not None:
                self._fence.fence(s)
            yield s

    def record(self, entry: orchestrator_pb2.CompatibilityEntry) -> None:
        """Records `entry`'s verdict for its combination; it becomes the combination's verdict
        (the newest wins; older ones stay as history). `update_time` unset: now.

        Raises:
            ValueError: `verdict` is not one of VERDICTS, or an artifacts field is longer than
                MAX_ARTIFACT_FIELD or holds NUL.
            NotLeaderError: the fence refused the write.
        """
        if entry.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; got {entry.verdict!r}")
        combination = _combination(entry.artifacts)
        when = (
            entry.update_time.ToDatetime(tzinfo=UTC)
            if entry.HasField("update_time")
            else self._clock.now()
        )
        gates = [json_format.MessageToDict(g) for g in entry.gates]
        for gate in gates:
            if "reason" in gate:
                gate["reason"] = _clean(gate["reason"])
        with self._write() as s:
            s.add(
                _VerdictRow(
                    **combination,
                    verdict=entry.verdict,
                    gates=gates,
                    deployment=entry.deployment,
                    revision=entry.revision,
                    update_time=when,
                )
            )

    def lookup(
        self, artifacts: replica_pb2.ReplicaArtifacts
    ) -> orchestrator_pb2.CompatibilityEntry | None:
        """The combination's current verdict (its newest), or None when it has none.

        Raises:
            ValueError: an artifacts field longer than MAX_ARTIFACT_FIELD or with NUL.
        """
        combination = _combination(artifacts)
        query = select(_VerdictRow).order_by(_VerdictRow.id.desc()).limit(1)
        for name, value in combination.items():
            query = query.where(getattr(_VerdictRow, name) == value)
        with self._sessions() as s:
            row = s.scalar(query)
            return _entry(row) if row is not None else None

    def list(
        self,
        *,
        deployment: str = "",
        engine_version: str = "",
        model_digest: str = "",
        verdict: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[orchestrator_pb2.CompatibilityEntry], str]:
        """Each combination's current verdict, newest first, filtered (empty: any) and paged
        (`page_size` 0: DEFAULT_PAGE_SIZE; at most MAX_PAGE_SIZE). Returns the entries and the
        next page's token ("" on the last page). A deployment filter matches the deployment
        the current verdict was measured on.

        Raises:
            InvalidArgumentError: `verdict` not one of VERDICTS (param "verdict"), or a token
                not from this listing with these filters (param "page_token").
        """
        if verdict and verdict not in VERDICTS:
            raise InvalidArgumentError(
                f"verdict must be one of {', '.join(VERDICTS)}; got {verdict!r}", param="verdict"
            )
        filters = {
            "deployment": deployment,
            "engine_version": engine_version,
            "model_digest": model_digest,
            "verdict": verdict,
        }
        newest = select(func.max(_VerdictRow.id)).group_by(
            *(getattr(_VerdictRow, n) for n in _COMBINATION)
        )
        query = select(_VerdictRow).where(_VerdictRow.id.in_(newest))
        for name, value in filters.items():
            if value:
                query = query.where(getattr(_VerdictRow, name) == value)
        if page_token:
            try:
                before = int(decode_page_token(page_token, filters)["before"])
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgumentError("page_token is not valid", param="page_token") from exc
            query = query.where(_VerdictRow.id < before)
        size = _page_size(page_size)
        query = query.order_by(_VerdictRow.id.desc()).limit(size + 1)
        with self._sessions() as s:
            rows = list(s.scalars(query))
        token = (
            encode_page_token({"before": rows[size - 1].id}, filters) if len(rows) > size else ""
        )
        return [_entry(r) for r in rows[:size]], token

    def record_forced(
        self, *, deployment: str, revision: str, actor: str, reason: str, overridden: str
    ) -> orchestrator_pb2.ForcedChange:
        """Writes one forced change (now) and returns it. Text is kept at most MAX_ACTOR /
        MAX_REASON characters; NULs become U+FFFD.

        Raises:
            NotLeaderError: the fence refused the write.
        """
        row = _ForcedRow(
            deployment=deployment,
            revision=revision,
            actor=_clean(actor)[:MAX_ACTOR],
            reason=_clean(reason)[:MAX_REASON],
            overridden=_clean(overridden)[:MAX_REASON],
            create_time=self._clock.now(),
        )
        with self._write() as s:
            s.add(row)
            s.flush()
            return _forced(row)

    def list_forced(
        self, *, deployment: str = "", page_size: int = 0
    ) -> tuple[orchestrator_pb2.ForcedChange, ...]:
        """Forced changes, newest first (`deployment` "": all; `page_size` 0:
        DEFAULT_PAGE_SIZE, at most MAX_PAGE_SIZE)."""
        query = select(_ForcedRow).order_by(_ForcedRow.id.desc()).limit(_page_size(page_size))
        if deployment:
            query = query.where(_ForcedRow.deployment == deployment)
        with self._sessions() as s:
            return tuple(_forced(r) for r in s.scalars(query))

    def grandfathered(self) -> set[tuple[str, str]]:
        """The (deployment, revision) pairs that existed when migration 0007 ran."""
        with self._sessions() as s:
            return {(r.deployment_id, r.revision) for r in s.scalars(select(_GrandfatheredRow))}

    def grandfather(
        self, artifacts: replica_pb2.ReplicaArtifacts, deployment: str, revision: str
    ) -> bool:
        """Records `artifacts` "unqualified" (measured on `deployment`/`revision`) when the
        combination has no verdict yet and the pair is grandfathered (existed when migration
        0007 ran). Returns whether it recorded one.

        Raises:
            ValueError: an artifacts field longer than MAX_ARTIFACT_FIELD or with NUL.
            NotLeaderError: the fence refused the write.
        """
        if (deployment, revision) not in self.grandfathered() or self.lookup(artifacts):
            return False
        self.record(
            orchestrator_pb2.CompatibilityEntry(
                artifacts=artifacts, verdict=UNQUALIFIED, deployment=deployment, revision=revision
            )
        )
        return True

    def close(self) -> None:
        """Releases the engine's connections (only for a matrix that owns its engine)."""
        self._engine.dispose()

"""This region's stored copy of the other regions' keys (`peer_key_entries`, migration 0008):
one row per (peer region, secret hash), the `KeyEntry` as the peer's auth streamed it, so a
region keeps authenticating its peers' keys through a cut and across its own restarts
(`inferplane.auth.peers`, docs/regions.md)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime

from sqlalchemy import LargeBinary, String, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.auth.migrations import MIGRATIONS
from inferplane.storage import SqlDatabase, UtcDateTime


class _Base(DeclarativeBase):
    pass


class _PeerEntryRow(_Base):
    __tablename__ = "peer_key_entries"

    region: Mapped[str] = mapped_column(String(16), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32))
    # `inferplane.auth.v1.KeyEntry`, serialized.
    entry: Mapped[bytes] = mapped_column(LargeBinary)
    update_time: Mapped[datetime] = mapped_column(UtcDateTime)


#: The table this store maps (a target of the auth database's migrations).
METADATA = _Base.metadata
_ENTRIES = _PeerEntryRow.__table__
# Secret hashes per `DELETE ... IN (...)`, rows per multi-row upsert.
_IN_CHUNK = 500

# A peer region's entries: secret hash -> entry.
Entries = dict[str, kpb.KeyEntry]


class SqlPeerKeyStore:
    """The peer entries on SQLAlchemy (the auth database). Blocking: call it off the loop.

    Errors: every method raises `UnavailableError` when the database cannot be reached.
    """

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self._db = SqlDatabase(
            url, what="peer key table", reason="AUTH_STORE_UNAVAILABLE", echo=echo
        )
        self._postgres = self._db.engine.dialect.name == "postgresql"

    def create_schema(self) -> None:
        """Migrates the auth database to the latest schema revision (`migrations/`)."""
        self._db.migrate(MIGRATIONS)

    def load(self, regions: Collection[str]) -> dict[str, Entries]:
        """Every stored entry of `regions`: region -> (secret hash -> entry)."""
        found: dict[str, Entries] = {region: {} for region in regions}
        try:
            with self._db.engine.connect() as conn:
                rows = conn.execute(
                    select(_ENTRIES.c.region, _ENTRIES.c.entry).where(
                        _ENTRIES.c.region.in_(sorted(regions))
                    )
                )
                for region, raw in rows:
                    entry = kpb.KeyEntry.FromString(raw)
                    found[region][entry.secret_hash] = entry
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc
        return found

    def replace(self, region: str, entries: Iterable[kpb.KeyEntry], now: datetime) -> None:
        """Makes `entries` all that is stored of `region` (a snapshot), in one transaction."""
        entries = list(entries)
        keep = {e.secret_hash for e in entries}
        with self._db.transaction() as s:
            held = s.execute(
                select(_ENTRIES.c.secret_hash).where(_ENTRIES.c.region == region)
            ).scalars()
            self._write(s, region, entries, set(held) - keep, now)

    def apply(
        self,
        region: str,
        put: Iterable[kpb.KeyEntry],
        removed: Collection[str],
        now: datetime,
    ) -> None:
        """Adds or replaces `put` and drops `removed` secret hashes of `region` (a change),
        in one transaction."""
        with self._db.transaction() as s:
            self._write(s, region, list(put), set(removed), now)

    def _write(
        self,
        s: Session,
        region: str,
        put: list[kpb.KeyEntry],
        removed: Collection[str],
        now: datetime,
    ) -> None:
        """Deletes `removed` and upserts `put`: several auth instances of one region, each
        following the same peer, may write the same rows at once without a conflict."""
        gone = sorted(set(removed) - {e.secret_hash for e in put})
        for start in range(0, len(gone), _IN_CHUNK):
            s.execute(
                delete(_PeerEntryRow).where(
                    _PeerEntryRow.region == region,
                    _PeerEntryRow.secret_hash.in_(gone[start : start + _IN_CHUNK]),
                )
            )
        insert = postgresql.insert if self._postgres else sqlite.insert
        for start in range(0, len(put), _IN_CHUNK):
            rows = [_values(region, e, now) for e in put[start : start + _IN_CHUNK]]
            statement = insert(_PeerEntryRow).values(rows)
            s.execute(
                statement.on_conflict_do_update(
                    index_elements=["region", "secret_hash"],
                    set_={
                        "key_id": statement.excluded.key_id,
                        "entry": statement.excluded.entry,
                        "update_time": statement.excluded.update_time,
                    },
                )
            )

    def close(self) -> None:
        self._db.close()


def _values(region: str, entry: kpb.KeyEntry, now: datetime) -> dict[str, object]:
    return {
        "region": region,
        "secret_hash": entry.secret_hash,
        "key_id": entry.key_id,
        "entry": entry.SerializeToString(deterministic=True),
        "update_time": now,
    }

"""Stored responses of the OpenAI Responses API (`store`, `previous_response_id`), in the auth
database (SQLite or PostgreSQL): auth owns the platform's tenant-scoped database, and replicas
have none.

One row per response: its tenant, the Response object as it was returned, the turn's input
items (the stored conversation it continued included), the prompt's and the output's token ids
(so the next turn replays them token for token: `inferplane.replica.server.responses`), the
render fingerprint, and its creation and expiry times. Every read is scoped to a tenant: another
tenant's id reads exactly as an unknown one (NOT_FOUND), so ids leak nothing across tenants.
Expired rows read as absent at once and are deleted by `purge` (auth's background loop).

Token ids are stored as little-endian uint32 bytes (4 bytes a token: a 100k-token prompt is
400 KB), JSON as UTF-8 text.
"""

from __future__ import annotations

import array
import dataclasses
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import (
    Column,
    Engine,
    Index,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    delete,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError

from inferplane.auth.migrations import MIGRATIONS
from inferplane.storage import SqlDatabase, UtcDateTime

METADATA = MetaData()

DEFAULT_RETENTION = timedelta(days=30)
"""How long a stored response is kept (OpenAI's default for stored responses)."""

stored_responses = Table(
    "stored_responses",
    METADATA,
    Column("response_id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("model", String(256), nullable=False),
    Column("previous_response_id", String(64), nullable=False),
    Column("response_json", Text, nullable=False),
    Column("input_items_json", Text, nullable=False),
    Column("prompt_token_ids", LargeBinary, nullable=False),
    Column("output_token_ids", LargeBinary, nullable=False),
    Column("render_key", String(128), nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("expires_at", UtcDateTime, nullable=False),
    Index("ix_stored_responses_expires_at", "expires_at"),
)


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response. JSON fields are text; token ids lists of ints; times aware."""

    response_id: str
    tenant: str
    model: str
    previous_response_id: str
    response_json: str
    input_items_json: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    render_key: str
    created_at: datetime
    expires_at: datetime


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids → little-endian uint32 bytes."""
    packed = array.array("I", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    """`pack_ids`' bytes → token ids."""
    packed = array.array("I")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


class SqlResponseStore:
    """Stored responses on SQLAlchemy (the auth database). Blocking: call it off the event loop.

    Errors: every method raises `UnavailableError` (reason AUTH_STORE_UNAVAILABLE) when the
    database cannot be reached.
    """

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self._db = SqlDatabase(
            url, what="response store", reason="AUTH_STORE_UNAVAILABLE", echo=echo
        )

    @property
    def engine(self) -> Engine:
        return self._db.engine

    def create_schema(self) -> None:
        """Migrates the auth database to the latest schema revision (`migrations/`)."""
        self._db.migrate(MIGRATIONS)

    def save(self, row: StoredResponse) -> None:
        """Stores `row`; saving the same response id again keeps the first (a retried save)."""
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        values = dataclasses.asdict(row)
        values["prompt_token_ids"] = pack_ids(row.prompt_token_ids)
        values["output_token_ids"] = pack_ids(row.output_token_ids)
        statement = (
            insert(stored_responses)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["response_id"])
        )
        try:
            with self.engine.begin() as conn:
                conn.execute(statement)
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc

    def get(self, tenant: str, response_id: str, now: datetime) -> StoredResponse | None:
        """The response `response_id` of `tenant`, unless unknown, another tenant's, or
        expired at `now`."""
        table = stored_responses
        query = select(table).where(
            and_(
                table.c.response_id == response_id,
                table.c.tenant == tenant,
                table.c.expires_at > now,
            )
        )
        try:
            with self.engine.connect() as conn:
                found = conn.execute(query).mappings().first()
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc
        if found is None:
            return None
        values = dict(found)
        values["prompt_token_ids"] = unpack_ids(values["prompt_token_ids"])
        values["output_token_ids"] = unpack_ids(values["output_token_ids"])
        return StoredResponse(**values)

    def delete(self, tenant: str, response_id: str) -> bool:
        """Deletes `tenant`'s response `response_id`; False when there was none."""
        table = stored_responses
        statement = delete(table).where(
            and_(table.c.response_id == response_id, table.c.tenant == tenant)
        )
        try:
            with self.engine.begin() as conn:
                return bool(conn.execute(statement).rowcount)
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc

    def purge(self, now: datetime) -> int:
        """Deletes every response expired at `now`; returns how many."""
        statement = delete(stored_responses).where(stored_responses.c.expires_at <= now)
        try:
            with self.engine.begin() as conn:
                return int(conn.execute(statement).rowcount or 0)
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc

    def close(self) -> None:
        self._db.close()

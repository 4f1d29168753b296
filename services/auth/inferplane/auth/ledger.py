"""The usage ledger: one durable row per finished request, and per-key monthly token totals.

Routers report every request of an API key when it ends (`UsageService.ReportUsage`, at least
once: a batch whose call failed is sent again). `SqlUsageLedger.record` writes a batch in ONE
transaction, each row inserted only if its `request_id` is not there yet
(`INSERT ... ON CONFLICT (request_id) DO NOTHING`, on SQLite and PostgreSQL), and adds the new
rows' tokens to their key's month in the same transaction. So a batch is either all written or
not at all (an auth process killed mid-batch leaves nothing half-written; the router re-sends
it), and a re-sent batch, to this instance or another one on the same database, writes nothing
twice. It returns the request ids written now and the tokens that added, so the caller accounts
rate-limit tokens only for those.

One copy may replace a row: a row the router wrote as *provisional* (it concluded the request
as cancelled without hearing how it ended, `RequestUsage.provisional`) is replaced by the first
non-provisional report of the same request id (the replica's report, arriving late), in the
same transaction as the months' totals: the old row's tokens leave its month, the new row's
join theirs. `UPDATE ... WHERE provisional` makes the replacement happen once however many
auth instances receive a copy.

GPU-seconds come from the replica (`inferplane.wire.ResponseSummary.gpu_seconds`): while `n`
requests are in flight on a replica holding `g` GPUs (fractional for a shared GPU), each is
charged `g / n` GPU-seconds per second, so the charges of all requests on a replica add up to
`g` × the time it was busy.

Monthly budgets (`Limits.monthly_token_budget`) count prompt + completion tokens of the
calendar month (UTC) of each request's end time, from `usage_monthly`: one indexed read per
Check of a key that has a budget. Like the per-minute token limit, the budget is enforced on
the NEXT request (usage is known when a request ends).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    case,
    func,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from inferplane.auth.migrations import MIGRATIONS
from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.pagination.page_tokens import decode_page_token, encode_page_token
from inferplane.storage import SqlDatabase, UtcDateTime

METADATA = MetaData()

# The counters' integers are BIGINT, except on SQLite where INTEGER is already 64-bit (and
# autogenerate would otherwise see a difference).
_COUNT = BigInteger().with_variant(Integer(), "sqlite")

usage_ledger = Table(
    "usage_ledger",
    METADATA,
    Column("request_id", String(128), primary_key=True),
    Column("key_id", String(32), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("model", String(256), nullable=False),
    Column("deployment", String(256), nullable=False),
    Column("replica", String(256), nullable=False),
    Column("status", String(16), nullable=False),
    Column("prompt_tokens", _COUNT, nullable=False),
    Column("cached_tokens", _COUNT, nullable=False),
    Column("completion_tokens", _COUNT, nullable=False),
    Column("reasoning_tokens", _COUNT, nullable=False),
    Column("ttft_seconds", Float, nullable=False),
    Column("duration_seconds", Float, nullable=False),
    Column("gpu_seconds", Float, nullable=False),
    Column("start_time", UtcDateTime, nullable=True),
    Column("end_time", UtcDateTime, nullable=False),
    # The public API (`inferplane.wire.apis`); "" for rows from before migration 0003.
    Column("api", String(32), nullable=False),
    # The LoRA adapter that served it (catalogue name; issue 29); "" for the base model and
    # for rows from before migration 0005.
    Column("adapter", String(128), nullable=False),
    # The profile revision of the replica that served it (issue 30: usage per revision during
    # a canary); "" when none did, the sender is older, or for rows from before migration 0006.
    Column("revision", String(128), nullable=False),
    # Written by a router that had not heard how the request ended (`RequestUsage.provisional`):
    # the first non-provisional report of the request id replaces the row (migration 0007).
    Column("provisional", Boolean, nullable=False),
    Index("ix_usage_ledger_end_time", "end_time", "request_id"),
    Index("ix_usage_ledger_key_id_end_time", "key_id", "end_time"),
    Index("ix_usage_ledger_tenant_end_time", "tenant", "end_time"),
)

usage_monthly = Table(
    "usage_monthly",
    METADATA,
    Column("key_id", String(32), primary_key=True),
    # "YYYY-MM" of the requests' end times, UTC.
    Column("month", String(7), primary_key=True),
    Column("tokens", _COUNT, nullable=False),
)

STATUSES = ("completed", "failed", "cancelled")
GROUPINGS = ("", "hour", "day", "model", "key", "tenant", "api", "adapter", "revision")
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


def month_of(when: datetime) -> str:
    """The ledger's month key of `when` ("2026-11"), in UTC."""
    return when.astimezone(UTC).strftime("%Y-%m")


def _add(months: dict[tuple[str, str], int], key_id: str, when: datetime, tokens: int) -> None:
    """Adds `tokens` (may be negative) to `key_id`'s month of `when` in `months`."""
    ident = (key_id, month_of(when))
    months[ident] = months.get(ident, 0) + tokens


def month_end(when: datetime) -> datetime:
    """The first instant of the month after `when`'s (UTC): when a monthly budget resets."""
    start = when.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (start + timedelta(days=32)).replace(day=1)


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerRow:
    """One finished request. Tokens are counts; times in seconds; `end_time` timezone-aware."""

    request_id: str
    key_id: str
    tenant: str
    model: str
    end_time: datetime
    deployment: str = ""
    replica: str = ""
    status: str = "completed"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    ttft_seconds: float = 0.0
    duration_seconds: float = 0.0
    gpu_seconds: float = 0.0
    start_time: datetime | None = None
    api: str = ""
    adapter: str = ""
    revision: str = ""
    provisional: bool = False

    @property
    def tokens(self) -> int:
        """Prompt + completion tokens: what limits and budgets count."""
        return self.prompt_tokens + self.completion_tokens


class Written(NamedTuple):
    """What `SqlUsageLedger.record` wrote for one request id: the tokens that added to its
    key (negative when a replacement counts fewer than the provisional row did) and whether
    it replaced a provisional row."""

    tokens: int
    replaced: bool


@dataclasses.dataclass(frozen=True, slots=True)
class UsageQuery:
    """`QueryUsage`'s filters: end times in [start, end) (None: unbounded), exact matches on
    the non-empty strings, `group_by` one of `GROUPINGS`, `page_size` 1..1000."""

    start: datetime | None = None
    end: datetime | None = None
    key_id: str = ""
    tenant: str = ""
    model: str = ""
    group_by: str = ""
    page_size: int = DEFAULT_PAGE_SIZE
    api: str = ""
    page_token: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class UsageGroup:
    """Totals of one group (`group`: RFC 3339 bucket start for hour/day, else the value)."""

    group: str
    requests: int
    failed_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    gpu_seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class UsagePage:
    """One page: `rows` (no grouping) or `groups`, and the token of the next page ("")."""

    rows: Sequence[LedgerRow] = ()
    groups: Sequence[UsageGroup] = ()
    next_page_token: str = ""


def _filters(query: UsageQuery) -> dict[str, str]:
    """What a page token must have been issued for: every filter and the grouping."""
    return {
        "start": query.start.isoformat() if query.start else "",
        "end": query.end.isoformat() if query.end else "",
        "key_id": query.key_id,
        "tenant": query.tenant,
        "model": query.model,
        "group_by": query.group_by,
        "api": query.api,
    }


class SqlUsageLedger:
    """The ledger on SQLAlchemy (the auth database: SQLite or PostgreSQL). Blocking: call it
    off the event loop.

    Errors: every method raises `UnavailableError` when the database cannot be reached.
    """

    blocking = True

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self._db = SqlDatabase(url, what="usage ledger", reason="AUTH_STORE_UNAVAILABLE", echo=echo)

    @property
    def engine(self) -> Engine:
        return self._db.engine

    def create_schema(self) -> None:
        """Migrates the auth database to the latest schema revision (`migrations/`)."""
        self._db.migrate(MIGRATIONS)

    def _insert(self) -> Any:
        return postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert

    def record(self, rows: Sequence[LedgerRow]) -> dict[str, Written]:
        """Writes `rows` in one transaction: a request id not in the ledger yet is inserted, a
        provisional row is replaced by a non-provisional `row` (module docstring), any other
        copy is skipped. Returns the request ids written now, in order, with the tokens that
        added (a replacement adds its tokens minus the provisional row's). Adds those tokens
        to their keys' months in the same transaction."""
        if not rows:
            return {}
        insert = self._insert()
        written: dict[str, Written] = {}
        months: dict[tuple[str, str], int] = {}
        try:
            with self.engine.begin() as conn:
                for row in rows:
                    replaced = None
                    if self._insert_row(conn, insert, row):
                        added = row.tokens
                    elif (replaced := self._replace_provisional(conn, row)) is not None:
                        added = row.tokens - replaced.tokens
                        _add(months, replaced.key_id, replaced.end_time, -replaced.tokens)
                    else:
                        continue
                    # A batch may hold a provisional row and its replacement: their sum.
                    tokens, replaced_before = written.get(row.request_id, (0, False))
                    written[row.request_id] = Written(
                        tokens + added, replaced_before or replaced is not None
                    )
                    _add(months, row.key_id, row.end_time, row.tokens)
                self._add_monthly(conn, months, insert)
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc
        return written

    @staticmethod
    def _insert_row(conn: Connection, insert: Any, row: LedgerRow) -> bool:
        statement = (
            insert(usage_ledger)
            .values(**dataclasses.asdict(row))
            .on_conflict_do_nothing(index_elements=["request_id"])
            .returning(usage_ledger.c.request_id)
        )
        return conn.execute(statement).first() is not None

    @staticmethod
    def _replace_provisional(conn: Connection, row: LedgerRow) -> LedgerRow | None:
        """Replaces the provisional row of `row.request_id` by `row` (not provisional itself);
        the row replaced, or None (no provisional row: a plain copy)."""
        if row.provisional:
            return None
        c = usage_ledger.c
        found = conn.execute(
            select(usage_ledger).where(c.request_id == row.request_id, c.provisional.is_(True))
        ).first()
        if found is None:
            return None
        values = dataclasses.asdict(row)
        del values["request_id"]
        updated = conn.execute(
            usage_ledger.update()
            .where(c.request_id == row.request_id, c.provisional.is_(True))
            .values(**values)
        )
        # Another instance replaced it in between (READ COMMITTED re-checks the WHERE).
        return LedgerRow(**dict(found._mapping)) if updated.rowcount == 1 else None

    @staticmethod
    def _add_monthly(conn: Connection, totals: dict[tuple[str, str], int], insert: Any) -> None:
        for (key_id, month), tokens in sorted(totals.items()):
            if not tokens:
                continue
            statement = insert(usage_monthly).values(key_id=key_id, month=month, tokens=tokens)
            statement = statement.on_conflict_do_update(
                index_elements=["key_id", "month"],
                set_={"tokens": usage_monthly.c.tokens + statement.excluded.tokens},
            )
            conn.execute(statement)

    def month_tokens(self, key_id: str, when: datetime) -> int:
        """Prompt + completion tokens `key_id` used in `when`'s calendar month (UTC)."""
        try:
            with self.engine.connect() as conn:
                value = conn.execute(
                    select(usage_monthly.c.tokens).where(
                        usage_monthly.c.key_id == key_id,
                        usage_monthly.c.month == month_of(when),
                    )
                ).scalar()
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc
        return int(value or 0)

    def month_tokens_of(self, key_ids: Collection[str], when: datetime) -> dict[str, int]:
        """`month_tokens` of several keys in one read per 500 keys (keys without usage this
        month are absent): the key table's budget state (`inferplane.auth.key_table`)."""
        ids = sorted(set(key_ids))
        month = month_of(when)
        found: dict[str, int] = {}
        try:
            with self.engine.connect() as conn:
                for start in range(0, len(ids), 500):
                    rows = conn.execute(
                        select(usage_monthly.c.key_id, usage_monthly.c.tokens).where(
                            usage_monthly.c.month == month,
                            usage_monthly.c.key_id.in_(ids[start : start + 500]),
                        )
                    )
                    found.update((str(k), int(t or 0)) for k, t in rows)
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc
        return found

    def recent_demand(self, since: datetime) -> dict[str, tuple[int, int]]:
        """Key id -> (requests, prompt + completion tokens) of the rows that ended at or after
        `since` (keys without one are absent): one range read of the end-time index. A
        region's recent demand of each key (`inferplane.auth.shares`)."""
        tokens = func.sum(usage_ledger.c.prompt_tokens + usage_ledger.c.completion_tokens)
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    select(usage_ledger.c.key_id, func.count(), tokens)
                    .where(usage_ledger.c.end_time >= since)
                    .group_by(usage_ledger.c.key_id)
                )
                return {str(k): (int(n), int(t or 0)) for k, n, t in rows}
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc

    def query(self, query: UsageQuery) -> UsagePage:
        """Rows (ordered by end time, then request id) or groups (ordered by group), one page.

        Raises:
            InvalidArgumentError: a bad `group_by`, `page_size` or `page_token`.
        """
        if query.group_by not in GROUPINGS:
            raise InvalidArgumentError(
                f"group_by must be one of {', '.join(g for g in GROUPINGS if g)} (or empty)",
                param="group_by",
            )
        if not 1 <= query.page_size <= MAX_PAGE_SIZE:
            raise InvalidArgumentError(
                f"page_size must be between 1 and {MAX_PAGE_SIZE}", param="page_size"
            )
        cursor = decode_page_token(query.page_token, _filters(query)) if query.page_token else {}
        c = usage_ledger.c
        where = []
        if query.start is not None:
            where.append(c.end_time >= query.start)
        if query.end is not None:
            where.append(c.end_time < query.end)
        for column, value in ((c.key_id, query.key_id), (c.tenant, query.tenant)):
            if value:
                where.append(column == value)
        if query.model:
            where.append(c.model == query.model)
        if query.api:
            where.append(c.api == query.api)
        try:
            with self.engine.connect() as conn:
                if query.group_by:
                    return self._groups(conn, query, where, cursor)
                return self._rows(conn, query, where, cursor)
        except OperationalError as exc:
            raise self._db.unavailable(exc) from exc

    def _rows(
        self, conn: Connection, query: UsageQuery, where: list[Any], cursor: dict[str, Any]
    ) -> UsagePage:
        c = usage_ledger.c
        if cursor:
            try:
                after, last_id = datetime.fromisoformat(cursor["t"]), str(cursor["r"])
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgumentError("page_token is not valid", param="page_token") from exc
            where = [
                *where,
                (c.end_time > after) | and_(c.end_time == after, c.request_id > last_id),
            ]
        statement = (
            select(usage_ledger)
            .where(*where)
            .order_by(c.end_time, c.request_id)
            .limit(query.page_size + 1)
        )
        found = [LedgerRow(**dict(r._mapping)) for r in conn.execute(statement)]
        rows, more = found[: query.page_size], len(found) > query.page_size
        token = ""
        if more:
            last = rows[-1]
            resume = {"t": last.end_time.isoformat(), "r": last.request_id}
            token = encode_page_token(resume, _filters(query))
        return UsagePage(rows=rows, next_page_token=token)

    def _groups(
        self, conn: Connection, query: UsageQuery, where: list[Any], cursor: dict[str, Any]
    ) -> UsagePage:
        c = usage_ledger.c
        key = self._group_key(query.group_by)
        statement = (
            select(
                key.label("group"),
                func.count().label("requests"),
                func.sum(case((c.status == "completed", 0), else_=1)).label("failed_requests"),
                func.sum(c.prompt_tokens).label("prompt_tokens"),
                func.sum(c.cached_tokens).label("cached_tokens"),
                func.sum(c.completion_tokens).label("completion_tokens"),
                func.sum(c.reasoning_tokens).label("reasoning_tokens"),
                func.sum(c.gpu_seconds).label("gpu_seconds"),
            )
            .where(*where)
            .group_by(key)
            .order_by(key)
            .limit(query.page_size + 1)
        )
        if cursor:
            if not isinstance(cursor.get("g"), str):
                raise InvalidArgumentError("page_token is not valid", param="page_token")
            statement = statement.having(key > cursor["g"])
        raw = list(conn.execute(statement))
        found = [
            UsageGroup(
                group=self._group_label(query.group_by, r.group),
                requests=int(r.requests),
                failed_requests=int(r.failed_requests or 0),
                prompt_tokens=int(r.prompt_tokens or 0),
                cached_tokens=int(r.cached_tokens or 0),
                completion_tokens=int(r.completion_tokens or 0),
                reasoning_tokens=int(r.reasoning_tokens or 0),
                gpu_seconds=float(r.gpu_seconds or 0.0),
            )
            for r in raw
        ]
        groups, more = found[: query.page_size], len(found) > query.page_size
        token = ""
        if more:
            token = encode_page_token({"g": raw[query.page_size - 1].group}, _filters(query))
        return UsagePage(groups=groups, next_page_token=token)

    def _group_key(self, group_by: str) -> Any:
        c = usage_ledger.c
        if group_by in ("model", "tenant", "api", "adapter", "revision"):
            return c[group_by]
        if group_by == "key":
            return c.key_id
        # Time buckets as text "YYYY-MM-DDTHH" / "YYYY-MM-DD" (UTC), portable and ordered.
        if self.engine.dialect.name == "postgresql":
            pattern = 'YYYY-MM-DD"T"HH24' if group_by == "hour" else "YYYY-MM-DD"
            return func.to_char(func.timezone("UTC", c.end_time), pattern)
        return func.strftime("%Y-%m-%dT%H" if group_by == "hour" else "%Y-%m-%d", c.end_time)

    @staticmethod
    def _group_label(group_by: str, value: Any) -> str:
        text = str(value or "")
        if group_by == "hour":
            return f"{text}:00:00Z"
        if group_by == "day":
            return f"{text}T00:00:00Z"
        return text

    def close(self) -> None:
        self._db.close()

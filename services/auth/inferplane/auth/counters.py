"""Where per-key rate counters live: in memory (one instance) or in SQL (several instances).

Fixed windows of `window_seconds` aligned on the epoch (every instance computes the same
window from its wall clock). Per key and window: a request counter and a token counter; per
key: concurrency leases (one row per request in flight, released by the usage report at the
end of the request or expired after `lease_seconds` if that report never comes).

`try_admit` is ONE atomic step per Check: every counter it touches changes only when the
request is admitted, so several auth instances sharing one database never admit more than the
limit (SQL: a single transaction whose first statement takes the write lock, conditional
upserts `... ON CONFLICT DO UPDATE ... WHERE count < limit RETURNING count`, a lease insert
guarded by a count of live leases). A Check with limits costs one commit and one to three
prepared statements: ~0.1 ms on SQLite, ~0.4 ms on PostgreSQL on this machine
(`bench/auth_check.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    create_engine,
    delete,
    event,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import ConnectionPoolEntry

from inferplane.auth.domain import Limits
from inferplane.auth.migrations import MIGRATIONS
from inferplane.runtime import UnavailableError
from inferplane.storage import migrate

KIND_REQUESTS = "requests"
KIND_TOKENS = "tokens"


@dataclasses.dataclass(frozen=True, slots=True)
class AdmitOutcome:
    """What `try_admit` decided and the counts after it (for the x-ratelimit headers).

    `refused` is None when admitted, else the limit that refused: "requests", "tokens" or
    "concurrency". `requests` counts this request when admitted; `tokens` is the window's
    accounted tokens; `concurrent` the key's live leases (this one included when admitted).
    """

    refused: str | None
    requests: int
    tokens: int
    concurrent: int


class CounterStore(Protocol):
    """Atomic per-key counters. `blocking` says whether calls do I/O (run them off the loop).

    Errors: `UnavailableError` when the backing store cannot be reached.
    """

    blocking: bool

    def create_schema(self) -> None: ...

    def try_admit(
        self,
        key_id: str,
        request_id: str,
        limits: Limits,
        window: int,
        now: float,
        lease_expire: float,
    ) -> AdmitOutcome:
        """Counts the request against `limits` in `window` if every limit allows it.

        Only limits above 0 are checked and counted. Admitted: the request counter is
        incremented and a lease `request_id` (expiring at `lease_expire`, epoch seconds)
        taken when `max_concurrent_requests` is set (a request id that already holds one
        keeps it: a repeated Check of one request takes one slot). Refused: nothing changes.
        """
        ...

    def add_tokens(self, key_id: str, window: int, tokens: int) -> None:
        """Accounts `tokens` (prompt + completion) to the key's `window`."""
        ...

    def release(self, key_id: str, request_id: str) -> None:
        """Drops the lease of a finished request (no-op when unknown or expired)."""
        ...

    def purge(self, before_window: int, now: float) -> None:
        """Deletes counters of windows before `before_window` and leases expired at `now`."""
        ...

    def close(self) -> None: ...


class MemoryCounterStore:
    """`CounterStore` in this process only (a single auth instance, tests)."""

    blocking = False

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], int] = {}
        self._leases: dict[str, dict[str, float]] = {}

    def create_schema(self) -> None:
        pass

    def try_admit(
        self,
        key_id: str,
        request_id: str,
        limits: Limits,
        window: int,
        now: float,
        lease_expire: float,
    ) -> AdmitOutcome:
        requests = self._counts.get((key_id, KIND_REQUESTS, window), 0)
        tokens = self._counts.get((key_id, KIND_TOKENS, window), 0)
        leases = self._leases.setdefault(key_id, {})
        for rid in [r for r, exp in leases.items() if exp <= now]:
            del leases[rid]
        refused = None
        if limits.requests_per_minute and requests >= limits.requests_per_minute:
            refused = KIND_REQUESTS
        elif limits.tokens_per_minute and tokens >= limits.tokens_per_minute:
            refused = KIND_TOKENS
        elif (
            limits.max_concurrent_requests
            and request_id not in leases
            and len(leases) >= limits.max_concurrent_requests
        ):
            refused = "concurrency"
        if refused is None:
            if limits.requests_per_minute:
                requests += 1
                self._counts[(key_id, KIND_REQUESTS, window)] = requests
            if limits.max_concurrent_requests:
                leases[request_id] = lease_expire
        return AdmitOutcome(refused, requests, tokens, len(leases))

    def add_tokens(self, key_id: str, window: int, tokens: int) -> None:
        k = (key_id, KIND_TOKENS, window)
        self._counts[k] = self._counts.get(k, 0) + tokens

    def release(self, key_id: str, request_id: str) -> None:
        self._leases.get(key_id, {}).pop(request_id, None)

    def purge(self, before_window: int, now: float) -> None:
        self._counts = {k: v for k, v in self._counts.items() if k[2] >= before_window}
        for leases in self._leases.values():
            for rid in [r for r, exp in leases.items() if exp <= now]:
                del leases[rid]
        self._leases = {k: v for k, v in self._leases.items() if v}

    def close(self) -> None:
        pass


_metadata = MetaData()
_counters = Table(
    "rate_counters",
    _metadata,
    Column("key_id", String(32), primary_key=True),
    Column("window", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("requests", BigInteger().with_variant(Integer, "sqlite"), nullable=False),
    Column("tokens", BigInteger().with_variant(Integer, "sqlite"), nullable=False),
)
_LOCK_WINDOW = -1  # a per-key row whose upsert serialises lease takers on PostgreSQL
_leases = Table(
    "concurrency_leases",
    _metadata,
    Column("key_id", String(32), primary_key=True),
    Column("request_id", String(128), primary_key=True),
    Column("expire_at", Float, nullable=False, index=True),
)
#: The tables of the SQL counters: a target of the auth database's migrations (`migrations/`).
METADATA = _metadata


# The hot path runs these as plain SQL strings on a DBAPI connection held by each worker
# thread: the driver prepares each once and caches it (sqlite3's statement cache, psycopg's
# prepared statements), so a Check costs no SQL-expression building, compilation, cache-key
# computation or pool checkout (SQLAlchemy Core spent ~4/5 of try_admit's time on those).
# "window" is quoted: a keyword in both dialects. `?` becomes `%s` for format-style drivers.
_COUNT_REQUEST = (
    'INSERT INTO rate_counters (key_id, "window", requests, tokens) VALUES (?, ?, ?, 0) '
    'ON CONFLICT (key_id, "window") DO UPDATE '
    "SET requests = rate_counters.requests + excluded.requests "
    "WHERE ? = 0 OR rate_counters.requests < ? "
    "RETURNING requests, tokens"
)
_ADD_TOKENS = (
    'INSERT INTO rate_counters (key_id, "window", requests, tokens) VALUES (?, ?, 0, ?) '
    'ON CONFLICT (key_id, "window") DO UPDATE '
    "SET tokens = rate_counters.tokens + excluded.tokens"
)
_READ_TOKENS = 'SELECT tokens FROM rate_counters WHERE key_id = ? AND "window" = ?'
_LOCK_KEY = (
    'INSERT INTO rate_counters (key_id, "window", requests, tokens) VALUES (?, ?, 0, 0) '
    'ON CONFLICT (key_id, "window") DO UPDATE SET requests = rate_counters.requests'
)
# Inserts the lease only while fewer than the limit are live; a request id that holds one
# already conflicts (one request, one slot) and is found by _HELD.
_TAKE_LEASE = (
    "INSERT INTO concurrency_leases (key_id, request_id, expire_at) "
    "SELECT ?, ?, ? WHERE (SELECT count(*) FROM concurrency_leases "
    "WHERE key_id = ? AND expire_at > ?) < ? "
    "ON CONFLICT (key_id, request_id) DO NOTHING"
)
_HELD = "SELECT 1 FROM concurrency_leases WHERE key_id = ? AND request_id = ?"
_RELEASE = "DELETE FROM concurrency_leases WHERE key_id = ? AND request_id = ?"


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    # Counters are short-lived: losing the last commits on power loss is acceptable, an
    # fsync per Check is not (WAL + NORMAL stays consistent).
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _postgres_session(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    # As for SQLite above: a crash may lose the last fraction of a second of counts, but a
    # Check no longer waits for a WAL flush (the commit's fsync was most of its time).
    cursor = dbapi_connection.cursor()
    cursor.execute("SET synchronous_commit TO off")
    cursor.close()
    dbapi_connection.commit()


class SqlCounterStore:
    """`CounterStore` on SQLite or PostgreSQL (SQLAlchemy engine), shared by every auth
    instance. Each calling thread keeps one connection of the engine's pool for the hot path
    (`try_admit`, `add_tokens`, `release`); a connection that failed is discarded."""

    blocking = True

    def __init__(self, url: str) -> None:
        self._engine: Engine = create_engine(url, pool_pre_ping=False)
        self._dialect = self._engine.dialect.name
        if self._dialect == "sqlite":
            event.listen(self._engine, "connect", _sqlite_pragmas)
        elif self._dialect == "postgresql":
            event.listen(self._engine, "connect", _postgres_session)
        self._errors: tuple[type[Exception], ...] = (
            OperationalError,
            self._engine.dialect.loaded_dbapi.OperationalError,
            self._engine.dialect.loaded_dbapi.InterfaceError,
        )
        qmark = self._engine.dialect.paramstyle == "qmark"
        self._sql = {
            name: sql if qmark else sql.replace("?", "%s")
            for name, sql in (
                ("count_request", _COUNT_REQUEST),
                ("add_tokens", _ADD_TOKENS),
                ("read_tokens", _READ_TOKENS),
                ("lock_key", _LOCK_KEY),
                ("take_lease", _TAKE_LEASE),
                ("held", _HELD),
                ("release", _RELEASE),
            )
        }
        self._local = threading.local()
        self._held: list[Any] = []
        self._held_lock = threading.Lock()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[tuple[Any, Any]]:
        """(connection, cursor) of this thread in one transaction: committed on exit unless
        the body rolled it back; rolled back on an error. The first statement of every
        transaction here writes, so SQLite takes its write lock up front (no deadlock
        upgrading a read lock; `busy_timeout` waits for another writer)."""
        conn = getattr(self._local, "conn", None)
        try:
            if conn is None:
                conn = self._engine.raw_connection()
                self._local.conn = conn
                with self._held_lock:
                    self._held.append(conn)
            cursor = conn.cursor()
            try:
                yield conn, cursor
                conn.commit()
            except BaseException:
                with contextlib.suppress(*self._errors):
                    conn.rollback()
                raise
            finally:
                cursor.close()
        except self._errors as exc:
            self._discard(conn)
            raise UnavailableError(
                "the rate-limit store is unavailable", reason="AUTH_STORE_UNAVAILABLE"
            ) from exc

    def _discard(self, conn: Any) -> None:
        self._local.conn = None
        if conn is None:
            return
        with self._held_lock:
            if conn in self._held:
                self._held.remove(conn)
        with contextlib.suppress(Exception):
            conn.invalidate()

    def create_schema(self) -> None:
        """Migrates the auth database to the latest schema revision (`migrations/`)."""
        try:
            migrate(self._engine, MIGRATIONS)
        except OperationalError as exc:
            raise UnavailableError(
                "the rate-limit store is unavailable", reason="AUTH_STORE_UNAVAILABLE"
            ) from exc

    def try_admit(
        self,
        key_id: str,
        request_id: str,
        limits: Limits,
        window: int,
        now: float,
        lease_expire: float,
    ) -> AdmitOutcome:
        rpm, tpm, conc = (
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrent_requests,
        )
        sql = self._sql
        with self._tx() as (conn, cur):
            # On PostgreSQL a per-key row lock serialises lease takers so that two instances
            # cannot both see the same free slot (SQLite's write lock already does).
            if conc and self._dialect == "postgresql":
                cur.execute(sql["lock_key"], (key_id, _LOCK_WINDOW))
            requests, tokens = 0, 0
            if rpm or tpm:
                # One statement counts the request (while under rpm) and reads the tokens.
                cur.execute(sql["count_request"], (key_id, window, 1 if rpm else 0, rpm, rpm))
                row = cur.fetchone()
                if row is None:
                    cur.execute(sql["read_tokens"], (key_id, window))
                    found = cur.fetchone()
                    conn.rollback()
                    return AdmitOutcome(KIND_REQUESTS, rpm, int(found[0]) if found else 0, 0)
                requests, tokens = int(row[0]), int(row[1])
            if tpm and tokens >= tpm:
                conn.rollback()
                return AdmitOutcome(KIND_TOKENS, max(0, requests - 1), tokens, 0)
            if conc:
                cur.execute(
                    sql["take_lease"], (key_id, request_id, lease_expire, key_id, now, conc)
                )
                if cur.rowcount != 1:
                    # Refused, or this request id holds a lease already (one request, one slot).
                    cur.execute(sql["held"], (key_id, request_id))
                    if cur.fetchone() is None:
                        conn.rollback()
                        return AdmitOutcome("concurrency", max(0, requests - 1), tokens, conc)
            return AdmitOutcome(None, requests if rpm else 0, tokens, 0)

    def add_tokens(self, key_id: str, window: int, tokens: int) -> None:
        with self._tx() as (_conn, cur):
            cur.execute(self._sql["add_tokens"], (key_id, window, tokens))

    def release(self, key_id: str, request_id: str) -> None:
        with self._tx() as (_conn, cur):
            cur.execute(self._sql["release"], (key_id, request_id))

    def purge(self, before_window: int, now: float) -> None:
        try:
            with self._engine.begin() as conn:
                conn.execute(
                    delete(_counters).where(
                        and_(_counters.c.window < before_window, _counters.c.window != _LOCK_WINDOW)
                    )
                )
                conn.execute(delete(_leases).where(_leases.c.expire_at <= now))
        except OperationalError as exc:
            raise UnavailableError(
                "the rate-limit store is unavailable", reason="AUTH_STORE_UNAVAILABLE"
            ) from exc

    def close(self) -> None:
        with self._held_lock:
            held, self._held = self._held, []
        for conn in held:
            with contextlib.suppress(Exception):
                conn.close()
        self._engine.dispose()

"""`Spool`: a local SQLite file of items waiting to be sent, oldest first: the storage of an
`Outbox` (`inferplane.runtime.delivery.outbox`), which writes every item here before anyone
acknowledges it and removes it only once its receiver acknowledged its batch. Delivery is
at-least-once (the receivers drop copies by id, e.g. the usage ledger by request id).

One file per process (`path`); SQLite in WAL mode with `synchronous=FULL`, so an appended
batch survives a crash of the process or of the machine once `append` returned (one fsync
per `append`: callers batch). `path=None` keeps the items in memory (SQLite's `:memory:`):
the same order and bookkeeping, no durability.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


class Spool(Generic[T]):
    """Items on disk in arrival order. Blocking I/O: call it off the event loop.

    Args:
        path: the SQLite file (created with its directory, mode 0600: items may hold key ids);
            None: in memory only.
        encode / decode: an item to bytes and back (e.g. a proto's `SerializeToString` and
            `FromString`).

    Errors: `sqlite3.Error` when the file cannot be written or read (a full disk).
    """

    def __init__(
        self, path: Path | None, encode: Callable[[T], bytes], decode: Callable[[bytes], T]
    ) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.touch(mode=0o600, exist_ok=True)
        self.path = path
        self._encode = encode
        self._decode = decode
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            path if path is not None else ":memory:", check_same_thread=False, isolation_level=None
        )
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS spool (seq INTEGER PRIMARY KEY AUTOINCREMENT, item BLOB)"
        )
        self._count = int(self._db.execute("SELECT count(*) FROM spool").fetchone()[0])

    def __len__(self) -> int:
        """Items on disk (kept in memory: no I/O)."""
        return self._count

    def append(self, items: Sequence[T]) -> None:
        """Adds `items` after the ones already there, in one transaction."""
        if not items:
            return
        rows = [(self._encode(item),) for item in items]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT INTO spool (item) VALUES (?)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._count += len(rows)

    def peek(self, limit: int) -> tuple[int, list[T]]:
        """The oldest `limit` items and the sequence number of the last one (for `drop`)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, item FROM spool ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
        if not rows:
            return 0, []
        return int(rows[-1][0]), [self._decode(bytes(item)) for _, item in rows]

    def drop(self, through: int) -> None:
        """Removes every item up to sequence number `through` (a delivered `peek`)."""
        with self._lock:
            removed = self._db.execute("DELETE FROM spool WHERE seq <= ?", (through,)).rowcount
            self._count = max(0, self._count - removed)

    def close(self) -> None:
        with self._lock:
            self._db.close()

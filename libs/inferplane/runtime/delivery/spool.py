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

    def append(self, items: Sequence[T], drop_through: int = 0) -> int:
        """Adds `items` after the ones already there and removes every item up to sequence
        number `drop_through` (0: none), in one transaction (one fsync). Returns the sequence
        number of the last item added (they are numbered one by one: the first is that minus
        `len(items)` plus 1), or of the last item ever added when `items` is empty."""
        rows = [(self._encode(item),) for item in items]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                removed = 0
                if drop_through:
                    removed = self._db.execute(
                        "DELETE FROM spool WHERE seq <= ?", (drop_through,)
                    ).rowcount
                if rows:
                    self._db.executemany("INSERT INTO spool (item) VALUES (?)", rows)
                last = self._last_seq()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._count += len(rows) - removed
        return last

    def bounds(self) -> tuple[int, int]:
        """(sequence number of the oldest item on disk, of the last item ever added); the
        first is 0 when the spool is empty."""
        with self._lock:
            first = self._db.execute("SELECT min(seq) FROM spool").fetchone()[0]
            return int(first or 0), self._last_seq()

    def _last_seq(self) -> int:
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'spool'").fetchone()
        return int(row[0]) if row else 0

    def peek(self, limit: int, after: int = 0) -> tuple[int, list[T]]:
        """The oldest `limit` items numbered above `after`, and the sequence number of the last
        one (for `drop`); (0, []) when there is none."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, item FROM spool WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)
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

"""The storage port of the auth service: what the domain needs from a database.

Adapters: `inferplane.auth.sql_store.SqlApiKeyStore` (SQLAlchemy; SQLite or PostgreSQL).
Every method is synchronous and blocking; async callers run them in a worker thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import Protocol

from inferplane.auth.domain import ApiKey, AuditEvent


@dataclasses.dataclass(frozen=True, slots=True)
class ListQuery:
    """One page of keys, newest first (create_time, then key_id, both descending).

    `after` is the (create_time, key_id) of the last key of the previous page; `limit` is the
    number of rows to return at most.
    """

    limit: int
    now: datetime
    tenant: str | None = None
    include_inactive: bool = False
    after: tuple[datetime, str] | None = None


class ApiKeyStore(Protocol):
    """Keys and their audit log. Each write and its audit event commit in one transaction.

    Errors: `inferplane.runtime.NotFoundError` for a missing key, `UnavailableError` when the
    database cannot be reached; exceptions raised by a `change` callback abort the transaction.
    """

    def create_schema(self) -> None:
        """Creates the tables and indexes when missing (idempotent)."""
        ...

    def insert(self, key: ApiKey, event: AuditEvent) -> None:
        """Stores a new key and its audit event.

        Raises:
            AlreadyExistsError: the key id or secret hash is taken.
        """
        ...

    def get(self, key_id: str) -> ApiKey | None:
        """The key with this id, or None."""
        ...

    def find_by_secret_hash(self, secret_hash: str) -> ApiKey | None:
        """The key whose current or previous (rotated) secret hashes to `secret_hash`."""
        ...

    def list_keys(self, query: ListQuery) -> Sequence[ApiKey]:
        """Up to `query.limit` keys matching the query, newest first."""
        ...

    def update(
        self, key_id: str, change: Callable[[ApiKey], tuple[ApiKey, AuditEvent | None]]
    ) -> ApiKey:
        """Read-modify-write under a row lock: `change(current)` gives the new key and its event.

        A None event means "nothing changed": nothing is written.
        """
        ...

    def delete(self, key_id: str, event: Callable[[ApiKey], AuditEvent]) -> ApiKey:
        """Deletes the key (the audit log keeps the event); returns what was deleted."""
        ...

    def record_last_used(self, times: Mapping[str, datetime]) -> None:
        """Sets last_used_time for each key id (missing keys are ignored; never moves back)."""
        ...

    def audit_events(self, key_id: str | None = None, limit: int = 100) -> Sequence[AuditEvent]:
        """Audit events, oldest first, optionally for one key."""
        ...

    def all_keys(self) -> Sequence[ApiKey]:
        """Every stored key, revoked and expired ones included (the key table's full load)."""
        ...

    def get_many(self, key_ids: Collection[str]) -> Sequence[ApiKey]:
        """The keys among `key_ids` that exist, in any order."""
        ...

    def last_audit_id(self) -> int:
        """The newest audit event's id (0 when none)."""
        ...

    def audit_after(self, after_id: int, limit: int) -> Sequence[tuple[int, str]]:
        """(id, key id) of up to `limit` audit events after `after_id`, oldest first.

        Ids grow with every event; on PostgreSQL a transaction that took an id may commit
        after one that took a later id (the key table waits for such holes:
        `inferplane.auth.key_table`)."""
        ...

    def has_active_admin(self, now: datetime) -> bool:
        """Whether some key with the admin scope is neither revoked nor expired."""
        ...

    def close(self) -> None:
        """Releases connections."""
        ...

"""The key table's entries and per-router state (`inferplane.auth.key_table`): the `KeyEntry`
messages of one stored key (`key_entries`), a router's pending change (`Change`: latest entry
per secret hash, removed hashes), its stream's state (`Watcher`), the feed's settings
(`KeyTableSettings`) and metrics (`KeyTableMetrics`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import datetime
from typing import Any

from google.protobuf import timestamp_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.auth.domain import ApiKey
from inferplane.auth.ledger import month_end

# One secret hash's entry: its serialized form (compared to find what changed) and the message.
Built = dict[str, tuple[bytes, kpb.KeyEntry]]


def timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def key_entries(
    key: ApiKey, month_tokens: int, now: datetime, share: auth_pb2.Limits | None = None
) -> list[kpb.KeyEntry]:
    """The entries of one key at `now`: its current secret, and its previous one while the
    rotation's grace period runs. `month_tokens`: this month's tokens (keys with a budget).
    `share`: this region's share of the key's rate limits (`inferplane.auth.shares`), carried
    in `limits` with the key's own in `key_limits`; None: `limits` are the key's own."""
    limits = key.limits
    budget = limits.monthly_token_budget
    own = auth_pb2.Limits(
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
        max_concurrent_requests=limits.max_concurrent_requests,
        monthly_token_budget=budget,
    )
    common: dict[str, Any] = {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "scopes": list(key.scopes),
        "allowed_models": list(key.allowed_models),
        "tier": key.tier,
        "limits": own if share is None else share,
        "revoked": key.revoke_time is not None,
        "home_region": key.home_region,
        "region_pinned": key.region_pinned,
    }
    if share is not None:
        common["key_limits"] = own
    if budget:
        common["month_tokens"] = max(0, month_tokens)
        common["budget_exhausted"] = month_tokens >= budget
        common["budget_resets"] = timestamp(month_end(now))
    current = kpb.KeyEntry(secret_hash=key.secret_hash, **common)
    if key.expire_time is not None:
        current.valid_until.CopyFrom(timestamp(key.expire_time))
    entries = [current]
    grace_end = key.previous_secret_expire_time
    if key.previous_secret_hash and grace_end is not None and now < grace_end:
        ends = grace_end if key.expire_time is None else min(grace_end, key.expire_time)
        entries.append(
            kpb.KeyEntry(
                secret_hash=key.previous_secret_hash,
                previous_secret=True,
                valid_until=timestamp(ends),
                **common,
            )
        )
    return entries


def build_entries(
    key: ApiKey, month_tokens: int, now: datetime, share: auth_pb2.Limits | None = None
) -> Built:
    return {
        e.secret_hash: (e.SerializeToString(deterministic=True), e)
        for e in key_entries(key, month_tokens, now, share)
    }


def grace_end(key: ApiKey, now: datetime) -> datetime | None:
    end = key.previous_secret_expire_time
    return end if key.previous_secret_hash and end is not None and now < end else None


@dataclasses.dataclass(slots=True)
class Change:
    """Entries added or changed and hashes removed (merged in order: the latest wins)."""

    entries: dict[str, kpb.KeyEntry] = dataclasses.field(default_factory=dict)
    removed: set[str] = dataclasses.field(default_factory=set)

    def put(self, secret_hash: str, entry: kpb.KeyEntry) -> None:
        self.entries[secret_hash] = entry
        self.removed.discard(secret_hash)

    def drop(self, secret_hash: str) -> None:
        self.entries.pop(secret_hash, None)
        self.removed.add(secret_hash)

    def merge(self, other: Change) -> None:
        for secret_hash in other.removed:
            self.drop(secret_hash)
        for secret_hash, entry in other.entries.items():
            self.put(secret_hash, entry)

    def __bool__(self) -> bool:
        return bool(self.entries or self.removed)


class Watcher:
    """One router's stream: what it has not been sent yet (a snapshot, or merged changes)."""

    def __init__(self, router_id: str, peer: str) -> None:
        self.router_id = router_id
        self.peer = peer
        self.snapshot = True
        self.pending = Change()
        self.closed = False
        # `KeyTableFeed.settled`, in the feed's sequence of writes through this instance:
        # what `pending` covers, what the message taken last covers, what was handed to
        # gRPC, and the last read pass that had nothing for this router.
        self.pending_seq = 0
        self.taken_seq = 0
        self.sent_seq = 0
        self.quiet_seq = 0
        self._event = asyncio.Event()

    def push(self, change: Change, seq: int) -> None:
        """Adds a read pass's change (covering the writes up to `seq`)."""
        if not self.snapshot:
            self.pending.merge(change)
            self.pending_seq = max(self.pending_seq, seq)
        self._event.set()

    def settled(self, seq: int) -> bool:
        """Whether this router was handed every write up to `seq`: sent, or nothing pending
        nor in flight since a read pass at or after it found nothing for it."""
        if self.closed or self.sent_seq >= seq:
            return True
        idle = not self.snapshot and not self.pending and self.taken_seq <= self.sent_seq
        return idle and self.quiet_seq >= seq

    def close(self) -> None:
        self.closed = True
        self._event.set()

    async def wait(self, timeout: float) -> None:
        """Returns when something is to be sent or `timeout` passed."""
        if self.snapshot or self.pending or self.closed:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), max(0.0, timeout))
        self._event.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class KeyTableSettings:
    """How the feed follows the database (seconds).

    Attributes:
        poll_seconds: how often the audit log is read for other instances' writes (and due
            budget refreshes, ended grace periods).
        resync_seconds: how often the whole table is read again.
        budget_seconds: how often every key with a monthly budget has its month re-read.
        heartbeat_seconds: the heartbeat interval of a router that asks for none.
        fresh_seconds: heartbeats stop once reads have failed for this long.
        stall_seconds: ... or when no read succeeded for this long (a database that hangs;
            longer than the slowest resync).
        gap_seconds: how long a hole in the audit log's ids is waited for.
        audit_batch: audit events read per poll at most (more: a full resync).
    """

    poll_seconds: float = 0.25
    resync_seconds: float = 30.0
    budget_seconds: float = 1.0
    heartbeat_seconds: float = 1.0
    fresh_seconds: float = 2.0
    stall_seconds: float = 10.0
    gap_seconds: float = 10.0
    audit_batch: int = 1000


class KeyTableMetrics:
    """`inferplane_auth_key_table_watchers`, `_entries` (read at scrape),
    `_updates_total{kind=snapshot|change|heartbeat}` and `_poll_errors_total`."""

    KINDS = ("snapshot", "change", "heartbeat")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.watchers = Gauge(
            "inferplane_auth_key_table_watchers",
            "Routers watching this instance's key table (WatchKeyTable streams open).",
            registry=registry,
        )
        self.entries = Gauge(
            "inferplane_auth_key_table_entries",
            "Secret hashes in this instance's key table (current and in-grace previous).",
            registry=registry,
        )
        self.updates = Counter(
            "inferplane_auth_key_table_updates",
            "WatchKeyTable messages sent to routers, by kind.",
            ["kind"],
            registry=registry,
        )
        for kind in self.KINDS:
            self.updates.labels(kind)
        self.poll_errors = Counter(
            "inferplane_auth_key_table_poll_errors",
            "Reads of the database by the key table that failed (it retries every poll).",
            registry=registry,
        )

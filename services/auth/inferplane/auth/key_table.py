"""The key table every router authenticates against (`KeyTableFeed`, served by
`key_table_service.KeyTableService`).

Each router holds a `WatchKeyTable` stream to one auth instance (internal callers only: the
same `InternalCallerGuard` as UsageService, the `router` identity under mutual TLS). It gets:

1. a snapshot: one `KeyEntry` per secret hash auth would accept or refuse by name — every
   stored key's current secret (`valid_until` = its expire time; revoked keys too, marked
   `revoked`, so the router's refusal says "revoked"), and, while a rotation's grace period
   runs, the secret it replaced (`previous_secret`, `valid_until` = the grace end, or the
   key's expiry when that comes first). Deleted keys are absent. A key with a monthly token
   budget carries this month's tokens from the usage ledger, `budget_exhausted` and
   `budget_resets`.
2. changes, only the entries that changed and the hashes that went (`removed`):
   - writes through this instance (`ApiKeyManager.on_change`: create, update, revoke, delete,
     rotate, bootstrap) wake the feed at once: pushed within milliseconds;
   - writes by another auth instance on the same database are found by polling the audit
     log every `poll_seconds` (0.25 s): one indexed range read of the events after the last
     one seen (every key write adds one in its own transaction), then only the keys those
     name are read. So a revocation anywhere reaches every router within poll_seconds plus
     the stream's latency (under a second). On PostgreSQL an event id taken by a transaction
     that commits later than a newer one leaves a hole, which the poll keeps reading across
     for `gap_seconds` before it gives up on it (a rolled-back write burns an id for good);
   - budgets: after `UsageService.ReportUsage` wrote usage on this instance, the keys it
     names that have a budget are re-read at the next poll; every `budget_seconds` (1 s)
     all keys with a budget are (usage reported to other instances): cost bounded by the
     keys that have a budget;
   - a previous secret whose grace period ended is removed at the next poll;
   - every `resync_seconds` (30 s) the whole table is read again and what differs is sent
     (anything the polls missed; and at once when more changes arrived than one poll reads).
3. a heartbeat (no entries, a fresh `as_of`) whenever nothing else was sent for the
   router's `heartbeat_seconds` (1 s by default) — but only while this instance follows its
   database: not once its reads have failed for `fresh_seconds` (2 s), nor when none
   succeeded for `stall_seconds` (10 s: a database that hangs). An auth that cannot read its
   database goes quiet, so its routers see their table age and treat unknown keys as "auth
   unavailable" (503) rather than "unknown" (401); they reconnect (possibly to another
   instance), and a new watch is refused (UNAVAILABLE) until a read succeeds again.

Changes a router has not read yet are merged per router (latest entry per hash), so a slow
router costs memory bounded by the table, never a queue. One feed per process serves every
watch; it starts with the first watch. Secrets never leave auth: entries carry their
HMAC-SHA256 under the pepper auth and routers share.

With regions (`peers`, `inferplane.auth.peers.PeerKeyTable`), the table also holds the other
regions' own keys (under `peers.peer_key` ids; this region's own secret hash wins a clash),
pushed as soon as a peer's change is stored, and every budget is decided over every region's
month totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.auth.domain import ApiKey
from inferplane.auth.key_entries import (
    Built,
    Change,
    Watcher,
    grace_end,
    timestamp,
)
from inferplane.auth.key_entries import KeyTableMetrics as KeyTableMetrics
from inferplane.auth.key_entries import KeyTableSettings as KeyTableSettings
from inferplane.auth.key_table_regions import RegionalEntries
from inferplane.auth.ledger import SqlUsageLedger, month_end
from inferplane.auth.peers import PEER_KEY_PREFIX, PeerKeyTable
from inferplane.auth.store import ApiKeyStore
from inferplane.runtime import UnavailableError
from inferplane.runtime.time.clock import Clock

if TYPE_CHECKING:
    import grpc

    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any

log = structlog.get_logger("inferplane.auth.key_table")

#: Bounds on the heartbeat interval a router may ask for (seconds).
MIN_HEARTBEAT_SECONDS = 0.05
MAX_HEARTBEAT_SECONDS = 60.0


@dataclasses.dataclass(slots=True)
class _Read:
    """What one poll read (in a worker thread)."""

    events: list[tuple[int, str]]
    keys: dict[str, ApiKey | None]  # re-read keys: None = deleted
    months: dict[str, int]  # month tokens of the keys with a budget that were re-read
    built: dict[str, Built]  # key id → its entries now (every key in `keys` or `months`)


class KeyTableFeed(RegionalEntries):
    """The table of this auth instance and the routers watching it (module docstring).

    Every method runs on the event loop; database reads go to a worker thread, one at a time.

    Args:
        store, ledger: the auth database (keys and audit log; monthly usage).
        peers: the other regions' keys and month totals (None: no regions).
        clock: wall time of `as_of`, grace ends and the budget month.
        timer: monotonic seconds of the poll cadence and freshness (real time, also in
            tests that fake `clock`).
    """

    def __init__(
        self,
        store: ApiKeyStore,
        ledger: SqlUsageLedger,
        clock: Clock,
        metrics: KeyTableMetrics,
        settings: KeyTableSettings | None = None,
        *,
        peers: PeerKeyTable | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._peers = peers
        self._peer_version = -1
        # `RegionShares.version` the own keys' entries were last all built under.
        self._shares_version = self._shares_now()
        self._clock = clock
        self.metrics = metrics
        self.settings = settings or KeyTableSettings()
        self._timer = timer
        # The table: key id → its entries (by secret hash), the keys as read, month tokens of
        # the keys with a budget, grace ends of the previous secrets in the table.
        self._by_key: dict[str, Built] = {}
        self._keys: dict[str, ApiKey] = {}
        self._months: dict[str, int] = {}
        self._graces: dict[str, datetime] = {}
        self._size = 0
        # Following the audit log: every id <= _low seen (or given up on); ids above seen;
        # holes below the newest seen id → when first noticed (timer).
        self._low = 0
        self._seen: set[int] = set()
        self._holes: dict[int, float] = {}
        self._dirty_keys: set[str] = set()
        self._dirty_usage: set[str] = set()
        self._loaded = False
        self._read_at: float | None = None  # timer, last successful read
        self._failing_since: float | None = None  # timer, first failed read since then
        self._as_of: datetime | None = None  # clock, at that read
        self._watchers: set[Watcher] = set()
        self._io = asyncio.Lock()
        self._wake = asyncio.Event()
        if peers is not None:
            # A peer's change wakes the feed.
            peers.on_change = self._wake.set
            peers.local_budgeted = lambda: list(self._months)
        # Writes through this instance (`key_changed`) and how many of them the feed has read
        # and pushed to its watchers (`settled`).
        self._change_seq = 0
        self._pass_seq = 0  # `_change_seq` when the running read pass started
        self._read_seq = 0  # the newest pass's that reached `_done`
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        metrics.watchers.set_function(lambda: len(self._watchers))
        metrics.entries.set_function(lambda: self._size)

    # -- hooks ---------------------------------------------------------------------------------

    def key_changed(self, key_id: str) -> None:
        """A key was written through this instance: read and pushed now (`ApiKeyManager`)."""
        if self._loaded:
            self._change_seq += 1
            self._dirty_keys.add(key_id)
            self._wake.set()

    async def settled(self, timeout: float = 1.0) -> bool:
        """Waits until every write through this instance so far is read and handed to every
        watching router's stream (at most `timeout` seconds; False when it ran out, e.g. a
        router that stopped reading). `ApiKeyManager` awaits it before a write returns, so a
        key created or revoked here is in force on the routers watching this instance when
        the admin call answers; routers watching another instance follow within its poll."""
        target = self._change_seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if not self.unsent(target):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.005)

    def unsent(self, seq: int | None = None) -> int:
        """How many watching routers have not yet been sent every write through this
        instance up to `seq` (default: all so far); all of them while the feed has not read
        those writes."""
        target = self._change_seq if seq is None else seq
        watchers = [w for w in self._watchers if not w.closed]
        if self._read_seq < target:
            return len(watchers)
        return sum(1 for w in watchers if not w.settled(target))

    def usage_written(self, key_ids: Collection[str]) -> None:
        """Usage of these keys was written here (`UsageService`): their budget state is
        re-read at the next poll (only keys with a budget)."""
        if self._loaded:
            self._dirty_usage.update(k for k in key_ids if k in self._months)

    # -- watchers ------------------------------------------------------------------------------

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def __len__(self) -> int:
        """Secret hashes in the table."""
        return self._size

    def fresh(self) -> bool:
        """Whether the table follows the database: a read succeeded within `stall_seconds`
        and reads have not been failing for `fresh_seconds`."""
        if self._read_at is None:
            return False
        now = self._timer()
        if now - self._read_at > self.settings.stall_seconds:
            return False
        failing = self._failing_since
        return failing is None or now - failing < self.settings.fresh_seconds

    async def attach(self, router_id: str, peer: str) -> Watcher:
        """A new watch: reads the table first when it is not fresh, then follows it.

        Raises:
            UnavailableError: auth is stopping, or the database cannot be read.
        """
        if self._closing:
            raise UnavailableError("auth is shutting down; watch another instance")
        if not self.fresh():
            async with self._io:
                if not self.fresh():
                    await self._resync()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="key-table-feed")
        watcher = Watcher(router_id, peer)
        self._watchers.add(watcher)
        log.info("key_table_watch_started", router_id=router_id, peer=peer, keys=self._size)
        return watcher

    def detach(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.discard(watcher)
            log.info("key_table_watch_ended", router_id=watcher.router_id, peer=watcher.peer)

    def take(self, watcher: Watcher) -> kpb.WatchKeyTableResponse | None:
        """The next message for `watcher`: its snapshot, its merged changes, or None."""
        if watcher.snapshot:
            watcher.taken_seq = self._read_seq
            watcher.snapshot = False
            watcher.pending = Change()
            return self.snapshot()
        if watcher.pending:
            watcher.taken_seq = watcher.pending_seq
            change, watcher.pending = watcher.pending, Change()
            message = kpb.WatchKeyTableResponse(
                entries=list(change.entries.values()), removed=sorted(change.removed)
            )
        else:
            return None
        if self._as_of is not None:
            message.as_of.CopyFrom(timestamp(self._as_of))
        return message

    def snapshot(self) -> kpb.WatchKeyTableResponse:
        """The whole table as a snapshot message (a watch's first)."""
        entries = [e for built in self._by_key.values() for _, e in built.values()]
        message = kpb.WatchKeyTableResponse(snapshot=True, entries=entries)
        if self._as_of is not None:
            message.as_of.CopyFrom(timestamp(self._as_of))
        return message

    def heartbeat(self) -> kpb.WatchKeyTableResponse | None:
        """A heartbeat with the time of the last read, or None while reads fail."""
        if not self.fresh() or self._as_of is None:
            return None
        return kpb.WatchKeyTableResponse(as_of=timestamp(self._as_of))

    def close_watchers(self) -> None:
        """Ends every watch (auth drains: routers reconnect to another instance) and refuses
        new ones."""
        self._closing = True
        for watcher in list(self._watchers):
            watcher.close()

    async def stop(self) -> None:
        self.close_watchers()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- following the database ----------------------------------------------------------------

    async def refresh(self, *, full: bool = False, budgets: bool = False) -> None:
        """One poll now (tests and benchmarks; the feed's loop polls on its own).

        Raises:
            UnavailableError: the database cannot be read.
        """
        async with self._io:
            if full or not self._loaded:
                await self._resync()
            else:
                await self._poll(all_budgets=budgets)

    async def _run(self) -> None:
        settings = self.settings
        next_resync = self._timer() + settings.resync_seconds
        next_budgets = self._timer() + settings.budget_seconds
        failing = False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), settings.poll_seconds)
            self._wake.clear()
            now = self._timer()
            # The writes this pass reads (later ones mark their keys again).
            self._pass_seq = self._change_seq
            try:
                async with self._io:
                    if now >= next_resync:
                        await self._resync()
                        next_resync = now + settings.resync_seconds
                        next_budgets = now + settings.budget_seconds
                    else:
                        all_budgets = now >= next_budgets
                        if all_budgets:
                            next_budgets = now + settings.budget_seconds
                        await self._poll(all_budgets=all_budgets)
            except Exception as exc:  # the database is away: retry at the next poll
                self.metrics.poll_errors.inc()
                if self._failing_since is None:
                    self._failing_since = self._timer()
                if not failing:
                    log.warning("key_table_read_failed", error=str(exc))
                failing = True
            else:
                if failing:
                    log.info("key_table_read_recovered")
                failing = False

    async def _resync(self) -> None:
        """Reads the whole table and publishes what differs (the first load included)."""
        as_of = self._clock.now()
        # What is written from here on is marked again and read by the next poll.
        dirty, self._dirty_keys = self._dirty_keys, set()
        usage, self._dirty_usage = self._dirty_usage, set()
        try:
            last, keys, months, built = await asyncio.to_thread(self._read_all, as_of)
        except BaseException:
            self._dirty_keys |= dirty
            self._dirty_usage |= usage
            raise
        change = Change()
        for key_id in set(self._by_key) - set(built):
            if not key_id.startswith(PEER_KEY_PREFIX):
                self._set(key_id, None, {}, change, as_of)
        for key in keys:
            self._months.pop(key.key_id, None)
            if key.limits.monthly_token_budget:
                self._months[key.key_id] = months.get(key.key_id, 0)
            self._set(key.key_id, key, built[key.key_id], change, as_of)
        if not self._loaded:
            # Events up to `last` are in what was just read; a few ids below it may belong to
            # transactions still committing (PostgreSQL): re-read those, holes included.
            self._low = max(0, last - 256)
            self._seen.clear()
            self._holes.clear()
            self._loaded = True
        await self._reshare(change, as_of)
        self._merge_peers(change, as_of, force=True)
        self._done(as_of, change)

    def _read_all(
        self, now: datetime
    ) -> tuple[int, list[ApiKey], dict[str, int], dict[str, Built]]:
        last = self._store.last_audit_id()  # first: a write after it is followed by the poll
        keys = list(self._store.all_keys())
        budgeted = [k.key_id for k in keys if k.limits.monthly_token_budget]
        months = self._months_of(budgeted, now) if budgeted else {}
        # Entries are built again only for keys that differ from what the table holds (the
        # table is only changed under the lock this read runs under).
        before = self._as_of
        same_month = before is not None and month_end(now) == month_end(before)
        same_shares = self._shares_version == self._shares_now()
        built = {}
        for key in keys:
            month = months.get(key.key_id, 0)
            held = self._by_key.get(key.key_id)
            if (
                held is not None
                and before is not None
                and same_month
                and same_shares
                and self._keys.get(key.key_id) == key
                and self._months.get(key.key_id, 0) == month
                and grace_end(key, now) == grace_end(key, before)
            ):
                built[key.key_id] = held
            else:
                built[key.key_id] = self._build(key, month, now)
        return last, keys, months, built

    async def _poll(self, *, all_budgets: bool) -> None:
        as_of = self._clock.now()
        dirty, self._dirty_keys = self._dirty_keys, set()
        usage, self._dirty_usage = self._dirty_usage, set()
        budget_ids = set(self._months) if all_budgets else usage & set(self._months)
        # A new month: every budget starts again (entries change even where tokens do not).
        rolled = self._as_of is not None and month_end(as_of) != month_end(self._as_of)
        if rolled:
            budget_ids = set(self._months)
        try:
            read = await asyncio.to_thread(
                self._read_changes,
                self._low,
                frozenset(self._seen),
                dirty,
                {k: (self._keys[k], -1 if rolled else self._months[k]) for k in budget_ids},
                as_of,
            )
        except BaseException:
            self._dirty_keys |= dirty
            self._dirty_usage |= usage
            raise
        if len(read.events) >= self.settings.audit_batch:
            # More writes than one poll reads: read everything, then follow from there.
            await self._resync()
            self._low = max(i for i, _ in read.events)
            self._seen.clear()
            self._holes.clear()
            return
        self._follow(read.events)
        change = Change()
        for key_id, built in read.built.items():
            key = read.keys.get(key_id, self._keys.get(key_id))
            if key_id in read.keys and key is None:
                self._set(key_id, None, {}, change, as_of)
                continue
            assert key is not None
            self._months.pop(key_id, None)
            if key.limits.monthly_token_budget:
                self._months[key_id] = read.months.get(key_id, 0)
            self._set(key_id, key, built, change, as_of)
        for key_id, end in list(self._graces.items()):
            if as_of >= end and key_id in self._keys:
                key = self._keys[key_id]
                month = self._months.get(key_id, 0)
                self._set(key_id, key, self._build(key, month, as_of), change, as_of)
        await self._reshare(change, as_of)
        self._merge_peers(change, as_of, force=rolled)
        self._done(as_of, change)

    def _read_changes(
        self,
        low: int,
        seen: frozenset[int],
        dirty: set[str],
        budgeted: Mapping[str, tuple[ApiKey, int]],
        now: datetime,
    ) -> _Read:
        """The audit events after `low`, the keys they (and `dirty`) name, and the month
        tokens of those with a budget and of `budgeted` (key id → (key, tokens known; -1 to
        rebuild anyway)); entries are built only for re-read keys and changed budgets."""
        events = list(self._store.audit_after(low, self.settings.audit_batch))
        wanted = dirty | {key_id for i, key_id in events if i not in seen}
        keys: dict[str, ApiKey | None] = dict.fromkeys(wanted)
        if wanted:
            keys.update((k.key_id, k) for k in self._store.get_many(wanted))
        months_of = set(budgeted)
        months_of.update(k for k, key in keys.items() if key and key.limits.monthly_token_budget)
        months = self._months_of(months_of, now) if months_of else {}
        built: dict[str, Built] = {}
        for key_id, found in keys.items():
            built[key_id] = {} if found is None else self._build(found, months.get(key_id, 0), now)
        for key_id, (key, known) in budgeted.items():
            if key_id not in built and months.get(key_id, 0) != known:
                built[key_id] = self._build(key, months.get(key_id, 0), now)
        return _Read(events, keys, months, built)

    def _follow(self, events: Iterable[tuple[int, str]]) -> None:
        """Moves the audit log's low-water mark over the ids seen, waiting `gap_seconds` for a
        hole (an id taken by a transaction not yet committed, or rolled back)."""
        self._seen.update(i for i, _ in events)
        if not self._seen:
            return
        now = self._timer()
        top = max(self._seen)
        for i in range(self._low + 1, top):
            if i not in self._seen and i not in self._holes:
                self._holes[i] = now
        while self._low < top:
            nxt = self._low + 1
            if nxt in self._seen:
                self._seen.discard(nxt)
            elif now - self._holes.get(nxt, now) >= self.settings.gap_seconds:
                self._holes.pop(nxt, None)
            else:
                break
            self._low = nxt
        for i in [i for i in self._holes if i <= self._low]:
            del self._holes[i]

    def _set(
        self, key_id: str, key: ApiKey | None, built: Built, change: Change, now: datetime
    ) -> None:
        """Makes `built` the entries of `key_id` (none: the key is gone) and notes in
        `change` what differs from before."""
        self._note(key_id, built, change)
        if key is None:
            self._by_key.pop(key_id, None)
            self._keys.pop(key_id, None)
            self._months.pop(key_id, None)
            self._graces.pop(key_id, None)
            return
        self._by_key[key_id] = built
        self._keys[key_id] = key
        end = grace_end(key, now)
        if end is None:
            self._graces.pop(key_id, None)
        else:
            self._graces[key_id] = end

    def _done(self, as_of: datetime, change: Change) -> None:
        self._read_at = self._timer()
        self._failing_since = None
        self._as_of = as_of
        self._read_seq = max(self._read_seq, self._pass_seq)
        for watcher in self._watchers:
            if change:
                watcher.push(change, self._read_seq)
            else:
                watcher.quiet_seq = self._read_seq

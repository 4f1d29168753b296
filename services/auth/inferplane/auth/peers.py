"""Keys and budgets across regions (issue 31; docs/regions.md): `PeerKeyTable`, this region's
copy of every peer region's own keys and what those regions served this month.

Each region's auth follows every peer's `KeyTableService.WatchKeyTable` as an internal caller
(the `auth` identity under mutual TLS; `internal_token` in `x-inferplane-internal-token` when
one is set, the same token every region's auth accepts). Of what a peer streams it keeps the
entries homed in that peer (`KeyEntry.home_region`), never pinned ones (`region_pinned`), nor
the peer's copies of third regions' keys (it follows those regions itself). They are written
to the auth database (`peer_store.SqlPeerKeyStore`) before they are served, and the key table
(`inferplane.auth.key_table.KeyTableFeed`) serves them merged with this region's own keys, so
this region's routers authenticate its peers' keys unchanged. A peer's snapshot replaces
everything held of it (keys deleted there during a cut disappear); its changes are applied as
they come. During a cut the last copy stays in force (also across this auth's restarts: it is
loaded from the database at start). A stream that fails, ends or stays quiet for
`idle_seconds` is opened again after a backoff (tenacity: exponential from 0.1 s to 2 s, full
jitter, reset by each snapshot).

Monthly budgets are global: every `budget_sync_seconds` (`regions.BUDGET_SYNC_SECONDS`) each
peer is asked (`RegionMonthTokens`) for its own ledger's month totals of every key with a
budget this region knows (its own and its peers'); the budget decision of every entry this
region serves is its own ledger's month plus the last totals each peer reported
(`month_tokens_of` for this region's keys, `built` for its peers'). During a cut each side
keeps the other's last totals, so a key overspends its budget by at most what the regions it
cannot see serve during the cut (plus one sync period).

Per-key rate limits are global too (`inferplane.auth.shares`): on the same cadence each peer's
answer carries its recent demand of every key (`RegionMonthTokensRequest.demand`), this
region's own is read from its ledger, and every entry of a key with a rate limit (its own keys
and its peers') carries this region's share of it. A peer from which nothing arrived for
`cut_seconds` is left out of the split (its share taken back). An entry copied from a peer
takes the key's own limits (`KeyEntry.key_limits`) when the peer sent its share.

Metrics: `inferplane_auth_peer_connected{region}` (1 while the watch of that peer is open and
has its snapshot), `inferplane_auth_peer_key_entries{region}`,
`inferplane_auth_peer_update_age_seconds{region}` (since the last message from it, +Inf
before the first), `inferplane_auth_peer_budget_syncs_total{region,outcome=ok|error}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import UTC, datetime, timedelta

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from tenacity import AsyncRetrying, retry_if_exception_type, wait_random_exponential

from inferplane import regions
from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.api.auth.v1 import key_table_pb2_grpc
from inferplane.auth.key_entries import Built, timestamp
from inferplane.auth.ledger import SqlUsageLedger, month_end
from inferplane.auth.peer_store import Entries, SqlPeerKeyStore
from inferplane.auth.shares import (
    DEMAND_WINDOW_SECONDS,
    Demand,
    RegionShares,
    ShareMetrics,
)
from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.runtime.time.clock import Clock
from inferplane.wire import headers

log = structlog.get_logger("inferplane.auth.peers")

#: The prefix of a peer key's id in the key table's index (`KeyTableFeed`), never a key id's.
PEER_KEY_PREFIX = "@"
#: Key ids per RegionMonthTokens request at most.
MAX_MONTH_KEYS = 10_000


def peer_key(region: str, key_id: str) -> str:
    """The key table's index of a peer's key (`@<region>/<key id>`)."""
    return f"{PEER_KEY_PREFIX}{region}/{key_id}"


def parse_peers(values: Iterable[str]) -> dict[str, str]:
    """`REGION=HOST:PORT` items (the `--peer` flag) as region -> address.

    Raises:
        ValueError: an item without `=` or an address, a bad region name, a region twice.
    """
    peers: dict[str, str] = {}
    for item in values:
        name, sep, address = item.partition("=")
        name, address = name.strip(), address.strip()
        if not sep or not address:
            raise ValueError(f"peer {item!r}: expected REGION=HOST:PORT")
        regions.validate_region(name)
        if name in peers:
            raise ValueError(f"peer region {name!r} given twice")
        peers[name] = address
    return peers


@dataclasses.dataclass(frozen=True, slots=True)
class PeerSettings:
    """How the peers are followed (seconds).

    Attributes:
        budget_sync_seconds: how often each peer's month totals are read.
        local_budget_seconds: how often this region's own ledger is read for its peers'
            budgeted keys (usage it served of them).
        heartbeat_seconds: the heartbeat asked of each peer's watch.
        idle_seconds: a watch quiet this long is dropped and opened again.
        call_timeout_seconds: the deadline of one RegionMonthTokens call.
        cut_seconds: a peer silent this long (no watch message) is left out of the split of
            the rate limits; None: 2 × `budget_sync_seconds` (at least 2 heartbeats).
        demand_window_seconds: the recent demand the split follows.
    """

    budget_sync_seconds: float = regions.BUDGET_SYNC_SECONDS
    local_budget_seconds: float = 1.0
    heartbeat_seconds: float = 1.0
    idle_seconds: float = 3.0
    call_timeout_seconds: float = 5.0
    cut_seconds: float | None = None
    demand_window_seconds: float = DEMAND_WINDOW_SECONDS

    @property
    def cut_after(self) -> float:
        if self.cut_seconds is not None:
            return self.cut_seconds
        return max(2 * self.budget_sync_seconds, 2 * self.heartbeat_seconds)


class PeerMetrics:
    """The metrics of the module docstring, one series per peer region."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.connected = Gauge(
            "inferplane_auth_peer_connected",
            "1 while this auth follows the region's key table (watch open, snapshot applied).",
            ["region"],
            registry=registry,
        )
        self.entries = Gauge(
            "inferplane_auth_peer_key_entries",
            "Secret hashes of the region's own keys held in this region's key table.",
            ["region"],
            registry=registry,
        )
        self.age = Gauge(
            "inferplane_auth_peer_update_age_seconds",
            "Seconds since the last message of the region's key table watch (+Inf: none yet).",
            ["region"],
            registry=registry,
        )
        self.budget_syncs = Counter(
            "inferplane_auth_peer_budget_syncs",
            "Reads of the region's month totals (RegionMonthTokens), by outcome.",
            ["region", "outcome"],
            registry=registry,
        )


class _Lost(Exception):
    """A peer's watch failed before its snapshot arrived (retried after a backoff)."""


class PeerKeyTable:
    """This region's copy of its peers' keys and month totals (module docstring).

    Args:
        region: this region's name.
        peers: the other regions' auth gRPC addresses (region -> host:port).
        store: where the copy persists; ledger: this region's usage ledger.
        security: this auth's identity (channels to the peers); token: the internal token.
        local_budgeted: this region's own key ids with a monthly budget (the key table's).
        on_change: called on the event loop whenever what `built` returns may have changed.
        timer: monotonic seconds (ages).

    Raises:
        ValueError: a peer named like this region, or an invalid region name.
    """

    def __init__(
        self,
        region: str,
        peers: Mapping[str, str],
        store: SqlPeerKeyStore,
        ledger: SqlUsageLedger,
        clock: Clock,
        metrics: PeerMetrics,
        *,
        security: PeerSecurity,
        token: str = "",
        settings: PeerSettings | None = None,
        timer: Callable[[], float] = time.monotonic,
        share_metrics: ShareMetrics | None = None,
    ) -> None:
        self.region = regions.validate_region(region)
        for name in peers:
            regions.validate_region(name)
            if name == region:
                raise ValueError(f"peer {name!r} is this auth's own region")
        self.peers = dict(peers)
        self.settings = settings or PeerSettings()
        self._store = store
        self._ledger = ledger
        self._clock = clock
        self._metrics = metrics
        self._security = security
        self._token = token
        self._timer = timer
        self.local_budgeted: Callable[[], Collection[str]] = frozenset
        self.on_change: Callable[[], None] = lambda: None
        self._entries: dict[str, Entries] = {name: {} for name in self.peers}
        self._raw: dict[str, dict[str, bytes]] = {name: {} for name in self.peers}
        # Month totals: each peer's own (with the month they belong to); this region's own
        # ledger of its peers' budgeted keys.
        self._remote: dict[str, tuple[datetime, dict[str, int]]] = {}
        self._local: dict[str, int] = {}
        self._updated: dict[str, float] = {}
        self._connected: dict[str, bool] = dict.fromkeys(self.peers, False)
        self._failing: dict[str, bool] = {}
        self.version = 0
        self._tenants: dict[str, str] = {}
        self._by_hash: dict[str, kpb.KeyEntry] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # The split of the rate limits: its inputs (this region's demand, each peer's last).
        self.shares = RegionShares(self.region, share_metrics)
        self._demand: dict[str, Demand] = {}
        self._peer_demand: dict[str, dict[str, Demand]] = {}
        for name in self.peers:
            self._gauges(name)

    # -- what the key table serves ------------------------------------------------------------

    def connected(self, region: str) -> bool:
        return self._connected[region]

    def entries(self, region: str) -> Entries:
        """The entries held of `region` (secret hash -> entry as the peer sent it)."""
        return self._entries[region]

    def tenant_of(self, key_id: str) -> str:
        """The tenant of a peer's key ("" when no peer's key has that id): the usage ledger's
        tenant of a request this region served with another region's key. Safe off the
        event loop (one read of an index replaced whole)."""
        return self._tenants.get(key_id, "")

    def entry_of(self, secret_hash: str) -> kpb.KeyEntry | None:
        """The peers' entry of `secret_hash`, or None (ext_authz's `KeyVerifier.peer_entry`)."""
        return self._by_hash.get(secret_hash)

    def others_month_tokens(self, key_id: str, now: datetime) -> int:
        """What the peers last reported serving of `key_id` in `now`'s month. Safe off the
        event loop (the key table's reads): the totals are copied in one step, and each
        region's are replaced whole, never changed in place."""
        end = month_end(now)
        return sum(t.get(key_id, 0) for e, t in tuple(self._remote.values()) if e == end)

    def add_others(self, found: dict[str, int], key_ids: Iterable[str], now: datetime) -> None:
        """Adds to `found` (this region's month totals, key id -> tokens) what the peers last
        reported of `key_ids` in `now`'s month: the budget of this region's own keys."""
        for key_id in key_ids:
            others = self.others_month_tokens(key_id, now)
            if others:
                found[key_id] = found.get(key_id, 0) + others

    def built(self, now: datetime, skip: Collection[str] = ()) -> dict[str, Built]:
        """The key table's entries of every peer key (`peer_key` -> secret hash -> entry),
        budgets decided over every region; hashes in `skip` (this region's own) left out."""
        end = month_end(now)
        resets = timestamp(end)
        tables: dict[str, Built] = {}
        for region, entries in self._entries.items():
            for secret_hash, entry in entries.items():
                if secret_hash in skip:
                    continue
                budget = entry.limits.monthly_token_budget
                share = self.shares.limits_for(entry.key_id, region, entry.limits)
                if budget or share is not None:
                    entry = kpb.KeyEntry.FromString(entry.SerializeToString())
                    if share is not None:
                        entry.key_limits.CopyFrom(entry.limits)
                        entry.limits.CopyFrom(share)
                    if budget:
                        used = self._local.get(entry.key_id, 0)
                        used += self.others_month_tokens(entry.key_id, now)
                        entry.month_tokens = used
                        entry.budget_exhausted = used >= budget
                        entry.budget_resets.CopyFrom(resets)
                    raw = entry.SerializeToString(deterministic=True)
                else:  # as received: serialized once, when it arrived
                    raw = self._raw[region][secret_hash]
                table = tables.setdefault(peer_key(region, entry.key_id), {})
                table[secret_hash] = (raw, entry)
        return tables

    def budgeted(self) -> set[str]:
        """Key ids with a budget among the peers' keys."""
        return {
            e.key_id
            for entries in self._entries.values()
            for e in entries.values()
            if e.limits.monthly_token_budget
        }

    # -- running -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Loads the stored copy, then follows every peer and their month totals."""
        loaded = await asyncio.to_thread(self._store.load, list(self.peers))
        for region, entries in loaded.items():
            self._hold(region, entries.values())
        self._changed()
        log.info(
            "peer_key_tables_loaded",
            region=self.region,
            entries={r: len(e) for r, e in self._entries.items()},
        )
        for region, address in self.peers.items():
            self._tasks.append(
                asyncio.create_task(self._follow(region, address), name=f"peer-{region}")
            )
        self._tasks.append(asyncio.create_task(self._budgets(), name="peer-budgets"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def _gauges(self, name: str) -> None:
        self._metrics.connected.labels(name).set_function(lambda: float(self._connected[name]))
        self._metrics.entries.labels(name).set_function(lambda: len(self._entries[name]))
        self._metrics.age.labels(name).set_function(lambda: self._age(name))
        for outcome in ("ok", "error"):
            self._metrics.budget_syncs.labels(name, outcome)

    def _hold(self, region: str, put: Iterable[kpb.KeyEntry], gone: Iterable[str] = ()) -> None:
        """Adds `put` to (and drops `gone` from) what is held of `region`, serialized once."""
        held, raws = self._entries[region], self._raw[region]
        for secret_hash in gone:
            held.pop(secret_hash, None)
            raws.pop(secret_hash, None)
        for entry in put:
            held[entry.secret_hash] = entry
            raws[entry.secret_hash] = entry.SerializeToString(deterministic=True)

    def _changed(self) -> None:
        self._tenants = {
            e.key_id: e.tenant for entries in self._entries.values() for e in entries.values()
        }
        self._by_hash = {h: e for entries in self._entries.values() for h, e in entries.items()}
        self.version += 1
        self.on_change()

    def _age(self, region: str) -> float:
        at = self._updated.get(region)
        return math.inf if at is None else self._timer() - at

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((headers.INTERNAL_TOKEN, self._token),) if self._token else ()

    async def _follow(self, region: str, address: str) -> None:
        while True:
            retrying = AsyncRetrying(
                wait=wait_random_exponential(multiplier=0.1, max=2.0),
                retry=retry_if_exception_type(_Lost),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self._watch(region, address)
            # The watch had its snapshot, then ended: open it again at once.
            await asyncio.sleep(0.1)

    async def _watch(self, region: str, address: str) -> None:
        """One watch of `region`; returns after it ended having applied a snapshot.

        Raises:
            _Lost: it ended before its snapshot.
        """
        snapshot = False
        channel = self._security.aio_channel(address)
        try:
            stub = key_table_pb2_grpc.KeyTableServiceStub(channel)
            call = stub.WatchKeyTable(
                kpb.WatchKeyTableRequest(
                    router_id=f"auth-{self.region}",
                    heartbeat_seconds=self.settings.heartbeat_seconds,
                ),
                metadata=self._metadata(),
            )
            while True:
                message = await asyncio.wait_for(call.read(), self.settings.idle_seconds)
                if message is grpc.aio.EOF:  # type: ignore[attr-defined]
                    break
                assert isinstance(message, kpb.WatchKeyTableResponse)
                self._updated[region] = self._timer()
                if message.snapshot:
                    await self._replace(region, message.entries)
                    if not snapshot:
                        log.info("peer_key_table_connected", peer=region, address=address)
                    snapshot = True
                    self._connected[region] = True
                    self._failing[region] = False
                elif snapshot and (message.entries or message.removed):
                    await self._apply(region, message.entries, message.removed)
        except (grpc.aio.AioRpcError, TimeoutError, OSError) as exc:
            # Once per outage: the link was lost, or the first try of a series failed (a peer
            # down at start, or refusing this auth: a wrong token or certificate says so here).
            if self._connected[region] or not self._failing.get(region):
                said = (
                    f"{exc.code().name}: {exc.details()}"
                    if isinstance(exc, grpc.aio.AioRpcError)
                    else repr(exc)
                )
                log.warning("peer_key_table_unreachable", peer=region, error=said[:300])
            self._failing[region] = not snapshot
        except Exception:  # the database: keep the last copy, try again
            log.exception("peer_key_table_failed", peer=region)
        finally:
            self._connected[region] = False
            await channel.close(grace=None)
        if not snapshot:
            raise _Lost(region)

    def _own(self, region: str, entries: Iterable[kpb.KeyEntry]) -> list[kpb.KeyEntry]:
        """The entries homed in `region` and not pinned: what this region keeps of it, with
        the key's own limits where `region` sent its share of them."""
        kept = [e for e in entries if e.home_region == region and not e.region_pinned]
        for entry in kept:
            if entry.HasField("key_limits"):
                entry.limits.CopyFrom(entry.key_limits)
                entry.ClearField("key_limits")
        return kept

    async def _replace(self, region: str, entries: Iterable[kpb.KeyEntry]) -> None:
        kept = self._own(region, entries)
        await asyncio.to_thread(self._store.replace, region, kept, self._clock.now())
        self._entries[region], self._raw[region] = {}, {}
        self._hold(region, kept)
        self._changed()

    async def _apply(
        self, region: str, entries: Iterable[kpb.KeyEntry], removed: Collection[str]
    ) -> None:
        entries = list(entries)
        kept = self._own(region, entries)
        # An entry no longer homed there (never expected) is dropped like a removed one.
        gone = set(removed) | {e.secret_hash for e in entries} - {e.secret_hash for e in kept}
        await asyncio.to_thread(self._store.apply, region, kept, gone, self._clock.now())
        self._hold(region, kept, gone)
        self._changed()

    # -- budgets -------------------------------------------------------------------------------

    async def _budgets(self) -> None:
        next_sync = 0.0
        while True:
            try:
                now = self._clock.now()
                peer_ids = self.budgeted()
                local = (
                    await asyncio.to_thread(self._ledger.month_tokens_of, peer_ids, now)
                    if peer_ids
                    else {}
                )
                changed = local != self._local
                self._local = local
                if self._timer() >= next_sync:
                    next_sync = self._timer() + self.settings.budget_sync_seconds
                    since = now - timedelta(seconds=self.settings.demand_window_seconds)
                    demand = await asyncio.to_thread(self._ledger.recent_demand, since)
                    self._demand = {k: Demand(r, t) for k, (r, t) in demand.items()}
                    wanted = sorted(peer_ids | set(self.local_budgeted()))
                    results = await asyncio.gather(
                        *(self._sync(region, wanted) for region in self.peers)
                    )
                    changed = any(results) or changed
                changed = self._reshare() or changed
                if changed:
                    self._changed()
            except Exception:  # the database is away: try again at the next period
                log.exception("peer_budget_read_failed")
            await asyncio.sleep(self.settings.local_budget_seconds)

    def reachable(self) -> list[str]:
        """The peers counted in the split: a watch message from each within `cut_seconds`."""
        now, cut = self._timer(), self.settings.cut_after
        return [r for r in self.peers if now - self._updated.get(r, -math.inf) <= cut]

    def _reshare(self) -> bool:
        """Gives the split its current inputs; True when they changed."""
        return self.shares.update(
            self._demand, self._peer_demand, self.reachable(), peers=self.peers
        )

    async def _sync(self, region: str, key_ids: list[str]) -> bool:
        """Reads `region`'s month totals of `key_ids` and its recent demand; True when the
        totals changed (the demand is kept for `_reshare`)."""
        channel = self._security.aio_channel(self.peers[region])
        try:
            stub = key_table_pb2_grpc.KeyTableServiceStub(channel)
            totals: dict[str, int] = {}
            end = None
            demand: dict[str, Demand] = {}
            # The first call also asks the demand (one call when no key has a budget).
            for start in range(0, max(1, len(key_ids)), MAX_MONTH_KEYS):
                reply = await stub.RegionMonthTokens(
                    kpb.RegionMonthTokensRequest(
                        key_ids=key_ids[start : start + MAX_MONTH_KEYS],
                        region=self.region,
                        demand=start == 0,
                    ),
                    metadata=self._metadata(),
                    timeout=self.settings.call_timeout_seconds,
                )
                totals.update(reply.tokens)
                end = reply.month_end.ToDatetime(tzinfo=UTC)
                demand.update((k, Demand(d.requests, d.tokens)) for k, d in reply.demand.items())
        except grpc.aio.AioRpcError as exc:
            # The last totals stay: what the budget decision keeps during a cut.
            self._metrics.budget_syncs.labels(region, "error").inc()
            log.debug("peer_budget_sync_failed", peer=region, code=exc.code().name)
            return False
        finally:
            await channel.close(grace=None)
        self._metrics.budget_syncs.labels(region, "ok").inc()
        assert end is not None
        self._peer_demand[region] = demand
        before = self._remote.get(region)
        self._remote[region] = (end, totals)
        return before != (end, totals)


async def region_month_tokens(
    ledger: SqlUsageLedger,
    clock: Clock,
    region: str,
    request: kpb.RegionMonthTokensRequest,
    window: float = DEMAND_WINDOW_SECONDS,
) -> kpb.RegionMonthTokensResponse:
    """The answer of `RegionMonthTokens`: `ledger`'s month totals of the requested keys and,
    when asked, its recent demand (`window` seconds up to `clock`'s now) of every key.

    Raises:
        InvalidArgumentError: more than `MAX_MONTH_KEYS` key ids.
        UnavailableError: the ledger cannot be read.
    """
    if len(request.key_ids) > MAX_MONTH_KEYS:
        raise InvalidArgumentError(f"at most {MAX_MONTH_KEYS} key_ids per request", param="key_ids")
    now = clock.now()
    totals = (
        await asyncio.to_thread(ledger.month_tokens_of, list(request.key_ids), now)
        if request.key_ids
        else {}
    )
    reply = kpb.RegionMonthTokensResponse(
        tokens=totals, region=region, month_end=timestamp(month_end(now))
    )
    if request.demand:
        since = now - timedelta(seconds=window)
        for key_id, (requests, tokens) in (
            await asyncio.to_thread(ledger.recent_demand, since)
        ).items():
            reply.demand[key_id].requests = requests
            reply.demand[key_id].tokens = tokens
        reply.demand_window_seconds = window
    return reply

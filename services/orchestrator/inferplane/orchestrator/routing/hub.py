"""`RoutingHub`: the latest routing table, its watchers (the full table first, then every change
of what each one sees), and the routers' shares of each replica's cap under leases, with the
grants journal (the rule: `inferplane.orchestrator.routing.shares`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence

import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.autoscale.demand import DemandAggregate, DemandBook, RouterDemand
from inferplane.orchestrator.routing.shares import (
    DEFAULT_HOLD_SECONDS,
    DEFAULT_LEASE_MARGIN_SECONDS,
    DEFAULT_LEASE_SECONDS,
    JOURNAL_RETRY_SECONDS,
    GrantsJournal,
    RouterLease,
    split_cap,
)
from inferplane.orchestrator.routing.table import (
    ReplicaKey,
    endpoint_key,
    filter_table,
    make_table,
    router_view,
)
from inferplane.runtime import FailedPreconditionError
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.orchestrator.routing")


class RoutingHub:
    """The latest routing table, its watchers, and the routers' shares of each replica's cap
    (one event loop).

    Args:
        clock: monotonic time of leases (`SystemClock` by default).
        lease_seconds: how long a renewal lets a router admit on its shares (> 0).
        lease_margin_seconds: added on the hub's side before a silent router's shares are
            given to the others (clock-rate differences, processing).
        hold_seconds: how long a router whose lease ran out unrenewed still admits on its
            last shares (>= 0; told to routers in each renewal's answer): a silent router's
            `held` is kept, and a hub that starts without a complete hand-over grants no room,
            for `lease_seconds + hold_seconds + lease_margin_seconds` (`routing.shares`).
        epoch: this hub's lease epoch prefix (random by default; tests pin it).
        journal: where `held` is written before a grown share is shown (`routing.shares`);
            None: nothing is written, and a hub that starts granting waits out every lease
            (and hold).
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        lease_margin_seconds: float = DEFAULT_LEASE_MARGIN_SECONDS,
        hold_seconds: float = DEFAULT_HOLD_SECONDS,
        epoch: str | None = None,
        journal: GrantsJournal | None = None,
    ) -> None:
        if lease_seconds <= 0 or lease_margin_seconds < 0 or hold_seconds < 0:
            raise ValueError(
                "lease_seconds must be > 0, lease_margin_seconds and hold_seconds >= 0"
            )
        self._table = make_table(())
        self._clock = clock or SystemClock()
        self._lease = lease_seconds
        self._margin = lease_margin_seconds
        self._hold = hold_seconds
        self._epoch = epoch if epoch is not None else secrets.token_hex(6)
        self._incarnations = itertools.count(1)
        self._grants_from = self._clock.monotonic() + self._grace()
        self._quiet = True
        self._granting = True
        self._routers: dict[str, RouterLease] = {}
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._journal = journal
        self._held_seq = 0  # bumped when any `held` grows: views wait until it is written
        self._saved_seq = 0
        self._dirty = False  # a `held` shrank or a router went: write it (nothing waits)
        self._saver: asyncio.Task[None] | None = None
        self._peers: tuple[str, ...] = ()  # members' ids in order: the per-key limit split
        # The routers' demand per deployment (autoscaling); a router silent past its lease
        # (and margin) drops out of it.
        self._demand = DemandBook(clock=self._clock, stale_after_seconds=self._lease + self._margin)
        self._on_cold_demand: Callable[[], None] | None = None

    def on_cold_demand(self, callback: Callable[[], None] | None) -> None:
        """Calls `callback()` on a renewal that reports a request held for a cold start (the
        autoscaler looks at once instead of at its next tick)."""
        self._on_cold_demand = callback

    def demand(self, deployment_id: str) -> DemandAggregate:
        """The deployment's demand over the routers that reported within their lease
        (`autoscale.demand`)."""
        return self._demand.aggregate(deployment_id)

    def quiet(self, deployment_id: str, within_seconds: float) -> bool:
        """Whether every router with a fresh report said, in a report of the last
        `within_seconds`, that it has no request in flight, queued or held for the deployment
        (at least one router reported; `DemandBook.quiet_since`)."""
        return self._demand.quiet_since(deployment_id, self._clock.monotonic() - within_seconds)

    @property
    def table(self) -> pb.WatchRoutingTableResponse:
        return self._table

    @property
    def lease_seconds(self) -> float:
        return self._lease

    @property
    def hold_seconds(self) -> float:
        """How long a router still admits on its last shares once its lease ran out."""
        return self._hold

    def _grace(self) -> float:
        """From a router's last renewal here (or this hub's start) until no share of it (or
        granted before) can still be admitted on: lease, hold and margin, seconds."""
        return self._lease + self._hold + self._margin

    async def publish(self, table: pb.WatchRoutingTableResponse) -> bool:
        """Makes `table` current; returns whether its version differs from the last one."""
        if table.version == self._table.version:
            return False
        self._table = table
        if self._routers:
            self._rebalance()
        self._notify()
        return True

    def set_granting(
        self, granting: bool, *, adopted: Mapping[str, Mapping[ReplicaKey, int]] | None = None
    ) -> None:
        """Whether this hub splits caps (the leader's) or not (a standby's: every router's
        shares are 0 and renewals are refused, so its routers' leases run out). Turning it
        on starts a new epoch. `adopted`: the `held` the previous term wrote, complete
        (`routing.shares`, hand-over): each router keeps it and room nobody held is granted at
        once.
        None: no room is granted for `lease_seconds + hold_seconds + lease_margin_seconds`
        (only the shares routers report they still hold over: `renew(held=...)`).
        """
        if granting == self._granting and adopted is None:
            return
        self._granting = granting
        now = self._clock.monotonic()
        if granting:
            self._epoch = secrets.token_hex(6)
            self._grants_from = now if adopted is not None else now + self._grace()
            self._quiet = adopted is None
        for router in self._routers.values():  # no lease of before can be renewed
            router.reset(self._new_epoch())
        self._saved_seq = self._held_seq  # nothing held now was shown unwritten
        if granting and adopted is not None:
            for router_id, held in adopted.items():
                if not held:
                    continue
                router = self._routers.get(router_id)
                if router is None:
                    router = self._routers[router_id] = RouterLease(router_id, self._new_epoch())
                router.held, router.sent = dict(held), dict(held)
                # Its old lease (and hold) ends by then at the latest; a renewal here extends it.
                router.expires = now + self._lease + self._margin
                router.forget_at = now + self._grace()
                router.generation += 1
            self._dirty = True  # this term writes them: its successor can adopt in turn
        self._rebalance()
        self._notify()
        self._arm()

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()
        self._save_soon()

    # -- the journal -------------------------------------------------------------------------

    def _unsaved(self) -> bool:
        """Whether a grown `held` is not written yet (views with grown shares wait)."""
        return self._journal is not None and self._granting and self._saved_seq < self._held_seq

    def _save_soon(self) -> None:
        if self._journal is None or not self._granting or self._saver is not None:
            return
        if not (self._dirty or self._unsaved()):
            return
        try:
            self._saver = asyncio.get_running_loop().create_task(self._save(), name="grants")
        except RuntimeError:  # outside the event loop (tests driving the hub by hand)
            return

    async def _save(self) -> None:
        assert self._journal is not None
        try:
            while self._granting and (self._dirty or self._unsaved()):
                seq, self._dirty = self._held_seq, False
                held = {r.router_id: dict(r.held) for r in self._routers.values() if r.held}
                try:
                    await self._journal(held)
                except Exception as exc:  # the database away, or deposed: views wait
                    self._dirty = True
                    log.warning("router_grants_write_failed", error=str(exc))
                    await asyncio.sleep(JOURNAL_RETRY_SECONDS)
                    continue
                if seq > self._saved_seq:
                    self._saved_seq = seq
                    wake, self._wake = self._wake, asyncio.Event()
                    wake.set()  # views waiting for it
        finally:
            self._saver = None

    # -- watchers ----------------------------------------------------------------------------

    async def watch(
        self, models: Sequence[str] = (), router_id: str = ""
    ) -> AsyncGenerator[pb.WatchRoutingTableResponse, None]:
        """The current table (filtered to `models`) at once, then every table whose filtered
        content changed. With `router_id`, the view is that router's: its shares and lease
        epoch (`routing.shares`). Runs until the consumer stops iterating (close it, e.g.
        with `contextlib.aclosing`, so the router's stream is counted as closed at once)."""
        router = self._open(router_id, tuple(models)) if router_id else None
        sent = ""
        built: tuple[str, int] | None = None  # (table version, router generation) of `view`
        try:
            while True:
                wake = self._wake
                if router is None:
                    view = filter_table(self._table, models)
                else:
                    self.expire_leases()
                    state = (self._table.version, router.generation)
                    if state != built:  # views cost O(table): built only when they changed
                        built = state
                        view, shares = self._view(router)
                if view.version != sent and router is not None and self._unsaved():
                    self._save_soon()
                    await wake.wait()  # its shares may cover a `held` not written yet
                    continue
                if view.version != sent:
                    sent = view.version
                    if router is not None:
                        router.shown, router.shown_version = shares, view.version
                    yield view
                    continue
                await wake.wait()
        finally:
            if router is not None:
                router.streams -= 1

    def _open(self, router_id: str, models: tuple[str, ...]) -> RouterLease:
        router = self._routers.get(router_id)
        if router is None:
            router = self._routers[router_id] = RouterLease(router_id, self._new_epoch())
        router.streams += 1
        if router.models != models:
            router.models = models
            if self._rebalance():
                self._notify()
        return router

    def _new_epoch(self) -> str:
        return f"{self._epoch}.{next(self._incarnations)}"

    def _view(
        self, router: RouterLease
    ) -> tuple[pb.WatchRoutingTableResponse, dict[ReplicaKey, int]]:
        peers = self._peers
        if router.router_id not in peers:  # before its first lease: counted already
            peers = tuple(sorted((*peers, router.router_id)))
        return router_view(
            self._table,
            router.models,
            router.sent,
            router.epoch,
            standby=not self._granting,
            router_count=len(peers),
            router_rank=peers.index(router.router_id),
        )

    # -- leases ------------------------------------------------------------------------------

    def renew(
        self,
        router_id: str,
        lease_epoch: str,
        version: str,
        over_share: Iterable[ReplicaKey] = (),
        *,
        release: bool = False,
        demand: Iterable[tuple[str, RouterDemand]] = (),
        held: Iterable[tuple[ReplicaKey, int]] = (),
    ) -> float:
        """One renewal of `router_id`'s lease; returns the lease in seconds (counted from
        when the router sent it), 0 when `lease_epoch` is not the router's current one (it
        must wait for its next table) or when `held` added to its shares (it must wait for
        the view that shows them). `version` acknowledges the table the router enforces:
        when it is the last one shown, the router's `held` drops to its shares except on
        `over_share`. `release`: the router admits nothing more (`over_share` then names the
        replicas it still has requests in flight to). `demand`: the router's view of each
        deployment's demand (deployment id, report), kept for the autoscaler (`demand`).
        `held`: (replica, requests) the router still admits on under an earlier lease
        (`routing.shares`, held-over shares): counted as its own before any room is granted.

        Raises:
            FailedPreconditionError: the router has no watch stream open here, or this hub is
                a standby's (its lease is not renewed: it ends within `lease_seconds`).
        """
        now = self._clock.monotonic()
        self.expire_leases()
        if not self._granting:
            raise FailedPreconditionError(
                "this orchestrator is a standby: renew the lease with the leader",
                code="not_leader",
            )
        router = self._routers.get(router_id)
        if router is None or router.streams <= 0:
            raise FailedPreconditionError(
                f"router {router_id!r} has no routing-table watch open: open "
                "WatchRoutingTable with this router_id first",
                code="no_routing_watch",
            )
        if release:
            self._demand.forget(router_id)
        elif self._demand.record(router_id, demand) and self._on_cold_demand is not None:
            self._on_cold_demand()
        was_member = router.member(now)
        covered = lease_epoch == router.epoch
        before = dict(router.held)
        adopted = covered and not release and self._hold_over(router, held)
        if covered and release:  # it admits nothing more: only what still runs counts
            over = set(over_share)
            router.held = {k: v for k, v in router.held.items() if k in over}
        elif covered and version == router.shown_version:
            over = set(over_share)
            shown, sent = router.shown, router.sent
            for key in list(router.held):
                if key in over:
                    continue
                value = max(shown.get(key, 0), sent.get(key, 0))
                if value:
                    router.held[key] = value
                else:
                    del router.held[key]
        if router.held != before:
            self._dirty = True
            if any(n > before.get(k, 0) for k, n in router.held.items()):
                self._held_seq += 1
        router.expires = now + self._lease + self._margin
        router.forget_at = now + self._grace()
        router.released = covered and release
        # Membership or room changed: the split moves (steady renewals change nothing).
        moved = router.member(now) != was_member or router.held != before
        if (moved and self._rebalance()) or adopted:
            self._notify()
        self._arm()
        if not covered or adopted:  # it waits for its next view (membership counts)
            return 0.0
        return 0.0 if release else self._lease

    def _hold_over(self, router: RouterLease, reported: Iterable[tuple[ReplicaKey, int]]) -> bool:
        """Adds `router`'s held-over shares to its `held` and next view's shares, each within
        the room nobody else holds (`routing.shares`); returns whether its shares grew."""
        caps = self._caps()
        grew = False
        for key, requests in reported:
            mine = router.held.get(key, 0)
            cap = caps.get(key)
            if cap is None:  # left the table: nothing new goes there, what runs counts
                want = max(mine, requests)
            else:
                others = sum(r.held.get(key, 0) for r in self._routers.values()) - mine
                want = max(mine, min(requests, cap - others))
                if want < requests:
                    log.warning(
                        "router_held_share_clamped",
                        router=router.router_id,
                        replica=key[1],
                        reported=requests,
                        kept=want,
                    )
            if want > mine:
                router.held[key] = want
            if cap is not None and want > router.sent.get(key, 0):
                router.sent[key] = want
                router.generation += 1
                grew = True
        return grew

    def expire_leases(self) -> None:
        """Forgets the shares of routers whose lease ran out (hub's clock) and gives them to
        the others; starts granting once the start-up wait is over. The hub calls it from a
        timer and on every renewal and view; tests call it after moving their clock."""
        now = self._clock.monotonic()
        changed = False
        if self._quiet and self._granting and now >= self._grants_from:
            self._quiet = False
            changed = True
        for router_id, router in list(self._routers.items()):
            if now < router.expires:
                continue
            if now < router.forget_at:  # in its hold: out of the split, its `held` stays
                changed = changed or bool(router.sent)
                continue
            if router.expires > -math.inf or router.held or router.sent:
                # Its lease and hold have ended on its own clock too: start over under a new
                # epoch, so that no lease of the old one can be renewed.
                self._dirty = self._dirty or bool(router.held)
                router.reset(self._new_epoch())
                changed = True
            if router.streams <= 0:
                del self._routers[router_id]
        if changed:
            self._rebalance()
            self._notify()

    def _arm(self) -> None:
        """Schedules `expire_leases` at the next deadline (a wake-up only: it checks time)."""
        now = self._clock.monotonic()
        deadlines = [t for r in self._routers.values() for t in (r.expires, r.forget_at) if t > now]
        if self._quiet and self._granting:
            deadlines.append(self._grants_from)
        if not deadlines:
            return
        at = min(deadlines)
        if self._timer is not None and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop (tests): they expire by hand
            return
        delay = max(0.0, at - self._clock.monotonic()) + 0.001
        self._timer_at = at
        self._timer = loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self.expire_leases()
        self._arm()

    def shares(self, router_id: str) -> dict[ReplicaKey, int]:
        """The shares `router_id`'s next view carries (a copy; for tests and logs)."""
        router = self._routers.get(router_id)
        return {} if router is None else dict(router.sent)

    def held(self, key: ReplicaKey) -> int:
        """What all routers may have in flight to the replica `key` together (≤ its cap)."""
        return sum(r.held.get(key, 0) for r in self._routers.values())

    # -- splitting ---------------------------------------------------------------------------

    def _rebalance(self) -> bool:
        """Recomputes every router's next shares from the table, the members and `held`;
        returns whether any router's shares changed (its `generation` is bumped)."""
        now = self._clock.monotonic()
        routers = sorted(self._routers.values(), key=lambda r: r.router_id)
        members = [r for r in routers if r.member(now)]
        peers = tuple(r.router_id for r in members)
        peers_changed = peers != self._peers
        self._peers = peers
        seen_by: dict[ReplicaKey, set[str]] = {}
        for route in self._table.routes:
            for endpoint in route.endpoints:
                seen_by.setdefault(endpoint_key(endpoint), set()).add(route.model)
        caps = self._caps()
        before = [dict(r.sent) for r in routers]
        for key, cap in caps.items():
            models = seen_by[key]
            sharing = [r for r in members if not r.models or models.intersection(r.models)]
            self._held_seq += split_cap(
                key, cap, sharing, routers, granting=self._granting, frozen=self._quiet
            )
        changed = False
        for router, sent in zip(routers, before, strict=True):
            for key in [k for k in router.sent if k not in caps]:
                del router.sent[key]  # replicas that left the table: nothing new to them
            if router.sent != sent or peers_changed:  # count and rank are in every view
                router.generation += 1
                changed = True
        return changed

    def _caps(self) -> dict[ReplicaKey, int]:
        """Each replica's cap in the table (the smallest, when several routes list it)."""
        caps: dict[ReplicaKey, int] = {}
        for route in self._table.routes:
            for endpoint in route.endpoints:
                key = endpoint_key(endpoint)
                cap = endpoint.max_concurrency
                caps[key] = min(caps.get(key, cap), cap)
        return caps

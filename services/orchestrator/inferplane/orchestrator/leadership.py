"""Leader election among orchestrators that share one database, and what leading means
(issue 20: no single point of failure in the control plane).

Any number of orchestrators may run on one database (SQLite on one host, PostgreSQL across
hosts); one leads. Only the leader runs the control loop (placement commits, the liveness sweep,
reconcile and rolling releases) and answers the catalogue and fleet RPCs (`DeploymentService`,
`NodeService`: node-agents register and heartbeat with the leader). A standby answers those with
UNAVAILABLE, reason NOT_LEADER, naming the leader (`store.lease.NotLeaderError`), and serves the
routing table the leader stored, so `RoutingService` and Envoy's ADS keep answering on every
instance (`RoutingTableRelay`; at most `reconcile_interval_seconds` behind the leader's).

The lease (one row of `leader_leases`, `store/lease.py`), for a lease duration d and a renew
interval r < d (settings `leader_lease_seconds` 10, `leader_renew_seconds` 3):

- A contender takes the lease when no row exists, when it was released (holder ""), when the row
  names the contender's own id (the same id restarted), or when the row's holder, term and
  version have not changed for the holder's d seconds on the contender's own monotonic clock,
  counted from when it first saw that version. No wall-clock time is compared between hosts (the
  rule of Kubernetes' client-go leader election): only the clocks' rates must agree.
- The leader renews every r seconds and counts itself leader until d seconds after the START of
  its last successful renewal. A standby counts its d from a moment after that renewal
  committed, so the leader stops before any standby may take over. A renewal that fails (the
  database unreachable) is retried until then; one that matches nothing (the lease was taken)
  deposes the leader at once.
- Failover bound: a leader that dies at time D renewed last at some T in (D - r, D]; a standby
  polls every r, so it saw that version by T + r, and takes over d later: a new leader by
  D + d + r (13 s with the defaults), plus one transaction and loading the state. A clean stop
  releases the lease, and a standby takes over within r.

Fencing: every acquisition raises the term by one. Every write an orchestrator makes (catalogue,
fleet and placement commits in `store/sql.py`; managed replicas and releases in
`release/store.py`; the stored routing table) runs `LeaderLease.fence` first in its transaction:
the lease row must still name this orchestrator at its term, or the write is refused
(NotLeaderError) and nothing of it is written. So a leader deposed while it was paused or cut off
cannot overwrite its successor when it wakes up. Node-agent calls that change replicas (start,
drain, stop) are made only while the lease is held on the local clock (`LeaderOnlyAgents`); they
are idempotent by replica id, and the new leader adopts what it finds running.

The lease lives in the database on every platform, Kubernetes included: a `coordination.k8s.io`
Lease could elect a leader but could not fence the database writes in their own transactions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable

import structlog
from sqlalchemy.orm import Session

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.release.agents import NodeAgents, ProbeResult
from inferplane.orchestrator.routing import Grants, RoutingHub
from inferplane.orchestrator.store.lease import (
    MAX_HOLDER,
    LeaseRecord,
    NotLeaderError,
    SqlLeaseStore,
    SqlRouterGrants,
    SqlRoutingTables,
)
from inferplane.runtime import ConfigError
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.orchestrator.leadership")

#: The name of the orchestrators' lease row (and of the routing table its leader stores).
LEASE_NAME = "orchestrator"


def default_holder() -> str:
    """`hostname:pid`: unique among live processes; a restart gets a new id."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaderLease:
    """One orchestrator's side of the lease (see the module docstring for the rule).

    Blocking: every method but `held`, `leader` and `wait_seconds` makes one database call, and
    raises UnavailableError when the database cannot be reached. Time is `clock.monotonic()`
    (seconds); `clock.now()` only stamps the row for operators.

    Raises:
        ConfigError: an empty or too long holder id, or not 0 < renew_interval < duration.
    """

    def __init__(
        self,
        store: SqlLeaseStore,
        *,
        holder: str,
        duration_seconds: float,
        renew_interval_seconds: float,
        clock: Clock,
        name: str = LEASE_NAME,
    ) -> None:
        if not holder or len(holder) > MAX_HOLDER:
            raise ConfigError(
                f"setting 'leader_id': 1 to {MAX_HOLDER} characters; got {len(holder)}"
            )
        if not 0 < renew_interval_seconds < duration_seconds:
            raise ConfigError(
                "settings 'leader_renew_seconds' and 'leader_lease_seconds': need 0 < renew < "
                f"lease; got renew {renew_interval_seconds} s, lease {duration_seconds} s"
            )
        self._store = store
        self._holder = holder
        self._duration = duration_seconds
        self._renew = renew_interval_seconds
        self._clock = clock
        self._name = name
        self._term: int | None = None
        self._deadline = 0.0  # monotonic: leader until then
        self._next_at = 0.0  # monotonic: when the next acquire/renew attempt is due
        self._seen: LeaseRecord | None = None  # the row as last read while not holding it
        self._seen_at = 0.0  # monotonic: when `_seen`'s version was first read
        self._other: tuple[str, int] = ("", 0)  # the leader as last known, when not this one

    @property
    def holder(self) -> str:
        return self._holder

    @property
    def duration_seconds(self) -> float:
        return self._duration

    @property
    def renew_interval_seconds(self) -> float:
        return self._renew

    def held(self) -> bool:
        """Whether this orchestrator holds the lease now, by its own clock."""
        return self._term is not None and self._clock.monotonic() < self._deadline

    def term(self) -> int:
        """The term held. Raises NotLeaderError when the lease is not held."""
        term = self._term
        if term is None or not self.held():
            raise self.not_leader()
        return term

    def leader(self) -> tuple[str, int]:
        """The leader's id and term as last known here ("" when none is known)."""
        term = self._term
        if term is not None and self.held():
            return self._holder, term
        return self._other

    def not_leader(self) -> NotLeaderError:
        return NotLeaderError(self._holder, *self.leader())

    def wait_seconds(self) -> float:
        """Seconds until the next `try_acquire` or `renew` is due (0: now)."""
        return max(0.0, self._next_at - self._clock.monotonic())

    def try_acquire(self) -> bool:
        """Reads the lease and takes it when the rule allows; True when it is held now, at a
        new term."""
        started = self._clock.monotonic()
        self._next_at = started + self._renew
        row = self._store.read(self._name)
        now = self._clock.now()
        if row is not None:
            self._other = (row.holder, row.term)
        if row is None:
            won, term = self._store.insert(self._name, self._holder, self._duration, now), 1
        elif row.holder in ("", self._holder) or self._expired(row, started):
            won, term = self._store.take(row, self._holder, self._duration, now), row.term + 1
        else:
            self._next_at = min(self._next_at, self._seen_at + row.duration_seconds)
            return False
        if not won:  # another contender changed the row first
            return False
        self._term, self._deadline, self._seen = term, started + self._duration, None
        log.info(
            "leader_lease_acquired",
            holder=self._holder,
            term=term,
            previous_holder=row.holder if row else None,
        )
        return True

    def _expired(self, row: LeaseRecord, now: float) -> bool:
        seen = self._seen
        if seen is None or (seen.holder, seen.term, seen.version) != (
            row.holder,
            row.term,
            row.version,
        ):
            self._seen, self._seen_at = row, now
            return False
        self._seen = row
        return now - self._seen_at >= row.duration_seconds

    def renew(self) -> bool:
        """Extends the lease held; False when it is lost (expired on this clock, or taken).

        Raises:
            UnavailableError: the database cannot be reached (still held until the deadline;
                the next attempt is due in `wait_seconds`).
        """
        started = self._clock.monotonic()
        term = self._term
        if term is None or not self.held():
            self._learn_leader()
            self._lose("expired")
            return False
        self._next_at = min(started + self._renew, self._deadline)
        if not self._store.renew(self._name, self._holder, term, self._duration, self._clock.now()):
            self._learn_leader()  # first: a refusal from then on names the new leader
            self._lose("taken")
            return False
        self._deadline = started + self._duration
        self._next_at = started + self._renew
        return True

    def _learn_leader(self) -> None:
        """Reads who holds the lease now, so that refusals name it (best effort)."""
        with contextlib.suppress(Exception):
            row = self._store.read(self._name)
            self._other = (row.holder, row.term) if row else ("", 0)

    def release(self) -> bool:
        """Gives the lease up (a standby may take it at once); False when it was not held."""
        term = self._term
        if term is None:
            return False
        self._lose("released")
        return self._store.release(self._name, self._holder, term, self._clock.now())

    def fence(self, session: Session) -> None:
        """`store.lease.Fence`: run first in every write's transaction.

        Raises:
            NotLeaderError: the lease is not held on this clock, or the row has moved on
                (another orchestrator took it): the write must not happen.
        """
        term = self.term()
        try:
            SqlLeaseStore.fence(session, self._name, self._holder, term)
        except NotLeaderError as exc:
            self._other = (exc.leader, exc.term)
            self._lose("fenced")
            raise

    def _lose(self, why: str) -> None:
        if self._term is not None:
            level = log.info if why == "released" else log.warning
            level("leader_lease_lost", holder=self._holder, term=self._term, why=why)
        self._term = None


class Leadership:
    """Runs the lease in the composition root and answers who may act.

    Before `start` this orchestrator is in no election and everything passes: parts driven by
    hand (tests, tools) are the only writer. `start` joins the election before anything is
    written; from then on `require_leader` passes only on the leader once `lead` has finished,
    and `fence` only while the lease is held.
    """

    def __init__(self, lease: LeaderLease) -> None:
        self._lease = lease
        # Renewals must not queue behind the RPCs' worker threads (the default executor).
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="leader-lease")
        self._started = False
        self._leading = False
        self._standing_by = False
        self._lead: Callable[[], Awaitable[None]] | None = None
        self._follow: Callable[[], Awaitable[None]] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def lease(self) -> LeaderLease:
        return self._lease

    @property
    def leading(self) -> bool:
        """Whether this orchestrator leads (always before `start`)."""
        return not self._started or (self._leading and self._lease.held())

    def require_leader(self) -> None:
        """Raises NotLeaderError unless this orchestrator leads (the guard of the catalogue and
        fleet use cases and of node-agent calls that change replicas)."""
        if not self.leading:
            raise self._lease.not_leader()

    def fence(self, session: Session) -> None:
        """`store.lease.Fence` of every store (see `LeaderLease.fence`)."""
        if self._started:
            self._lease.fence(session)

    async def start(
        self, *, lead: Callable[[], Awaitable[None]], follow: Callable[[], Awaitable[None]]
    ) -> None:
        """Joins the election: one `step` now (a lone orchestrator leads before it serves),
        then a task that steps when `LeaderLease.wait_seconds` says.

        `lead()` is awaited when this orchestrator becomes the leader (load the state, start the
        control loop; if it raises, the lease is released again); `follow()` when it starts or
        becomes a standby (stop the control loop, serve the stored routing table).
        """
        self._lead, self._follow = lead, follow
        self._started = True
        await self.step()
        self._task = asyncio.create_task(self._run(), name="leader-lease")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._lease.wait_seconds())
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failing callback must not end the election
                log.exception("leadership_step_failed")

    async def step(self) -> None:
        """One renewal (leader) or one acquisition attempt (standby), and the transition it
        causes."""
        assert self._lead is not None and self._follow is not None, "start() first"
        lease = self._lease
        if self._leading:
            try:
                kept = await self._call(lease.renew)
            except Exception as exc:
                log.warning("leader_lease_renew_failed", error=str(exc), held=lease.held())
                kept = lease.held()
            if kept:
                return
            self._leading = False
            log.warning("leadership_lost", holder=lease.holder, leader=lease.leader()[0])
            await self._stand_by()
            return
        try:
            won = await self._call(lease.try_acquire)
        except Exception as exc:
            log.warning("leader_lease_unreadable", error=str(exc))
            won = False
        if won:
            self._standing_by = False
            try:
                await self._lead()
            except Exception:
                log.exception("leading_failed", holder=lease.holder)
                with contextlib.suppress(Exception):
                    await self._call(lease.release)
            else:
                self._leading = True
                log.info("leading", holder=lease.holder, term=lease.leader()[1])
                return
        if not self._standing_by:
            leader, term = lease.leader()
            log.info("standing_by", holder=lease.holder, leader=leader, term=term)
            await self._stand_by()

    async def _call(self, operation: Callable[[], bool]) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._thread, operation)

    async def _stand_by(self) -> None:
        assert self._follow is not None
        self._standing_by = True
        await self._follow()

    async def stop(self) -> None:
        """Ends the election task (no more transitions); the lease stays as it is."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def release(self) -> None:
        """Gives the lease up if held (blocking; a standby takes over within its renew
        interval) and ends the lease's thread. Raises UnavailableError when the database
        cannot be reached."""
        self._leading = False
        try:
            self._lease.release()
        finally:
            self._thread.shutdown(wait=False)


class LeaderOnlyAgents:
    """`NodeAgents` that start, drain and stop replicas only while `leadership` leads (a leader
    that wakes up deposed calls nothing: NotLeaderError, which the reconciler treats as a failed
    call); reads, warm-up probes and conformance runs pass through."""

    def __init__(self, agents: NodeAgents, leadership: Leadership) -> None:
        self._agents = agents
        self._leadership = leadership

    async def list_replicas(self, address: str) -> list[nodeagent_pb2.Replica]:
        return await self._agents.list_replicas(address)

    async def start_replica(
        self, address: str, replica_id: str, spec: nodeagent_pb2.ReplicaSpec
    ) -> nodeagent_pb2.Replica:
        self._leadership.require_leader()
        return await self._agents.start_replica(address, replica_id, spec)

    async def drain_replica(
        self, address: str, replica_id: str, grace_seconds: int
    ) -> nodeagent_pb2.Replica:
        self._leadership.require_leader()
        return await self._agents.drain_replica(address, replica_id, grace_seconds)

    async def stop_replica(
        self, address: str, replica_id: str, grace_seconds: int
    ) -> nodeagent_pb2.Replica:
        self._leadership.require_leader()
        return await self._agents.stop_replica(address, replica_id, grace_seconds)

    async def probe(
        self,
        address: str,
        replica_id: str,
        model: str,
        *,
        embed: bool = False,
        speech: bool = False,
    ) -> ProbeResult:
        return await self._agents.probe(address, replica_id, model, embed=embed, speech=speech)

    async def conformance(
        self, address: str, *, live_requests: int, timeout_seconds: float, seed: int
    ) -> replica_pb2.ConformanceReport:
        return await self._agents.conformance(
            address, live_requests=live_requests, timeout_seconds=timeout_seconds, seed=seed
        )

    async def close(self) -> None:
        await self._agents.close()


class RoutingTableRelay:
    """The routing table between the leader and the standbys: the leader stores every table its
    hub publishes (`publish_forever`, fenced: a deposed leader's table is refused); a standby
    reads the stored one every `interval_seconds` and publishes it to its own hub
    (`follow_forever`), so its `RoutingService` and Envoy's ADS serve what the leader serves."""

    def __init__(
        self,
        hub: RoutingHub,
        tables: SqlRoutingTables,
        lease: LeaderLease,
        *,
        clock: Clock,
        name: str = LEASE_NAME,
    ) -> None:
        self._hub = hub
        self._tables = tables
        self._lease = lease
        self._clock = clock
        self._name = name

    async def publish_forever(self, retry_seconds: float = 1.0) -> None:
        """Stores each table the hub publishes (the current one first) until cancelled; a
        failed write is retried with the hub's latest table every `retry_seconds`."""
        async for _table in self._hub.watch():
            while True:
                try:
                    await asyncio.to_thread(self._store, self._hub.table)
                    break
                except NotLeaderError:
                    break  # the lease loop stands this orchestrator by
                except Exception as exc:
                    log.warning("routing_table_store_failed", error=str(exc))
                    await asyncio.sleep(retry_seconds)

    def _store(self, table: pb.WatchRoutingTableResponse) -> None:
        self._tables.publish(
            self._name,
            table.version,
            table.SerializeToString(deterministic=True),
            self._lease.term(),
            self._clock.now(),
        )

    async def follow_once(self) -> bool:
        """Publishes the stored table to the hub when its version differs; True if it did."""
        version = await asyncio.to_thread(self._tables.version, self._name)
        if version is None or version == self._hub.table.version:
            return False
        stored = await asyncio.to_thread(self._tables.read, self._name)
        if stored is None:
            return False
        return await self._hub.publish(pb.WatchRoutingTableResponse.FromString(stored[1]))

    async def follow_forever(self, interval_seconds: float) -> None:
        """`follow_once` every `interval_seconds` until cancelled (errors are logged)."""
        while True:
            try:
                await self.follow_once()
            except Exception as exc:
                log.warning("routing_table_follow_failed", error=str(exc))
            await asyncio.sleep(interval_seconds)


class GrantsJournal:
    """The routing hub's grants journal (`RoutingHub(journal=...)`, hand-over in
    `inferplane.orchestrator.routing.shares`) on the lease store's database: each write is fenced
    by this orchestrator's term, and `adoptable` reads what the term just before it wrote."""

    def __init__(
        self, grants: SqlRouterGrants, lease: LeaderLease, *, clock: Clock, name: str = LEASE_NAME
    ) -> None:
        self._grants = grants
        self._lease = lease
        self._clock = clock
        self._name = name

    async def __call__(self, held: Grants) -> None:
        """Writes `held` under this leader's term (NotLeaderError: not the leader now)."""
        term = self._lease.term()
        await asyncio.to_thread(self._grants.save, self._name, held, term, self._clock.now())

    async def adoptable(self) -> Grants | None:
        """What the previous term's leader wrote last, when that term is the one just before
        this leader's (so every grant of it was written before it was shown); nothing (`{}`)
        for the database's first leader (term 1, nothing stored: no orchestrator granted
        before it); None otherwise (nothing stored after term 1, or a term in between that
        may have granted without writing)."""
        stored = await asyncio.to_thread(self._grants.load, self._name)
        term = self._lease.term()
        if stored is None:
            return {} if term == 1 else None
        if stored.term != term - 1:
            return None
        return stored.held

"""Admission control: a concurrency cap per replica and a fair queue per deployment.

A request takes a slot on one replica (`Slot`) before it is sent. When the deployment's policy
finds no replica that can take it (all at their cap), the request waits in the deployment's
queue for at most `queue_timeout_seconds`; past that it fails with RESOURCE_EXHAUSTED (HTTP
429 + Retry-After), never a 5xx and never extra load on an engine already full (which would
preempt running sequences). Every freed slot and every routing-table change re-runs the policy
for the head of the queue.

Who is served next (issue 18: one key at 10x its share must not delay everyone): weighted
fair queuing across flows (`fairqueue.FairQueue`), one flow per API key, requests without a
key forming one flow. Tiers are weights, not strict classes: a key's weight comes from its
tier (`features.TIER_WEIGHT`: priority 8, standard 1, unknown 0.5), and while flows compete
for slots each gets grants in proportion to its weight; a flow that is not already ahead of
its share (a key that was not waiting, or not over its share) is granted before every queued
request of a lower-weight flow, so a priority-tier request still overtakes queued standard
requests as before, but no tier, and no key, can starve the others. The queue's capacity is
shared the same way: a key holding more than its share of it is refused at once (429 +
Retry-After) and leaves room for the other keys; a newcomer is refused only when the whole
queue is full.

Shared caps (issue 20): when the table is the orchestrator's view for this router
(`RouteTable.lease_epoch`), each replica's cap here is this router's share of it, and nothing
is admitted unless the router holds a lease of that epoch (`set_lease`, kept by
`leases.CapLease`): without one, requests wait in the queue as if every replica were full.
`over_share` lists the replicas with more requests in flight than the share (after the share
shrank), which the lease keeper reports; `on_drained` is called when one of them fits again.
When the lease runs out unrenewed, or a table of a new epoch comes before its lease (an
orchestrator restart, a new leader, a standby's view), the router keeps admitting on the
shares of its last lease for the lease's `hold` (issue 31; the bound is the lease keeper's
module docstring): a new table's own shares apply once a lease of its epoch is granted.

Everything runs on the event loop thread; time comes from the injected clock and scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Iterable

from inferplane.router.adapter_affinity import AdapterAffinity
from inferplane.router.admission_views import AdmissionViews
from inferplane.router.breaker import CircuitBreaker
from inferplane.router.demand import DemandBook
from inferplane.router.fairqueue import FairQueue, Refusal, Ticket
from inferplane.router.features import RequestFeatures
from inferplane.router.heldover import ShareLease
from inferplane.router.kvfit import KV_CACHE_FULL, KvDemand, KvFit, Reservation, kv_cache_full
from inferplane.router.policies import PolicyRegistry, RoutingPolicy
from inferplane.router.refusals import (
    COLD_START,
    COLD_START_CODE,
    TIMEOUT,
    cold_start,
    overloaded,
)
from inferplane.router.replicas import ReplicaKey, ReplicaSet, ReplicaState
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable
from inferplane.router.slots import AdmissionSettings, LoopScheduler, Scheduler, Slot
from inferplane.runtime import ResourceExhaustedError, UnavailableError
from inferplane.runtime.time.clock import Clock

__all__ = [
    "COLD_START_CODE",
    "Admission",
    "AdmissionSettings",
    "LoopScheduler",
    "Scheduler",
    "Slot",
]


@dataclasses.dataclass(eq=False, slots=True)
class _Waiter:
    features: RequestFeatures
    exclude: frozenset[ReplicaKey]
    future: asyncio.Future[Slot]
    cold: bool = False  # held because the deployment had no ready replica (scale from zero)
    demand: KvDemand | None = None  # its predicted KV size (`kvfit`), None: slots only


@dataclasses.dataclass(slots=True)
class _Deployment:
    """Per-deployment state: its policy and queue (both live across table versions) and set."""

    policy: RoutingPolicy
    policy_name: str
    replicas: ReplicaSet
    queue: FairQueue[_Waiter]


class Admission(AdmissionViews):
    """Slots, queues and breakers for every deployment of the current routing table (what
    its queues and demand look like from outside: `AdmissionViews`)."""

    def __init__(
        self,
        registry: PolicyRegistry,
        settings: AdmissionSettings,
        clock: Clock,
        scheduler: Scheduler,
        kv_fit: KvFit | None = None,
        affinity: AdapterAffinity | None = None,
    ) -> None:
        self._registry = registry
        self._affinity = affinity  # LoRA adapter affinity (issue 29), None: the policy's choice
        self._kv = kv_fit  # admission by predicted KV fit (issue 29), None: slots only
        self._replica_keys: dict[str, list[ReplicaKey]] = {}  # replica id → keys (reports)
        self._settings = settings
        self.clock = clock
        self._scheduler = scheduler
        self._states: dict[ReplicaKey, ReplicaState] = {}
        self._deployments: dict[str, _Deployment] = {}
        self._table: RouteTable | None = None
        # 429s of the queue per (deployment, reason); read by the metrics thread (copied).
        self._refused: dict[tuple[str, str], int] = {}
        # Shared caps: this router's share per replica (None: caps not shared), its lease, the
        # time until which it may admit (inf without sharing), the replicas over their share.
        self._shares: dict[ReplicaKey, int] | None = None
        self._lease = ShareLease()  # and the shares it holds over (`heldover`)
        self._built: RouteTable | None = None  # what the replica sets follow
        self._admitting: dict[ReplicaKey, int] = {}  # its shares (`_built`'s)
        self._admit_until = math.inf
        self._over: set[ReplicaKey] = set()
        self.on_drained: Callable[[], None] | None = None
        # Demand (issue 29): requests received, waits, cold holds; `demand()` reads it.
        self._demand = DemandBook()
        # Called when a deployment at zero gets its first held request (renew at once).
        self.on_cold: Callable[[], None] | None = None

    @property
    def kv_fit(self) -> KvFit | None:
        """Admission by predicted KV fit (`kvfit`), None when off (slots only)."""
        return self._kv

    @property
    def queue_timeout_seconds(self) -> float:
        """The longest a request waits in a deployment's queue before its 429."""
        return self._settings.queue_timeout_seconds

    # -- routing table -----------------------------------------------------------------------

    def apply(self, table: RouteTable) -> None:
        """Makes `table` current: new replica sets for changed deployments, at once.

        A replica that left the table gets no new request from here on (its in-flight
        requests finish normally). Queued requests are re-examined against the new sets.

        Raises:
            ConfigError: a route names an unknown routing policy (the table is not applied).
        """
        if table is self._table:
            return
        previous, granted = self._table, self._lease.granted
        self._table = table
        self._lease.noted(table)
        try:
            self._build(self._lease.effective(table, self.clock.monotonic()))
        except BaseException:  # not applied: the previous table stays current
            self._table, self._lease.granted = previous, granted
            raise

    def _build(self, table: RouteTable) -> None:
        now = self.clock.monotonic()
        wanted: dict[str, ModelRoute] = {}
        for route in table.routes.values():
            wanted.setdefault(route.deployment_key, route)
        fresh: dict[str, _Deployment] = {}
        for name, route in wanted.items():
            old = self._deployments.get(name)
            policy_name = route.routing_policy or self._registry.default
            if old is not None and old.policy_name == policy_name:
                policy = old.policy
            else:
                policy = self._registry.create(policy_name)
            if old is not None and old.replicas.endpoints == route.endpoints:
                replicas = old.replicas
            else:
                replicas = ReplicaSet(
                    name,
                    route.endpoints,
                    [self._state(e.key) for e in route.endpoints],
                    self._settings.default_max_concurrency,
                    now,
                )
                if old is not None and old.replicas.keys == replicas.keys:
                    replicas.cache = old.replicas.cache  # e.g. the hash ring: same members
            queue = (
                old.queue
                if old is not None
                else FairQueue[_Waiter](self._settings.max_queue_per_deployment)
            )
            fresh[name] = _Deployment(policy, policy_name, replicas, queue)
        for name, old in self._deployments.items():
            new = fresh.get(name)
            if new is None or new.replicas is not old.replicas:
                old.replicas.detach()
            if new is None:
                for waiter in old.queue.drain():
                    if not waiter.future.done():
                        waiter.future.set_exception(
                            UnavailableError(
                                f"the deployment '{name}' left the routing table",
                                code="no_ready_replica",
                            )
                        )
        for deployment in fresh.values():
            deployment.replicas.attach()
        self._deployments = fresh
        self._built = table
        self._refused = {k: v for k, v in self._refused.items() if k[0] in fresh}
        self._demand.keep(fresh)
        live = {k for d in fresh.values() for k in d.replicas.keys}
        self._states = {k: s for k, s in self._states.items() if k in live or s.in_flight}
        self._replica_keys = {}
        for k in live:
            self._replica_keys.setdefault(k[1], []).append(k)
        if self._kv is not None:
            self._kv.forget(set(self._replica_keys))
        raw = self._table
        shares = self._shares = raw.shares() if raw is not None else None
        self._admitting = table.shares() or {}
        self._over = set()
        if shares is not None:  # over its share, or still running on a replica that left
            for k, s in self._states.items():
                share = shares.get(k, None if k in live else 0)
                if share is not None and s.in_flight > share:
                    self._over.add(k)
        self._admit_until = self._lease_until()
        for deployment in fresh.values():
            self._pump(deployment)

    # -- shared caps -------------------------------------------------------------------------

    @property
    def table(self) -> RouteTable | None:
        """The routing table applied last."""
        return self._table

    def set_lease(self, epoch: str, until: float, hold: float = 0.0) -> None:
        """This router may admit on the shares of tables of `epoch` until `until` (monotonic
        seconds), and on them or the last ones of `epoch` for `hold` seconds more while no
        lease of a newer table comes; queued requests are re-examined at once."""
        lease = self._lease
        lease.epoch, lease.until, lease.hold = epoch, until, hold
        table = self._table
        if table is not None and table.lease_epoch == epoch:
            lease.noted(table)
            if self._built is not table:  # it ran on held-over shares: the table's own now
                self._build(lease.effective(table, self.clock.monotonic()))
        self._admit_until = self._lease_until()
        if self.clock.monotonic() < self._admit_until:
            for deployment in self._deployments.values():
                self._pump(deployment)

    def _lease_until(self) -> float:
        return self._lease.admit_until(self._table, held_over=self._built is not self._table)

    def lease_valid(self) -> bool | None:
        """Whether this router may admit now (under its lease, or on its last lease's shares
        during the hold): None when caps are not shared."""
        if self._shares is None:
            return None
        return self.clock.monotonic() < self._admit_until

    def held_over_seconds(self) -> float | None:
        """How long this router has admitted on its last lease's shares without a lease of
        its table (the lease ran out unrenewed, or a new epoch's table has no lease yet),
        seconds; 0 when it holds one or admits nothing; None when caps are not shared."""
        table = self._table
        if self._shares is None or table is None:
            return None
        now = self.clock.monotonic()
        if now >= self._admit_until:
            return 0.0
        return self._lease.held_over_seconds(now, held_over=self._built is not table)

    def held_over(self) -> list[tuple[ReplicaKey, int]]:
        """While the table's epoch has no lease and the router admits on its last lease's
        shares: (replica, its share there or its requests in flight if more), for the
        renewal (`RenewRouterLeaseRequest.held`); else empty."""
        table = self._table
        if table is None or self._built is table or not self.lease_valid():
            return []
        out = dict(self._lease.granted)
        for key, state in self._states.items():
            if state.in_flight > out.get(key, 0):
                out[key] = state.in_flight
        return [(k, n) for k, n in sorted(out.items()) if n > 0]

    def share(self, key: ReplicaKey) -> int | None:
        """This router's share of the replica's cap it admits on (its last lease's while it
        holds them over; None when caps are not shared, or the replica has no cap to share)."""
        return None if self._shares is None else self._admitting.get(key)

    def over_share(self, *, release: bool = False) -> list[ReplicaKey]:
        """Replicas with more requests in flight from here than this router's share of them
        in the current table (or, with `release`, any request in flight)."""
        if release:
            return [k for k, s in self._states.items() if s.in_flight]
        return list(self._over)

    def _state(self, key: ReplicaKey) -> ReplicaState:
        state = self._states.get(key)
        if state is None:
            breaker = CircuitBreaker(
                self._settings.breaker_failures, self._settings.breaker_open_seconds
            )
            state = self._states[key] = ReplicaState(key, breaker)
        return state

    def deployments(self) -> list[str]:
        """The deployments of the current table (a copy: safe to read from another thread)."""
        return list(self._deployments)

    def replicas(self, deployment: str) -> ReplicaSet | None:
        """The current replica set of a deployment (for metrics and tests)."""
        d = self._deployments.get(deployment)
        return None if d is None else d.replicas

    # -- admission ---------------------------------------------------------------------------

    async def acquire(
        self,
        route: ModelRoute,
        features: RequestFeatures,
        *,
        exclude: Iterable[ReplicaKey] = (),
        timeout: float | None = None,
        demand: KvDemand | None = None,
    ) -> Slot:
        """A slot on a replica of `route`'s deployment chosen by its policy, waiting in the
        deployment's queue when all are full (fair share across `features.flow`, see the
        module docstring).

        Scale from zero (issue 29): when `route.scale_to_zero` and the deployment has no
        usable replica (none, or all draining or broken), the request is held in the same
        queue for up to `route.cold_start_budget` seconds (at most the setting
        `max_cold_start_budget_seconds`) instead of a 503, and the first
        such request calls `on_cold` (the lease keeper tells the orchestrator at once); a
        table bringing a ready replica grants the held requests in the queue's order.

        With `demand` (and a `KvFit`), the replica must also fit the request's predicted KV
        (`kvfit`: the policy's choice, else one of its next candidates); where none does it
        waits in the same queue.

        Raises:
            ResourceExhaustedError: still queued after the timeout (min of `timeout` and the
                queue timeout), the queue is full, or the request's flow holds its share of it
                already: HTTP 429 with Retry-After; `kv_cache_full` when it waited because its
                KV fitted no replica.
            InvalidArgumentError: `demand` exceeds every replica's whole KV cache (400
                `context_length_exceeded`).
            UnavailableError: no replica could ever take it (all draining, broken or already
                tried) and the route does not scale to zero: HTTP 503 `no_ready_replica`;
                held for a cold start and the deployment still has no usable replica when the
                budget ran out: 503 `deployment_cold_start` (`COLD_START_CODE`) with
                Retry-After.
        """
        deployment = self._deployments.get(route.deployment_key)
        if deployment is None:
            raise UnavailableError(
                f"no ready replica serves '{route.model}'", code="no_ready_replica"
            )
        deployment_key = route.deployment_key
        self._demand.received(deployment_key)
        excluded = frozenset(exclude)
        if self._kv is None:
            demand = None
        elif demand is not None:
            self._kv.check_size(route, deployment.replicas, demand)
        queue = deployment.queue
        if queue:  # a slot free now (a breaker's probe) goes to the fair head, not a newcomer
            self._pump(deployment)
        slot = None if queue else self._try(deployment, features, excluded, demand)
        if slot is not None:
            return slot
        cold = False
        if not self._could_serve(deployment.replicas, excluded):
            cold = route.scale_to_zero and not deployment.replicas.usable
            if not cold:
                raise UnavailableError(
                    f"no ready replica serves '{route.model}'", code="no_ready_replica"
                )
        refusal = queue.refusal(features.flow, features.weight)
        if refusal is not None:
            self._count(route.deployment_key, refusal.value)
            full = refusal is Refusal.QUEUE_FULL
            why = "the queue is full" if full else "the queue holds this caller's share already"
            raise self._overloaded(route.model, why)
        wait = self._cold_budget(route) if cold else self._settings.queue_timeout_seconds
        if timeout is not None:
            wait = max(0.0, min(wait, timeout))
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(features, excluded, future, cold, demand)
        ticket = queue.push(features.flow, features.weight, waiter)
        timer = self._scheduler.call_later(
            wait,
            lambda: self._expire(queue, ticket, waiter, deployment_key, route.model, wait),
        )
        first_cold = self._demand.wait(deployment_key, waiter, self.clock.monotonic(), cold=cold)
        if first_cold and self.on_cold is not None:
            self.on_cold()
        try:
            return await future
        except asyncio.CancelledError:
            # The caller went away; a slot granted in the same instant must not leak.
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()
            raise
        finally:
            timer.cancel()
            queue.discard(ticket)  # no-op once granted, expired or drained
            self._demand.left(deployment_key, waiter, cold=cold)

    def _try(
        self,
        deployment: _Deployment,
        features: RequestFeatures,
        exclude: frozenset[ReplicaKey],
        demand: KvDemand | None = None,
    ) -> Slot | None:
        replicas = deployment.replicas
        now = self.clock.monotonic()
        replicas.wake(now)
        if demand is not None:
            demand.refused = False  # set again below only when KV, not slots, kept it out
        if now >= self._admit_until:  # shared caps without a lease: admit nothing new
            return None
        if not replicas.free:  # all full: no policy needs to look (saturated queues, O(1))
            return None
        if not exclude:
            index = deployment.policy.choose(replicas, features)
        else:
            index = self._choose_excluding(deployment, features, exclude)
        if index is None:
            return None
        if self._affinity is not None and features.adapter:
            index = self._affinity.prefer(replicas, index, features, exclude)
        if demand is None or self._kv is None:
            return self._grant(replicas, index, features)
        chosen = index  # the policy's choice must fit, else one of its next candidates

        def alternatives(n: int) -> list[int]:
            return deployment.policy.fallbacks(replicas, features, chosen, n)

        placed = self._kv.place(replicas, chosen, alternatives, demand, exclude)
        if placed is None:
            return None
        reservation = self._kv.reserve(replicas.endpoints[placed].replica_id, demand)
        return self._grant(replicas, placed, features, reservation)

    def _choose_excluding(
        self, deployment: _Deployment, features: RequestFeatures, exclude: frozenset[ReplicaKey]
    ) -> int | None:
        # Hide the excluded replicas from the policy for this one decision (single thread).
        replicas = deployment.replicas
        hidden = [
            (i, replicas.scores[i]) for k in exclude if (i := replicas.index.get(k)) is not None
        ]
        for i, _ in hidden:
            replicas.scores[i] = math.inf
        try:
            return deployment.policy.choose(replicas, features)
        finally:
            for i, score in hidden:
                replicas.scores[i] = score

    def _grant(
        self,
        replicas: ReplicaSet,
        index: int,
        features: RequestFeatures,
        kv: Reservation | None = None,
    ) -> Slot:
        state = replicas.states[index]
        now = self.clock.monotonic()
        state.in_flight += 1
        state.queued_tokens += features.prompt_tokens
        state.breaker.on_start(now)
        state.changed(now)
        return Slot(replicas.endpoints[index], state, features.prompt_tokens, self, kv)

    @staticmethod
    def _could_serve(replicas: ReplicaSet, exclude: frozenset[ReplicaKey]) -> bool:
        # O(len(exclude)): the usable count less the usable replicas already tried.
        tried = sum(
            1
            for k in exclude
            if (i := replicas.index.get(k)) is not None and not replicas.blocked[i]
        )
        return replicas.usable > tried

    def slot_freed(self, state: ReplicaState) -> None:
        over, shares, key = self._over, self._shares, state.key
        if over and key in over and shares is not None and state.in_flight <= shares.get(key, 0):
            over.discard(key)  # drained to its share: the orchestrator may pass it on
            if self.on_drained is not None:
                self.on_drained()
        for replica_set, _ in state.owners:
            deployment = self._deployments.get(replica_set.deployment)
            if deployment is not None:
                self._pump(deployment)

    def _pump(self, deployment: _Deployment) -> None:
        queue = deployment.queue
        while (waiter := queue.head()) is not None:
            if waiter.future.done():  # cancelled; its task has not run its `finally` yet
                queue.drop()
                continue
            slot = self._try(deployment, waiter.features, waiter.exclude, waiter.demand)
            if slot is None:
                return
            queue.pop()
            waiter.future.set_result(slot)

    def _expire(
        self,
        queue: FairQueue[_Waiter],
        ticket: Ticket[_Waiter],
        waiter: _Waiter,
        deployment: str,
        model: str,
        waited: float,
    ) -> None:
        future = waiter.future
        if queue.discard(ticket) and not future.done():
            current = self._deployments.get(deployment)
            if waiter.demand is not None and waiter.demand.refused:  # slots were free: KV not
                self._count(deployment, KV_CACHE_FULL)
                future.set_exception(
                    kv_cache_full(model, waited, self._settings.retry_after_seconds)
                )
                return
            if waiter.cold and (current is None or not current.replicas.usable):
                self._count(deployment, COLD_START)
                future.set_exception(
                    cold_start(model, waited, self._settings.cold_start_retry_after_seconds)
                )
                return
            self._count(deployment, TIMEOUT)
            future.set_exception(
                self._overloaded(model, f"no replica freed up within {waited:g} s")
            )

    def _count(self, deployment: str, reason: str) -> None:
        key = (deployment, reason)
        self._refused[key] = self._refused.get(key, 0) + 1

    def _overloaded(self, model: str, why: str) -> ResourceExhaustedError:
        return overloaded(model, why, self._settings.retry_after_seconds)

    def fallbacks(
        self, route: ModelRoute, slot: Slot, features: RequestFeatures, n: int
    ) -> tuple[Endpoint, ...]:
        """Up to `n` endpoints of `route`'s deployment besides the slot's, best first in the
        deployment policy's order, for Envoy to try when the slot's replica fails before
        answering (the endpoint picker's list). Draining replicas and open breakers are left
        out; no slot is taken on them (a fallback serves only when the primary failed)."""
        deployment = self._deployments.get(route.deployment_key)
        if deployment is None or n <= 0:
            return ()
        replicas = deployment.replicas
        replicas.wake(self.clock.monotonic())
        chosen = replicas.index.get(slot.key)
        picked = deployment.policy.fallbacks(replicas, features, chosen, n)
        return tuple(replicas.endpoints[i] for i in picked)

    def engine_changed(self, replica_id: str) -> None:
        """A replica's engine reported (`EngineStates.put`): the deployments' largest KV cache
        is kept (`KvFit.observe`) and queued requests that wait for KV are re-examined in its
        deployments. O(1) when nothing waits there."""
        for key in self._replica_keys.get(replica_id, ()):
            state = self._states.get(key)
            for replica_set, _ in state.owners if state is not None else ():
                if self._kv is not None:
                    self._kv.observe(replica_set.deployment, replica_id)
                deployment = self._deployments.get(replica_set.deployment)
                if deployment is not None and deployment.queue:
                    self._pump(deployment)

    def observe(self, deployment: str, address: str, *, ok: bool) -> None:
        """A verdict on a replica that served a request, or failed to, without holding its
        slot (an endpoint picker's fallback, named by `address`): feeds its breaker.
        Unknown deployments or addresses are ignored (the table moved on)."""
        d = self._deployments.get(deployment)
        i = None if d is None else d.replicas.by_address.get(address)
        if d is None or i is None:
            return
        state = d.replicas.states[i]
        now = self.clock.monotonic()
        if ok:
            state.breaker.on_success()
        else:
            state.breaker.on_failure(now)
        state.changed(now)

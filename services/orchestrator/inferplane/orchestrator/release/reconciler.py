"""The reconcile loop: desired placements (the control plane) against what node-agents run,
converged with StartReplica / DrainReplica / StopReplica, with rolling releases.

Per desired replica (a "slot", `{deployment}-{ordinal}`), the *target* is the node-agent replica
`agent_replica_id(slot, goal revision)` on the slot's placement node. Every tick:

1. Observe: `ListReplicas` on every node that is not NotReady (per-node exponential backoff on
   failures, tenacity `wait_exponential`; the last good observation is kept meanwhile).
2. Per deployment and slot: a missing target is started — at once when the slot has nothing
   serving (creation, a lost node), else as a surge replica, at most `max_surge` slots at a time
   (`max_surge` 0: the old replica is retired first, at most `max_unavailable` at a time). A
   target that turns READY gets a warm-up request and, in a rollout with a gate set, the gate
   (`Gate` over `gate_window_seconds`); then it SERVES (enters the routing table) and every other
   replica of the slot is retired: marked draining in the table, `DrainReplica` after
   `propagation_seconds` (routers have seen the table by then), `StopReplica` when nothing is in
   flight or the grace period is over.
3. A failed warm-up or gate (or a new replica that FAILED) during a rollout records the revision
   as failed and rolls back: the goal becomes the serving revision again (its profile is kept
   for this), the new replicas are retired, old ones are restarted where they were already gone.
   The deployment holds there until its profile changes again.
4. The routing table (SERVING replicas observed READY, retiring ones as draining) is published.

Idempotent by construction (ids carry the revision; StartReplica is idempotent on the
node-agent). Restart-safe: managed replicas and releases are persisted before the calls that
act on them; a READY replica whose id and revision match its slot's goal is adopted as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

import structlog
from tenacity import RetryCallState, wait_exponential

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.control import ControlPlane, DeploymentStatus
from inferplane.orchestrator.fleet.model import Node, NodeCondition
from inferplane.orchestrator.placement.model import Placement
from inferplane.orchestrator.release.agents import NodeAgents
from inferplane.orchestrator.release.gate import Gate, GateTarget, gate_enabled, gate_verdict
from inferplane.orchestrator.release.spec import agent_replica_id, build_spec
from inferplane.orchestrator.release.store import ManagedReplica, Release, ReleaseStore, Stage
from inferplane.orchestrator.routing import RoutingHub, make_table
from inferplane.runtime.clock import Clock

log = structlog.get_logger("inferplane.orchestrator.reconcile")

S = nodeagent_pb2.Replica.State
_LIVE = (S.STATE_STARTING, S.STATE_READY, S.STATE_RESTARTING, S.STATE_DRAINING)


@dataclasses.dataclass(frozen=True, slots=True)
class ReconcileSettings:
    """Knobs of the loop, in seconds.

    interval_seconds: time between ticks when nothing wakes the loop.
    propagation_seconds: between marking a replica draining in the routing table and
        DrainReplica (routers must see the table before the replica refuses requests).
    warmup_attempts / warmup_retry_seconds: warm-up requests tried on a new READY replica.
    backoff_initial_seconds / backoff_max_seconds: per-node backoff after a failed call.
    observe_timeout_seconds: how long a tick waits for one node-agent's ListReplicas (all
        nodes are asked at once); one that has not answered by then is unreachable for this
        tick (backoff). A node whose network went silent answers nothing and resets nothing:
        without this bound it held the whole tick, and so the routing table, for the control
        calls' deadline (30 s), its replicas still listed after the node was NotReady
        (tests/multihost, issue 20).
    """

    interval_seconds: float = 1.0
    propagation_seconds: float = 1.0
    warmup_attempts: int = 3
    warmup_retry_seconds: float = 1.0
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    observe_timeout_seconds: float = 5.0


class NodeBackoff:
    """Per-node exponential backoff on the injected clock: after n consecutive failures a node
    is left alone for min(initial · 2^(n-1), max) seconds (tenacity `wait_exponential`)."""

    def __init__(self, initial_seconds: float, max_seconds: float) -> None:
        self._wait = wait_exponential(multiplier=initial_seconds, max=max_seconds)
        self._failures: dict[str, int] = {}
        self._until: dict[str, datetime] = {}

    def blocked(self, node: str, now: datetime) -> bool:
        until = self._until.get(node)
        return until is not None and now < until

    def failed(self, node: str, now: datetime) -> float:
        """Records a failure; returns the backoff in seconds."""
        failures = self._failures.get(node, 0) + 1
        self._failures[node] = failures
        state = RetryCallState(None, None, (), {})
        state.attempt_number = failures
        delay = float(self._wait(state))
        self._until[node] = now + timedelta(seconds=delay)
        return delay

    def succeeded(self, node: str) -> None:
        self._failures.pop(node, None)
        self._until.pop(node, None)


class Reconciler:
    """See the module docstring. One event loop; `wake()` may be called from any thread."""

    def __init__(
        self,
        control: ControlPlane,
        agents: NodeAgents,
        store: ReleaseStore,
        hub: RoutingHub,
        *,
        gate: Gate,
        clock: Clock,
        settings: ReconcileSettings | None = None,
    ) -> None:
        self._control = control
        self._agents = agents
        self._store = store
        self._hub = hub
        self._gate = gate
        self._clock = clock
        self._settings = settings or ReconcileSettings()
        self._backoff = NodeBackoff(
            self._settings.backoff_initial_seconds, self._settings.backoff_max_seconds
        )
        self._records: dict[tuple[str, str], ManagedReplica] = {}
        self._releases: dict[str, Release] = {}
        self._observed: dict[str, dict[str, nodeagent_pb2.Replica]] = {}
        self._reachable: set[str] = set()
        self._checks: dict[tuple[str, str], asyncio.Task[str]] = {}
        self._problems: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    def load(self) -> None:
        """Reads the managed replicas and releases (call once before the first tick)."""
        replicas, releases = self._store.load()
        self._records = {r.key: r for r in replicas}
        self._releases = {r.deployment_id: r for r in releases}

    async def run(self) -> None:
        """Ticks until cancelled; a failing tick is logged and retried on the next one."""
        self._loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._settings.interval_seconds)

    def wake(self) -> None:
        """Asks for a tick soon (thread-safe; the control plane calls it after every commit)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._wake.set)

    async def close(self) -> None:
        """Cancels warm-up and gate checks in progress."""
        for task in self._checks.values():
            task.cancel()
        for task in list(self._checks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._checks.clear()

    # ---- read models -------------------------------------------------------------------

    def managed(self) -> tuple[ManagedReplica, ...]:
        """The managed replicas, by (node, replica id)."""
        return tuple(self._records[k] for k in sorted(self._records))

    def release(self, deployment_id: str) -> Release:
        return self._releases.get(deployment_id) or Release(deployment_id)

    def status(self, deployment: Deployment, base: DeploymentStatus) -> DeploymentStatus:
        """The deployment's status with the release's view (a `ControlPlane` status provider).

        Phases: Available, Progressing (target_revision set during a rollout), RolledBack (the
        last rollout failed its warm-up or gate; message says why), Degraded, Unplaceable.
        """
        rel = self.release(deployment.deployment_id)
        mine = [r for r in self._records.values() if r.deployment_id == deployment.deployment_id]
        ready = sum(1 for r in mine if r.stage is Stage.SERVING and self._ready(r))
        target = deployment.revision
        current = rel.serving_revision or target
        updated = sum(
            1 for r in mine if r.stage is Stage.SERVING and r.revision == target and self._ready(r)
        )
        common = {"ready_replicas": ready, "current_revision": current}
        if not mine and deployment.deployment_id not in self._releases:
            return base  # nothing started yet: the placement view is all there is
        if base.phase == "Unplaceable":
            return dataclasses.replace(base, **common)
        if rel.failed_revision and rel.failed_revision == target:
            return DeploymentStatus(
                "RolledBack",
                f"revision {target} was rolled back: {rel.failure}; serving revision "
                f"{current} ({ready} of {deployment.replicas} replicas ready); change the "
                "profile to try again",
                **common,
            )
        if rel.serving_revision and rel.serving_revision != target:
            return DeploymentStatus(
                "Progressing",
                f"rolling out revision {target}: {updated} of {deployment.replicas} replicas "
                f"updated, {ready} ready",
                target_revision=target,
                **common,
            )
        if base.phase == "Degraded":
            return dataclasses.replace(base, **common)
        problem = self._problems.get(deployment.deployment_id)
        if ready >= deployment.replicas:
            return DeploymentStatus(
                "Available", f"{ready} of {deployment.replicas} replicas ready", **common
            )
        if problem:
            return DeploymentStatus("Degraded", problem, **common)
        placed = len(self._control.placements().of(deployment.deployment_id)[0])
        return DeploymentStatus(
            "Progressing",
            f"{placed} of {deployment.replicas} replicas placed, {ready} ready",
            **common,
        )

    # ---- the tick ----------------------------------------------------------------------

    async def reconcile_once(self) -> None:
        """One pass: observe, converge every deployment, progress retirements, publish."""
        now = self._clock.now()
        deployments = {d.deployment_id: d for d in self._control.deployments()}
        nodes = {n.name: n for n in self._control.nodes()}
        plan = self._control.placements()
        await self._observe(nodes, now)
        for deployment_id, deployment in sorted(deployments.items()):
            placements = tuple(p for p in plan.placements if p.deployment_id == deployment_id)
            await self._deployment(deployment, placements, nodes, now)
        for record in list(self._records.values()):
            if record.deployment_id not in deployments:
                await self._retire(record, now, nodes)
        for record in list(self._records.values()):
            await self._progress(record, now, nodes)
        for deployment_id in list(self._releases):
            if deployment_id not in deployments and not any(
                r.deployment_id == deployment_id for r in self._records.values()
            ):
                self._store.delete_release(deployment_id)
                del self._releases[deployment_id]
        await self._hub.publish(self.routing_table(deployments.values()))

    async def _observe(self, nodes: Mapping[str, Node], now: datetime) -> None:
        self._reachable = set()
        for name in list(self._observed):
            node = nodes.get(name)
            if node is None or node.condition is NodeCondition.NOT_READY:
                del self._observed[name]
        asked = [
            (name, node)
            for name, node in sorted(nodes.items())
            if node.condition is not NodeCondition.NOT_READY
            and node.address
            and not self._backoff.blocked(name, now)
        ]
        answers = await asyncio.gather(
            *(
                asyncio.wait_for(
                    self._agents.list_replicas(node.address),
                    self._settings.observe_timeout_seconds,
                )
                for _name, node in asked
            ),
            return_exceptions=True,
        )
        for (name, _node), answer in zip(asked, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer  # cancellation of the tick itself
                error = str(answer) or type(answer).__name__
                delay = self._backoff.failed(name, now)
                log.warning("node_agent_unreachable", node=name, error=error, retry_in=delay)
                continue
            self._backoff.succeeded(name)
            self._reachable.add(name)
            self._observed[name] = {r.name.removeprefix("replicas/"): r for r in answer}

    def _seen(self, record: ManagedReplica) -> nodeagent_pb2.Replica | None:
        return self._observed.get(record.node, {}).get(record.replica_id)

    def _ready(self, record: ManagedReplica) -> bool:
        seen = self._seen(record)
        return seen is not None and seen.state == S.STATE_READY

    def _gone(self, record: ManagedReplica) -> bool:
        """The node answered and does not run the replica (absent, STOPPED or FAILED)."""
        if record.node not in self._reachable:
            return False
        seen = self._seen(record)
        return seen is None or seen.state not in _LIVE

    # ---- one deployment ----------------------------------------------------------------

    def _goal(self, deployment: Deployment) -> tuple[str, DeploymentProfile, Release]:
        rel = self.release(deployment.deployment_id)
        if rel.failed_revision and rel.failed_revision != deployment.revision:
            rel = dataclasses.replace(rel, failed_revision="", failure="")  # a new profile
            self._put_release(rel)
        if (
            rel.failed_revision == deployment.revision
            and rel.serving_revision
            and rel.serving_profile is not None
        ):
            return rel.serving_revision, rel.serving_profile, rel
        return deployment.revision, deployment.profile, rel

    async def _deployment(
        self,
        deployment: Deployment,
        placements: Sequence[Placement],
        nodes: Mapping[str, Node],
        now: datetime,
    ) -> None:
        goal, profile, rel = self._goal(deployment)
        self._adopt(deployment, placements, goal, nodes)
        mine = [r for r in self._records.values() if r.deployment_id == deployment.deployment_id]
        slots = {p.replica_id: p for p in placements}
        for record in mine:
            if record.slot not in slots:
                await self._retire(record, now, nodes)
        targets: dict[str, ManagedReplica | None] = {}
        for slot, placement in slots.items():
            targets[slot] = self._records.get((placement.node, agent_replica_id(slot, goal)))
        strategy = deployment.rollout
        in_surge = sum(
            1
            for slot, t in targets.items()
            if t is not None and t.stage is Stage.STARTING and self._serving_others(slot, t)
        )
        unavailable = sum(
            1
            for slot, t in targets.items()
            if (t is None or t.stage is not Stage.SERVING) and not self._serving_others(slot, t)
        )
        complete = bool(slots) and len(slots) == deployment.replicas
        for slot, placement in sorted(slots.items()):
            target = targets[slot]
            others = self._serving_others(slot, target, deployment.deployment_id)
            if target is None:
                complete = False
                if not others:
                    await self._start(deployment, profile, goal, placement, nodes, now)
                elif strategy.max_surge > 0:
                    if in_surge < strategy.max_surge:
                        in_surge += 1
                        await self._start(deployment, profile, goal, placement, nodes, now)
                elif unavailable < strategy.max_unavailable:
                    # Break before make (no surge capacity): the old replica goes first; the
                    # new one starts once the slot has nothing serving.
                    unavailable += 1
                    for other in others:
                        await self._retire(other, now, nodes)
                continue
            if target.stage is Stage.STARTING:
                await self._check(deployment, target, rel, now, nodes)
                checked = self._records.get(target.key)
                if checked is None or checked.stage is not Stage.SERVING:
                    complete = False
                    continue
                target = checked
            if target.stage is Stage.SERVING:
                if self._gone(target):
                    log.warning("replica_lost", replica=target.replica_id, node=target.node)
                    self._delete(target)
                    complete = False
                    continue
                for other in self._slot_records(deployment.deployment_id, slot):
                    if other is not target and other.stage in (Stage.STARTING, Stage.SERVING):
                        await self._retire(other, now, nodes)
            else:
                complete = False  # retiring from an earlier goal: started again once gone
        if complete and (rel.serving_revision != goal or rel.serving_profile != profile):
            if rel.serving_revision != goal:
                log.info(
                    "release_complete",
                    deployment=deployment.deployment_id,
                    revision=goal,
                    previous=rel.serving_revision or None,
                )
            self._put_release(
                dataclasses.replace(rel, serving_revision=goal, serving_profile=profile)
            )
            self._problems.pop(deployment.deployment_id, None)

    def _slot_records(self, deployment_id: str, slot: str) -> list[ManagedReplica]:
        return sorted(
            (
                r
                for r in self._records.values()
                if r.deployment_id == deployment_id and r.slot == slot
            ),
            key=lambda r: r.key,
        )

    def _serving_others(
        self, slot: str, target: ManagedReplica | None, deployment_id: str | None = None
    ) -> list[ManagedReplica]:
        return [
            r
            for r in self._records.values()
            if r.slot == slot
            and (deployment_id is None or r.deployment_id == deployment_id)
            and r is not target
            and r.stage is Stage.SERVING
        ]

    def _adopt(
        self,
        deployment: Deployment,
        placements: Sequence[Placement],
        goal: str,
        nodes: Mapping[str, Node],
    ) -> None:
        """Takes over live replicas of this deployment that no record knows (a lost or fresh
        database): READY ones serve as they are, others are watched until READY. A record's
        `address` is its node-agent's (where drain and stop go); the replica process's own
        address, where requests go, is read from each observation."""
        ids = {
            agent_replica_id(p.replica_id, rev): p.replica_id
            for p in placements
            for rev in {goal, self.release(deployment.deployment_id).serving_revision}
            if rev
        }
        for node, replicas in self._observed.items():
            for replica_id, seen in replicas.items():
                if (
                    seen.spec.deployment != deployment.deployment_id
                    or seen.state not in _LIVE
                    or (node, replica_id) in self._records
                    or node not in nodes
                ):
                    continue
                record = ManagedReplica(
                    node=node,
                    replica_id=replica_id,
                    deployment_id=deployment.deployment_id,
                    slot=ids.get(replica_id, ""),
                    address=nodes[node].address,
                    revision=seen.spec.revision,
                    stage=Stage.SERVING if seen.state == S.STATE_READY else Stage.STARTING,
                    stage_since=self._clock.now(),
                    spec=seen.spec.SerializeToString(),
                )
                log.info("replica_adopted", replica=replica_id, node=node, stage=record.stage.value)
                self._put(record)

    async def _start(
        self,
        deployment: Deployment,
        profile: DeploymentProfile,
        revision: str,
        placement: Placement,
        nodes: Mapping[str, Node],
        now: datetime,
    ) -> None:
        node = nodes.get(placement.node)
        if node is None or placement.node not in self._reachable:
            return
        spec = build_spec(deployment, profile, revision, placement, node)
        record = ManagedReplica(
            node=node.name,
            replica_id=agent_replica_id(placement.replica_id, revision),
            deployment_id=deployment.deployment_id,
            slot=placement.replica_id,
            address=node.address,
            revision=revision,
            stage=Stage.STARTING,
            stage_since=now,
            spec=spec.SerializeToString(),
        )
        self._put(record)  # first: a crash after StartReplica leaves a record, not an orphan
        log.info(
            "replica_start",
            deployment=deployment.deployment_id,
            replica=record.replica_id,
            node=node.name,
            revision=revision,
        )
        await self._call(
            node.name, now, self._agents.start_replica(node.address, record.replica_id, spec)
        )

    async def _check(
        self,
        deployment: Deployment,
        target: ManagedReplica,
        rel: Release,
        now: datetime,
        nodes: Mapping[str, Node],
    ) -> None:
        """Moves a STARTING target to SERVING once READY and warmed up (and gated in a rollout);
        handles a replica that FAILED or whose check failed."""
        seen = self._seen(target)
        if seen is not None and seen.state == S.STATE_FAILED:
            await self._failed(
                deployment,
                target,
                rel,
                f"replica {target.replica_id} failed: {seen.last_error}",
                now,
                nodes,
            )
            return
        if self._gone(target):
            self._delete(target)  # the node-agent lost it (restart): started again next tick
            return
        if seen is None or seen.state != S.STATE_READY:
            return
        task = self._checks.get(target.key)
        if task is None:
            rollout = bool(rel.serving_revision) and rel.serving_revision != target.revision
            gated = rollout and gate_enabled(deployment.rollout)
            task = asyncio.create_task(
                self._warm_and_gate(
                    deployment, target, seen.inference_address or target.address, gated
                )
            )
            task.add_done_callback(lambda _t: self._wake.set())
            self._checks[target.key] = task
            return
        if not task.done():
            return
        del self._checks[target.key]
        try:
            verdict = task.result()
        except Exception as exc:  # a bug or an unexpected error in a gate source
            verdict = f"check error: {exc!r}"
        if verdict:
            await self._failed(deployment, target, rel, verdict, now, nodes)
            return
        self._put(dataclasses.replace(target, stage=Stage.SERVING, stage_since=now))
        self._problems.pop(deployment.deployment_id, None)
        log.info("replica_serving", replica=target.replica_id, node=target.node)

    async def _warm_and_gate(
        self, deployment: Deployment, target: ManagedReplica, address: str, gated: bool
    ) -> str:
        """ "" when the replica passed, else why not."""
        error = ""
        for attempt in range(self._settings.warmup_attempts):
            result = await self._agents.probe(
                address,
                target.replica_id,
                deployment.deployment_id,
                embed=deployment.profile.embeds,
                speech=deployment.profile.transcribes,
            )
            if result.ok:
                error = ""
                break
            error = result.error
            if attempt + 1 < self._settings.warmup_attempts:
                await asyncio.sleep(self._settings.warmup_retry_seconds)
        if error:
            return f"warm-up request failed on {target.replica_id}: {error}"
        if not gated:
            return ""
        strategy = deployment.rollout
        reading = await self._gate.measure(
            GateTarget(
                deployment.deployment_id,
                target.replica_id,
                address,
                deployment.deployment_id,
                embed=deployment.profile.embeds,
                speech=deployment.profile.transcribes,
            ),
            float(strategy.gate_window_seconds),
        )
        verdict = gate_verdict(strategy, reading)
        log.info(
            "gate_measured",
            replica=target.replica_id,
            requests=reading.requests,
            error_rate=reading.error_rate,
            ttft_p99_seconds=reading.ttft_p99_seconds,
            passed=not verdict,
        )
        return f"gate failed on {target.replica_id}: {verdict}" if verdict else ""

    async def _failed(
        self,
        deployment: Deployment,
        target: ManagedReplica,
        rel: Release,
        reason: str,
        now: datetime,
        nodes: Mapping[str, Node],
    ) -> None:
        await self._retire(target, now, nodes)
        rollout = (
            bool(rel.serving_revision)
            and rel.serving_revision != target.revision
            and rel.serving_profile is not None
        )
        if rollout:
            log.warning(
                "rollout_rolled_back",
                deployment=deployment.deployment_id,
                failed_revision=target.revision,
                serving_revision=rel.serving_revision,
                reason=reason,
            )
            self._put_release(
                dataclasses.replace(rel, failed_revision=target.revision, failure=reason)
            )
        else:
            log.warning("replica_start_failed", deployment=deployment.deployment_id, reason=reason)
            self._problems[deployment.deployment_id] = reason
            self._backoff.failed(target.node, now)

    # ---- retirement --------------------------------------------------------------------

    async def _retire(
        self, record: ManagedReplica, now: datetime, nodes: Mapping[str, Node]
    ) -> None:
        """Takes a replica out of service: a SERVING one is marked draining in the routing table
        first; one that never served is stopped at once."""
        task = self._checks.pop(record.key, None)
        if task is not None:
            task.cancel()
        if record.stage is Stage.SERVING:
            self._put(dataclasses.replace(record, stage=Stage.RETIRING, stage_since=now))
            log.info("replica_retiring", replica=record.replica_id, node=record.node)
        elif record.stage is Stage.STARTING:
            await self._stop(record, now, nodes, grace=0)

    async def _progress(
        self, record: ManagedReplica, now: datetime, nodes: Mapping[str, Node]
    ) -> None:
        if record.stage not in (Stage.RETIRING, Stage.DRAINING):
            return
        if self._gone(record):
            self._delete(record)
            return
        if record.node not in self._reachable:
            return
        deployment = next(
            (d for d in self._control.deployments() if d.deployment_id == record.deployment_id),
            None,
        )
        grace = deployment.rollout.drain_grace_period_seconds if deployment else 30
        elapsed = (now - record.stage_since).total_seconds()
        if record.stage is Stage.RETIRING:
            if elapsed < self._settings.propagation_seconds:
                return
            answer = await self._call(
                record.node,
                now,
                self._agents.drain_replica(record.address, record.replica_id, grace),
            )
            if answer is not None:
                self._put(dataclasses.replace(record, stage=Stage.DRAINING, stage_since=now))
                log.info("replica_draining", replica=record.replica_id, grace_seconds=grace)
            return
        seen = self._seen(record)
        if (seen is not None and seen.in_flight_requests == 0) or elapsed >= grace:
            await self._stop(record, now, nodes, grace=0)

    async def _stop(
        self, record: ManagedReplica, now: datetime, nodes: Mapping[str, Node], *, grace: int
    ) -> None:
        answer = await self._call(
            record.node, now, self._agents.stop_replica(record.address, record.replica_id, grace)
        )
        if answer is not None or self._gone(record):
            log.info("replica_stopped", replica=record.replica_id, node=record.node)
            self._delete(record)

    # ---- plumbing ----------------------------------------------------------------------

    async def _call(self, node: str, now: datetime, call):  # type: ignore[no-untyped-def]
        """Awaits a node-agent call; on failure logs, backs the node off, returns None."""
        if self._backoff.blocked(node, now):
            call.close()
            return None
        try:
            return await call
        except Exception as exc:
            delay = self._backoff.failed(node, now)
            log.warning("node_agent_call_failed", node=node, error=str(exc), retry_in=delay)
            return None

    def _put(self, record: ManagedReplica) -> None:
        self._store.put_replica(record)
        self._records[record.key] = record

    def _delete(self, record: ManagedReplica) -> None:
        self._store.delete_replica(record.node, record.replica_id)
        self._records.pop(record.key, None)
        task = self._checks.pop(record.key, None)
        if task is not None:
            task.cancel()

    def _put_release(self, release: Release) -> None:
        self._store.put_release(release)
        self._releases[release.deployment_id] = release

    # ---- routing table -----------------------------------------------------------------

    def routing_table(
        self, deployments: Sequence[Deployment] | object
    ) -> pb.WatchRoutingTableResponse:
        """Model (deployment id and aliases) → SERVING replicas observed READY, and retiring
        ones marked draining; versioned by content."""
        routes = []
        for deployment in deployments:
            endpoints = []
            for record in sorted(self._records.values(), key=lambda r: r.key):
                if record.deployment_id != deployment.deployment_id:
                    continue
                seen = self._seen(record)
                if seen is None:
                    continue
                if record.stage is Stage.SERVING and seen.state == S.STATE_READY:
                    draining = False
                elif record.stage in (Stage.RETIRING, Stage.DRAINING) and seen.state in (
                    S.STATE_READY,
                    S.STATE_DRAINING,
                ):
                    draining = True
                else:
                    continue
                endpoints.append(
                    pb.RouteEndpoint(
                        replica_id=record.replica_id,
                        address=seen.inference_address or record.address,
                        weight=1.0,
                        draining=draining,
                        max_concurrency=seen.spec.max_num_seqs,
                        node=record.node,
                        revision=record.revision,
                        metrics_url=seen.metrics_url,
                    )
                )
            created = deployment.create_time
            for model in (deployment.deployment_id, *deployment.aliases):
                routes.append(
                    pb.ModelRoute(
                        model=model,
                        deployment=deployment.deployment_id,
                        routing_policy=deployment.routing_policy,
                        endpoints=endpoints,
                        max_model_len=deployment.profile.max_model_len,
                        created=int(created.timestamp()) if created else 0,
                        owned_by=deployment.owned_by,
                    )
                )
        return make_table(routes)

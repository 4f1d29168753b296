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
   flight or the grace period is over. A rollout of a new revision goes through the release
   pipeline first (release/pipeline.py): qualifying gates on one candidate replica that takes
   no live traffic (conformance, performance), then an optional canary share of live traffic,
   then the rolling replacement above.
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
from typing import Any

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.orchestrator.control import ControlPlane
from inferplane.orchestrator.release.agents import NodeAgents
from inferplane.orchestrator.release.gate import Gate, LatencyReader, TelemetryLatency
from inferplane.orchestrator.release.gates import Matrix, PerformanceGate
from inferplane.orchestrator.release.observe import NodeBackoff, ReconcileSettings
from inferplane.orchestrator.release.pipeline import Qualification
from inferplane.orchestrator.release.rollout import Rollout
from inferplane.orchestrator.release.store import ManagedReplica, Release, ReleaseStore
from inferplane.orchestrator.routing import RoutingHub
from inferplane.orchestrator.ticker import Ticker
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.orchestrator.reconcile")


class Reconciler(Rollout):
    """See the module docstring. One event loop; `wake()` may be called from any thread.

    `performance`: the performance gate's runner (None: a profile asking for the gate fails
    its release); `latency`: telemetry by revision, the canary's judge (None: a canary cannot
    be judged and rolls back); `matrix`: the compatibility matrix (None: nothing recorded).

    The loop's parts are its bases: `Rollout` (release/rollout.py: one deployment's
    convergence, warm-up, gate, rollback, status), `Pipeline` (release/pipeline.py: the
    release's qualifying gates, canary, matrix records), `ReplicaOperations` (release/replicas.py:
    start, adopt, retire, drain, stop, records, routing table) and `Observation`
    (release/observe.py: what node-agents run, backoff).
    """

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
        performance: PerformanceGate | None = None,
        latency: LatencyReader | None = None,
        matrix: Matrix | None = None,
    ) -> None:
        self._control = control
        self._agents = agents
        self._store = store
        self._hub = hub
        self._gate = gate
        self._performance = performance
        self._latency = latency
        self._matrix = matrix
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
        self._qualifying: dict[tuple[str, str], asyncio.Task[Qualification]] = {}
        self._problems: dict[str, str] = {}
        self._ticker = Ticker(
            self.reconcile_once, self._settings.interval_seconds, "reconcile_failed", log
        )
        self._wake = self._ticker.event

    def load(self) -> None:
        """Reads the managed replicas and releases (call once before the first tick)."""
        replicas, releases = self._store.load()
        self._records = {r.key: r for r in replicas}
        self._releases = {r.deployment_id: r for r in releases}

    async def run(self) -> None:
        """Ticks until cancelled; a failing tick is logged and retried on the next one."""
        await self._ticker.run()

    def wake(self) -> None:
        """Asks for a tick soon (thread-safe; the control plane calls it after every commit)."""
        self._ticker.wake()

    async def close(self) -> None:
        """Cancels warm-up, gate and qualifying checks in progress (a restarted loop runs a
        QUALIFYING replica's gates again)."""
        tasks: list[asyncio.Task[Any]] = [*self._checks.values(), *self._qualifying.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._checks.clear()
        self._qualifying.clear()
        if isinstance(self._latency, TelemetryLatency):
            await self._latency.close()

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

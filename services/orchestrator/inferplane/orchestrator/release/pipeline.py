"""The release pipeline inside the reconcile loop (issue 30): a rollout of a new revision goes
Qualifying → (Canary →) Promoted, or RolledBack at the first gate that fails.

- Qualifying: one candidate replica (the first slot's) starts on top of the stable ones. Once
  READY and warmed up (and through the probe gate, release/gate.py, when the strategy sets
  one) it is QUALIFYING: in the routing table, its revision with no share (the route's
  `revision_shares` is [stable 100]), so only requests pinned to its revision reach it. Then
  the gates run on it (release/gates.py): conformance, then performance when asked for.
- Canary (`rollout.canary_percent` > 0): the qualified candidate serves; `canary_replicas(p,
  replicas)` candidate replicas run on top of the stable ones and the route's shares are
  [stable 100-p, candidate p]. The decision (release/canary.py) comes after the window.
- Promoted: shares removed; the rest rolls as a plain rolling release (surge / unavailable).
  Without a canary the qualified candidate goes there at once.
- RolledBack: the candidate revision is recorded as failed (`Release.failed_revision`), the goal
  returns to the serving revision and the candidate replicas are retired (drained when they
  served); the verdict is in `DeploymentStatus.release` and the phase is RolledBack.

Each decision is recorded in the compatibility matrix (`Matrix`) with the gates' verdicts, for
the candidate's `ReplicaArtifacts` (the node-agent's report of the replica, else the conformance
report's). A deployment's first revision (nothing serving yet) has no pipeline: nothing to
compare with or roll back to.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

import structlog

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.fleet.model import Node
from inferplane.orchestrator.release import canary, gates, progress
from inferplane.orchestrator.release.agents import NodeAgents
from inferplane.orchestrator.release.gate import LatencyReader
from inferplane.orchestrator.release.observe import S
from inferplane.orchestrator.release.progress import Progress
from inferplane.orchestrator.release.replicas import ReplicaOperations
from inferplane.orchestrator.release.store import ManagedReplica, Release, Stage
from inferplane.orchestrator.routing import revision_shares

log = structlog.get_logger("inferplane.orchestrator.reconcile")

#: What a qualifying task returns: the gates' verdicts and the candidate's artifacts.
Qualification = tuple[tuple[pb.GateVerdict, ...], replica_pb2.ReplicaArtifacts | None]


class Pipeline(ReplicaOperations):
    """The release pipeline's part of the loop (a base of `Rollout`; `Reconciler` sets the
    attributes: `_performance`, `_latency` and `_matrix` may be None)."""

    _agents: NodeAgents
    _performance: gates.PerformanceGate | None
    _latency: LatencyReader | None
    _matrix: gates.Matrix | None
    _qualifying: dict[tuple[str, str], asyncio.Task[Qualification]]
    _problems: dict[str, str]
    _wake: asyncio.Event

    def _progress_for(self, deployment: Deployment, goal: str, rel: Release) -> Progress | None:
        """The pipeline state of a rollout to `goal` (started here when new); None when `goal`
        is no rollout (the first revision, or the serving one: done or rolled back)."""
        if not rel.serving_revision or goal == rel.serving_revision:
            return None
        prog = rel.progress
        if prog is None or prog.candidate_revision != goal:
            prog = Progress(
                candidate_revision=goal,
                canary_percent=deployment.rollout.canary_percent,
                message=f"qualifying revision {goal} on a replica that takes no live traffic",
            )
            self._put_release(dataclasses.replace(rel, progress=prog))
            log.info(
                "release_qualifying",
                deployment=deployment.deployment_id,
                revision=goal,
                serving=rel.serving_revision,
            )
        return prog

    @staticmethod
    def _held(prog: Progress | None) -> bool:
        """Qualifying or canary: the stable replicas all stay; candidates run on top."""
        return prog is not None and not prog.ended

    def _pipeline_slots(
        self, deployment: Deployment, prog: Progress | None, slots: Sequence[str]
    ) -> set[str]:
        """The slots whose candidate may run now: the first while qualifying, the first
        `canary_replicas` during the canary, all otherwise."""
        ordered = sorted(slots)
        if prog is None or prog.ended:
            return set(ordered)
        if prog.stage == progress.QUALIFYING:
            return set(ordered[:1])
        return set(ordered[: canary.canary_replicas(prog.canary_percent, deployment.replicas)])

    def _revision_shares(self, deployment: Deployment) -> list[pb.RevisionShare]:
        rel = self.release(deployment.deployment_id)
        prog = rel.progress
        if (
            prog is None
            or prog.ended
            or not rel.serving_revision
            or prog.candidate_revision != deployment.revision
        ):
            return []
        share = prog.canary_percent if prog.stage == progress.CANARY else 0
        return revision_shares(rel.serving_revision, prog.candidate_revision, share)

    def _needs_qualifying(self, target: ManagedReplica) -> bool:
        prog = self.release(target.deployment_id).progress
        return (
            prog is not None
            and prog.stage == progress.QUALIFYING
            and prog.candidate_revision == target.revision
        )

    async def _qualify(
        self,
        deployment: Deployment,
        profile: DeploymentProfile,
        target: ManagedReplica,
        now: datetime,
        nodes: Mapping[str, Node],
    ) -> None:
        """Runs the qualifying gates on a QUALIFYING target (a task), then serves it or rolls
        the release back."""
        seen = self._seen(target)
        if self._gone(target) or (seen is not None and seen.state == S.STATE_FAILED):
            reason = f"replica {target.replica_id} was lost while qualifying"
            if seen is not None and seen.last_error:
                reason += f": {seen.last_error}"
            await self._fail_release(deployment, target, reason, now, nodes)
            return
        task = self._qualifying.get(target.key)
        if task is None:
            if seen is None:
                return
            rel = self.release(deployment.deployment_id)
            address = seen.inference_address or target.address
            artifacts = seen.artifacts if seen.HasField("artifacts") else None
            task = asyncio.create_task(
                self._run_gates(deployment, profile, target, address, rel, artifacts)
            )
            task.add_done_callback(lambda _t: self._wake.set())
            self._qualifying[target.key] = task
            return
        if not task.done():
            return
        del self._qualifying[target.key]
        try:
            verdicts, artifacts = task.result()
        except Exception as exc:  # a bug in a gate: the release stops
            verdicts = (
                gates.verdict(
                    "qualifying",
                    progress.ERROR,
                    f"qualifying gates raised {exc!r}",
                    revision=target.revision,
                    seconds=0.0,
                    now=now,
                ),
            )
            artifacts = None
        rel = self.release(deployment.deployment_id)
        prog = rel.progress or Progress(target.revision)
        prog = dataclasses.replace(
            prog, verdicts=(*prog.verdicts, *verdicts), artifacts=artifacts or prog.artifacts
        )
        failed = next((v for v in verdicts if v.result != progress.PASSED), None)
        if failed is not None:
            self._put_release(dataclasses.replace(rel, progress=prog))
            await self._fail_release(
                deployment,
                target,
                f"{failed.gate} gate {failed.result}: "
                + failed.reason.removeprefix(f"{failed.gate} failed: "),
                now,
                nodes,
            )
            return
        if prog.canary_percent > 0:
            prog = dataclasses.replace(
                prog,
                stage=progress.CANARY,
                canary_since=now,
                message=(
                    f"canary: revision {target.revision} serves {prog.canary_percent}% of live "
                    f"traffic beside {rel.serving_revision}; decision after "
                    f"{deployment.rollout.effective_canary_window_seconds} s"
                ),
            )
        else:
            prog = self._promoted(prog, "qualified: the rest rolls out")
        self._put_release(dataclasses.replace(rel, progress=prog))
        if prog.stage == progress.PROMOTED:
            self._record(deployment, prog, gates.QUALIFIED)
        self._put(dataclasses.replace(target, stage=Stage.SERVING, stage_since=now))
        log.info(
            "release_qualified",
            deployment=deployment.deployment_id,
            revision=target.revision,
            stage=prog.stage,
        )

    async def _run_gates(
        self,
        deployment: Deployment,
        profile: DeploymentProfile,
        target: ManagedReplica,
        address: str,
        rel: Release,
        artifacts: replica_pb2.ReplicaArtifacts | None,
    ) -> Qualification:
        """The gates on the candidate at `address` (the replica process), in order, stopping
        at the first that does not pass; returns their verdicts and the candidate's artifacts
        (the node-agent's report, else the conformance report's)."""
        wanted = gates.release_gates(profile)
        verdicts: list[pb.GateVerdict] = []
        if gates.conformance_on(wanted):
            known = gates.already_qualified(self._matrix, artifacts)
            if known is not None:
                verdicts.append(
                    gates.verdict(
                        gates.CONFORMANCE,
                        progress.PASSED,
                        "skipped: this combination (weights, chat template, parsers, engine "
                        f"{artifacts.engine_version if artifacts else ''}) is already qualified "
                        f"in the compatibility matrix (revision {known.revision} of "
                        f"{known.deployment})",
                        revision=target.revision,
                        seconds=0.0,
                        now=self._clock.now(),
                    )
                )
            else:
                verdict, report = await gates.run_conformance(
                    self._agents,
                    address,
                    wanted,
                    revision=target.revision,
                    now=self._clock.now(),
                )
                verdicts.append(verdict)
                if report is not None and report.HasField("artifacts") and artifacts is None:
                    artifacts = report.artifacts
                if verdict.result != progress.PASSED:
                    return tuple(verdicts), artifacts
        if wanted.performance:
            verdicts.append(
                await gates.run_performance(
                    self._performance,
                    deployment.deployment_id,
                    deployment.deployment_id,
                    target.revision,
                    rel.serving_revision,
                    wanted,
                    now=self._clock.now(),
                )
            )
        return tuple(verdicts), artifacts

    async def _canary_step(self, deployment: Deployment, now: datetime) -> None:
        """During the canary, after its window: promote, extend or roll back."""
        rel = self.release(deployment.deployment_id)
        prog = rel.progress
        if (
            prog is None
            or prog.stage != progress.CANARY
            or prog.candidate_revision != deployment.revision
            or prog.canary_since is None
        ):
            return
        strategy = deployment.rollout
        window = strategy.effective_canary_window_seconds
        if now < prog.canary_since + timedelta(seconds=window * (1 + prog.extensions)):
            return
        elapsed = (now - prog.canary_since).total_seconds()
        if self._latency is None:
            decision = canary.CanaryDecision(
                canary.ROLL_BACK,
                "canary could not be judged: no telemetry configured (the orchestrator's "
                "telemetry address)",
                {},
            )
        else:
            candidate_reading, stable_reading = await asyncio.gather(
                self._latency.read(
                    deployment.deployment_id, elapsed, revision=prog.candidate_revision
                ),
                self._latency.read(
                    deployment.deployment_id, elapsed, revision=rel.serving_revision
                ),
            )
            decision = canary.decide(
                strategy,
                candidate_reading,
                stable_reading,
                extensions=prog.extensions,
                window_seconds=elapsed,
            )
        log.info(
            "canary_decision",
            deployment=deployment.deployment_id,
            revision=prog.candidate_revision,
            action=decision.action,
            reason=decision.reason,
        )
        if decision.action == canary.EXTEND:
            prog = dataclasses.replace(
                prog, extensions=prog.extensions + 1, message=decision.reason
            )
            self._put_release(dataclasses.replace(rel, progress=prog))
            return
        result = progress.PASSED if decision.action == canary.PROMOTE else progress.FAILED
        prog = prog.with_verdict(
            gates.verdict(
                gates.CANARY,
                result,
                decision.reason,
                revision=prog.candidate_revision,
                seconds=elapsed,
                now=now,
                measurements=decision.measurements,
            )
        )
        if decision.action == canary.PROMOTE:
            prog = self._promoted(prog, decision.reason)
            self._put_release(dataclasses.replace(rel, progress=prog))
            self._record(deployment, prog, gates.QUALIFIED)
            return
        reason = f"canary gate failed: {decision.reason}"
        prog = dataclasses.replace(prog, stage=progress.ROLLED_BACK, message=reason)
        self._put_release(
            dataclasses.replace(
                rel, progress=prog, failed_revision=prog.candidate_revision, failure=reason
            )
        )
        self._record(deployment, prog, gates.NOT_QUALIFIED)
        log.warning(
            "rollout_rolled_back",
            deployment=deployment.deployment_id,
            failed_revision=prog.candidate_revision,
            serving_revision=rel.serving_revision,
            reason=reason,
        )

    @staticmethod
    def _promoted(prog: Progress, why: str) -> Progress:
        return dataclasses.replace(
            prog, stage=progress.PROMOTED, canary_since=None, message=f"promoted: {why}"
        )

    async def _fail_release(
        self,
        deployment: Deployment,
        target: ManagedReplica,
        reason: str,
        now: datetime,
        nodes: Mapping[str, Node],
    ) -> None:
        await self._failed(
            deployment, target, self.release(deployment.deployment_id), reason, now, nodes
        )

    async def _failed(
        self,
        deployment: Deployment,
        target: ManagedReplica,
        rel: Release,
        reason: str,
        now: datetime,
        nodes: Mapping[str, Node],
    ) -> None:
        """A target failed (its replica FAILED, its warm-up, or a gate): it is retired; in a
        rollout the revision is recorded as failed (the goal returns to the serving revision)
        and the pipeline says RolledBack; else the deployment is Degraded and the node backs
        off. `rel` is read again (a check that ran during the tick may have moved it)."""
        rel = self.release(rel.deployment_id)
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
            prog = rel.progress
            if prog is not None and prog.candidate_revision == target.revision and not prog.ended:
                prog = dataclasses.replace(prog, stage=progress.ROLLED_BACK, message=reason)
                self._record(deployment, prog, gates.NOT_QUALIFIED)
            self._put_release(
                dataclasses.replace(
                    rel, failed_revision=target.revision, failure=reason, progress=prog
                )
            )
        else:
            log.warning("replica_start_failed", deployment=deployment.deployment_id, reason=reason)
            self._problems[deployment.deployment_id] = reason
            self._backoff.failed(target.node, now)

    def _record(self, deployment: Deployment, prog: Progress, verdict: str) -> None:
        """The decision in the compatibility matrix (nothing without a matrix or artifacts)."""
        if self._matrix is None or not prog.verdicts:
            return
        if prog.artifacts is None:
            log.warning(
                "compatibility_not_recorded",
                deployment=deployment.deployment_id,
                revision=prog.candidate_revision,
                reason="the candidate's artifacts are unknown",
            )
            return
        entry = pb.CompatibilityEntry(
            artifacts=prog.artifacts,
            verdict=gates.combination_verdict(
                self._matrix, prog.artifacts, list(prog.verdicts), verdict
            ),
            gates=list(prog.verdicts),
            deployment=deployment.deployment_id,
            revision=prog.candidate_revision,
        )
        entry.update_time.FromDatetime(self._clock.now())
        try:
            self._matrix.record(entry)
        except Exception as exc:  # the matrix is a record: the release goes on without it
            log.warning(
                "compatibility_record_failed",
                deployment=deployment.deployment_id,
                revision=prog.candidate_revision,
                error=repr(exc),
            )

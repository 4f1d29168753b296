"""The reconcile loop's rollouts: per deployment and slot, what to start (at once, as a surge
replica, or after the old one retires), warm-up and gate of a READY target, rollback to the
serving revision when either fails, and the deployment status the release shows.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime

import structlog

from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.service import DeploymentStatus
from inferplane.orchestrator.fleet.model import Node
from inferplane.orchestrator.placement.model import Placement
from inferplane.orchestrator.release.gate import Gate, GateTarget, gate_enabled, gate_verdict
from inferplane.orchestrator.release.observe import S
from inferplane.orchestrator.release.pipeline import Pipeline
from inferplane.orchestrator.release.spec import agent_replica_id
from inferplane.orchestrator.release.store import ManagedReplica, Release, Stage

log = structlog.get_logger("inferplane.orchestrator.reconcile")

#: Stages of a replica that is not on its way out.
_ACTIVE = (Stage.STARTING, Stage.QUALIFYING, Stage.SERVING)


class Rollout(Pipeline):
    """Converges one deployment at a time (a base of `Reconciler`, which sets the
    attributes)."""

    _gate: Gate
    _problems: dict[str, str]
    _wake: asyncio.Event

    def status(self, deployment: Deployment, base: DeploymentStatus) -> DeploymentStatus:
        """The deployment's status with the release's view (a `ControlPlane` status provider).

        Phases: Available, Progressing (target_revision set during a rollout), RolledBack (the
        last rollout failed its warm-up or a gate; message says why), Degraded, Unplaceable.
        `release`: the release pipeline's stage and verdicts (the last release's once ended).
        """
        status = self._phase(deployment, base)
        rel = self.release(deployment.deployment_id)
        if rel.progress is None:
            return status
        return dataclasses.replace(status, release=rel.progress.to_proto())

    def _phase(self, deployment: Deployment, base: DeploymentStatus) -> DeploymentStatus:
        rel = self.release(deployment.deployment_id)
        mine = [r for r in self._records.values() if r.deployment_id == deployment.deployment_id]
        ready = self.ready_replicas(deployment.deployment_id)  # per slot (a canary is on top)
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
            prog = rel.progress
            if prog is not None and prog.candidate_revision == target and not prog.ended:
                return DeploymentStatus(
                    "Progressing",
                    f"{prog.stage}: {prog.message}",
                    target_revision=target,
                    **common,
                )
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

    def ready_replicas(self, deployment_id: str) -> int:
        """The deployment's slots with a replica that serves and is observed READY (the
        autoscaler's count of what its last scale-up brought). Per slot: a canary's candidate
        on top of a stable replica, or a surge replica beside the one it replaces, is not a
        replica more."""
        return len(
            {
                r.slot or r.replica_id
                for r in self._records.values()
                if r.deployment_id == deployment_id and r.stage is Stage.SERVING and self._ready(r)
            }
        )

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
        await self._canary_step(deployment, now)  # may roll back: before the goal is chosen
        goal, profile, rel = self._goal(deployment)
        prog = self._progress_for(deployment, goal, rel)
        rel = self.release(deployment.deployment_id)
        self._adopt(deployment, placements, goal, nodes)
        mine = [r for r in self._records.values() if r.deployment_id == deployment.deployment_id]
        slots = {p.replica_id: p for p in placements}
        for record in mine:
            if record.slot not in slots:
                await self._retire(record, now, nodes)
        if self._held(prog) and rel.serving_profile is not None:
            await self._converge_held(deployment, slots, goal, profile, rel, nodes, now)
            return
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
                if checked is None or checked.stage not in (Stage.SERVING, Stage.QUALIFYING):
                    complete = False
                    continue
                target = checked
            if target.stage is Stage.QUALIFYING:
                await self._qualify(deployment, profile, target, now, nodes)
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
                    if other is not target and other.stage in _ACTIVE:
                        await self._retire(other, now, nodes)
            else:
                complete = False  # retiring from an earlier goal: started again once gone
        rel = self.release(deployment.deployment_id)  # the pipeline may have moved on
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

    async def _converge_held(
        self,
        deployment: Deployment,
        slots: Mapping[str, Placement],
        goal: str,
        profile: DeploymentProfile,
        rel: Release,
        nodes: Mapping[str, Node],
        now: datetime,
    ) -> None:
        """A release that qualifies or runs its canary: every slot keeps (or gets back) its
        stable replica; the slots `_pipeline_slots` allows run a candidate on top (started,
        warmed up, qualified, served); a candidate in a slot no longer allowed (the autoscaler
        scaled down) and replicas of any other revision are retired. Nothing completes here:
        promotion (or rollback) ends the hold."""
        assert rel.serving_profile is not None
        stable_revision = rel.serving_revision
        allowed = self._pipeline_slots(deployment, rel.progress, list(slots))
        for slot, placement in sorted(slots.items()):
            records = self._slot_records(deployment.deployment_id, slot)
            stable = self._records.get((placement.node, agent_replica_id(slot, stable_revision)))
            serving_stable = any(
                r.revision == stable_revision and r.stage is Stage.SERVING for r in records
            )
            if stable is None and not serving_stable:
                await self._start(
                    deployment, rel.serving_profile, stable_revision, placement, nodes, now
                )
            elif stable is not None and stable.stage is Stage.STARTING:
                await self._check(deployment, stable, self.release(rel.deployment_id), now, nodes)
            elif stable is not None and stable.stage is Stage.SERVING and self._gone(stable):
                log.warning("replica_lost", replica=stable.replica_id, node=stable.node)
                self._delete(stable)
            for other in records:
                if other.revision not in (goal, stable_revision) and other.stage in _ACTIVE:
                    await self._retire(other, now, nodes)
            target = self._records.get((placement.node, agent_replica_id(slot, goal)))
            if slot not in allowed:
                if target is not None and target.stage in _ACTIVE:
                    await self._retire(target, now, nodes)
                continue
            if target is None:
                # Qualifying and canary replicas run on top of the stable ones.
                await self._start(deployment, profile, goal, placement, nodes, now)
                continue
            if target.stage is Stage.STARTING:
                await self._check(deployment, target, self.release(rel.deployment_id), now, nodes)
                target = self._records.get(target.key) or target
            if target.stage is Stage.QUALIFYING:
                await self._qualify(deployment, profile, target, now, nodes)
            elif target.stage is Stage.SERVING and self._gone(target):
                log.warning("replica_lost", replica=target.replica_id, node=target.node)
                self._delete(target)

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
            await self._failed(
                deployment, target, self.release(target.deployment_id), verdict, now, nodes
            )
            return
        self._problems.pop(deployment.deployment_id, None)
        if self._needs_qualifying(target):
            # In the routing table with no revision share: the gates run on it next.
            self._put(dataclasses.replace(target, stage=Stage.QUALIFYING, stage_since=now))
            log.info("replica_qualifying", replica=target.replica_id, node=target.node)
            return
        self._put(dataclasses.replace(target, stage=Stage.SERVING, stage_since=now))
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

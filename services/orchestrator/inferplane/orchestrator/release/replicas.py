"""The reconcile loop's replica operations: start, adopt, retire (draining in the routing table
first), drain and stop managed replicas, the records and releases written before the calls that
act on them, and the routing table built from them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.control import ControlPlane
from inferplane.orchestrator.fleet.model import Node
from inferplane.orchestrator.placement.model import Placement
from inferplane.orchestrator.release.observe import LIVE_STATES, Observation, S
from inferplane.orchestrator.release.spec import agent_replica_id, build_spec
from inferplane.orchestrator.release.store import ManagedReplica, Release, ReleaseStore, Stage
from inferplane.orchestrator.routing import adapter_routes, make_table
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.orchestrator.reconcile")


class ReplicaOperations(Observation):
    """Managed replicas and the node-agent calls that change them (a base of `Reconciler`,
    which sets the attributes)."""

    _control: ControlPlane
    _store: ReleaseStore
    _clock: Clock
    _records: dict[tuple[str, str], ManagedReplica]
    _releases: dict[str, Release]
    _checks: dict[tuple[str, str], asyncio.Task[str]]
    _qualifying: dict[tuple[str, str], asyncio.Task[Any]]

    def managed(self) -> tuple[ManagedReplica, ...]:
        """The managed replicas, by (node, replica id)."""
        return tuple(self._records[k] for k in sorted(self._records))

    def release(self, deployment_id: str) -> Release:
        return self._releases.get(deployment_id) or Release(deployment_id)

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
                    or seen.state not in LIVE_STATES
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
        spec = build_spec(
            deployment, profile, revision, placement, node, lora_root=self._control.lora_root
        )
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

    async def _retire(
        self, record: ManagedReplica, now: datetime, nodes: Mapping[str, Node]
    ) -> None:
        """Takes a replica out of service: a SERVING one is marked draining in the routing table
        first; one that never served is stopped at once."""
        self._cancel_tasks(record)
        if record.stage is Stage.SERVING:
            self._put(dataclasses.replace(record, stage=Stage.RETIRING, stage_since=now))
            log.info("replica_retiring", replica=record.replica_id, node=record.node)
        elif record.stage in (Stage.STARTING, Stage.QUALIFYING):
            # Never took live traffic (a qualifying one only requests pinned to its revision).
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

    def _put(self, record: ManagedReplica) -> None:
        self._store.put_replica(record)
        self._records[record.key] = record

    def _delete(self, record: ManagedReplica) -> None:
        self._store.delete_replica(record.node, record.replica_id)
        self._records.pop(record.key, None)
        self._cancel_tasks(record)

    def _cancel_tasks(self, record: ManagedReplica) -> None:
        """Cancels the replica's warm-up/gate check and its qualifying task, if running."""
        for tasks in (self._checks, self._qualifying):
            task = tasks.pop(record.key, None)
            if task is not None:
                task.cancel()

    def _put_release(self, release: Release) -> None:
        self._store.put_release(release)
        self._releases[release.deployment_id] = release

    def _revision_shares(self, deployment: Deployment) -> list[pb.RevisionShare]:
        """The route's live-traffic split by revision (none here; the release pipeline's
        `Pipeline` sets it during a release)."""
        return []

    def routing_table(
        self, deployments: Sequence[Deployment] | object
    ) -> pb.WatchRoutingTableResponse:
        """Model (deployment id and aliases) → SERVING (and QUALIFYING) replicas observed
        READY, and retiring ones marked draining, with the release's revision shares;
        versioned by content."""
        routes = []
        for deployment in deployments:
            endpoints = []
            for record in sorted(self._records.values(), key=lambda r: r.key):
                if record.deployment_id != deployment.deployment_id:
                    continue
                seen = self._seen(record)
                if seen is None:
                    continue
                if (
                    record.stage in (Stage.SERVING, Stage.QUALIFYING)
                    and seen.state == S.STATE_READY
                ):
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
                        # Scale to zero (issue 29): with no endpoint the picker holds a
                        # request up to the budget while a replica starts.
                        scale_to_zero=deployment.autoscaled
                        and deployment.autoscaling.scale_to_zero,
                        cold_start_budget_seconds=(
                            deployment.autoscaling.effective_cold_start_budget_seconds
                            if deployment.autoscaled and deployment.autoscaling.scale_to_zero
                            else 0
                        ),
                        # Routers tokenize prompts for precise_prefix from where replicas do.
                        tokenizer=deployment.profile.model_source,
                        revision_shares=self._revision_shares(deployment),
                    )
                )
        routes.extend(adapter_routes(routes, self._control.adapters()))
        return make_table(routes)

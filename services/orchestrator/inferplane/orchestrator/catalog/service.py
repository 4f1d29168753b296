"""The catalogue's use cases: create (or validate only), get, list, update (field masks, a
new revision on a profile change), delete deployments, their replicas and placement explained,
and each deployment's status (placement view, refined by the release logic's provider).

Every use case runs the leadership guard first and changes state through `DesiredState._commit`
(`inferplane.orchestrator.state`). The gRPC adapter is `servicer.DeploymentService`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.orchestrator.autoscale.model import AutoscalerStatus, ScaleDecision, Signals
from inferplane.orchestrator.catalog.adapters import AdapterCatalogue
from inferplane.orchestrator.catalog.compat_check import CompatibilityCheck, Forced, Override
from inferplane.orchestrator.catalog.model import (
    Autoscaling,
    Deployment,
    DeploymentProfile,
    RolloutStrategy,
)
from inferplane.orchestrator.catalog.sizing import estimate
from inferplane.orchestrator.catalog.validation import validate_deployment
from inferplane.orchestrator.fleet.model import NodeCondition
from inferplane.orchestrator.placement.capabilities import capability_error
from inferplane.orchestrator.placement.explain import explain_deployment
from inferplane.orchestrator.placement.model import Placement, PlacementPlan, Unplaced
from inferplane.orchestrator.placement.planner import static_fit_error
from inferplane.orchestrator.state import Page, paginate
from inferplane.orchestrator.store.base import StateChange
from inferplane.runtime import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)

log = structlog.get_logger("inferplane.orchestrator")

# Replica states as node-agents report them (nodeagent.v1.Replica.State names).
READY_STATE = "STATE_READY"

UPDATABLE_FIELDS = (
    "aliases",
    "profile",
    "replicas",
    "min_replicas",
    "max_replicas",
    "rollout",
    "owned_by",
    "routing_policy",
    "autoscaling",
)
#: ListAutoscalerDecisions: decisions returned when page_size is 0, and at most.
DEFAULT_DECISIONS_PAGE = 50
MAX_DECISIONS_PAGE = 1000
_NESTED = {
    "profile": {f.name for f in dataclasses.fields(DeploymentProfile)},
    "rollout": {f.name for f in dataclasses.fields(RolloutStrategy)},
    "autoscaling": {f.name for f in dataclasses.fields(Autoscaling)},
}


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentStatus:
    """What is happening to a deployment (see the proto's phases). `release`: the release
    pipeline's view (`inferplane.orchestrator.v1.ReleaseProgress`, issue 30; None: no release
    ran), set by the reconciler's status."""

    phase: str
    message: str
    ready_replicas: int
    current_revision: str
    target_revision: str = ""
    autoscaler: AutoscalerStatus | None = None
    release: orchestrator_pb2.ReleaseProgress | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentView:
    """A deployment with its placements and status."""

    deployment: Deployment
    placements: tuple[Placement, ...]
    unplaced: tuple[Unplaced, ...]
    status: DeploymentStatus


class Catalogue(AdapterCatalogue):
    """The catalogue's use cases (see the module docstring); LoRA adapters' are its base's
    (`catalog/adapters.py`)."""

    _status_provider: Callable[[Deployment, DeploymentStatus], DeploymentStatus] | None = None
    _compat: CompatibilityCheck | None = None

    def set_status_provider(
        self, provider: Callable[[Deployment, DeploymentStatus], DeploymentStatus]
    ) -> None:
        """Lets the release logic (reconcile, rollouts) refine each deployment's status: it gets
        the deployment and the placement-only status and returns the status to show."""
        self._status_provider = provider

    def set_compatibility_check(self, check: CompatibilityCheck) -> None:
        """Enforces the compatibility matrix at create and at a revision-changing update
        (`catalog/compat_check.py`); unset: not enforced."""
        self._compat = check

    def resolve(self, name: str) -> Deployment:
        """The deployment for `deployments/{id-or-alias}` or a bare id/alias.

        Raises:
            NotFoundError: no deployment has that id or alias.
        """
        key = name.removeprefix("deployments/")
        with self._lock:
            deployment = self._deployments.get(key) or self._deployments.get(
                self._aliases.get(key, "")
            )
        if deployment is None:
            raise NotFoundError(
                f"deployments/{key} not found", reason="DEPLOYMENT_NOT_FOUND", param="name"
            )
        return deployment

    def create(
        self,
        deployment: Deployment,
        *,
        validate_only: bool = False,
        override: Override | None = None,
    ) -> DeploymentView:
        """Creates a deployment and places its replicas (or, with `validate_only`, shows what
        would happen without writing anything).

        Raises:
            InvalidArgumentError: a bad field (see `catalog.validation`), or a failed verdict
                in the compatibility matrix not overridden (`catalog.compat_check`).
            AlreadyExistsError: the id or an alias is taken.
            FailedPreconditionError: one replica cannot fit any node of the fleet, with numbers;
                or no registered node has its engine, KV cache dtype or speculative method
                (`param` names the field, `placement.capabilities.capability_error`).
        """
        self._guard()
        now = self._clock.now()
        candidate = dataclasses.replace(deployment.normalised(), create_time=now, update_time=now)
        validate_deployment(candidate)
        forced = self._compat.admit(candidate, override) if self._compat else None
        with self._lock:
            self._check_names_free(candidate)
            self._check_free_of_adapters(candidate)
            self._check_fits(candidate)
            deployments = {**self._deployments, candidate.deployment_id: candidate}
            if validate_only:
                preview = self._plan_for(deployments, self._nodes)
                return self._view(candidate, preview)
            self._commit(StateChange(create_deployments=(candidate,)), deployments, self._nodes)
            if forced is not None and self._compat is not None:
                self._compat.audit(forced)
            log.info(
                "deployment_created",
                deployment=candidate.deployment_id,
                revision=candidate.revision,
                replicas=candidate.replicas,
            )
            return self._view(candidate, self._plan)

    def get(self, name: str) -> DeploymentView:
        """Raises NotFoundError."""
        self._guard()
        with self._lock:
            return self._view(self.resolve(name), self._plan)

    def list_deployments(self, page_size: int, page_token: str) -> Page:
        """Deployments in id order. Raises InvalidArgumentError for a bad token."""
        self._guard()
        with self._lock:
            ids = sorted(self._deployments)
            page, token = paginate(ids, page_size, page_token)
            return Page(tuple(self._view(self._deployments[i], self._plan) for i in page), token)

    def update(
        self, incoming: Deployment, paths: Sequence[str], *, override: Override | None = None
    ) -> DeploymentView:
        """Sets the masked fields (`profile.precision`-style paths allowed; empty = all
        updatable fields). A profile change gives a new revision and re-places the replicas.

        Raises:
            NotFoundError, InvalidArgumentError (unknown path, bad value, or a new revision
            with a failed verdict not overridden: `catalog.compat_check`), AlreadyExistsError
            (alias taken), FailedPreconditionError (no longer fits the fleet).
        """
        self._guard()
        with self._lock:
            current = self.resolve(incoming.deployment_id)
            merged = _merge(current, incoming, paths)
            candidate = dataclasses.replace(
                merged.normalised(), create_time=current.create_time, update_time=self._clock.now()
            )
            if current.autoscaled and merged.autoscaled:
                _check_replicas_untouched(current, incoming, paths)
                candidate = dataclasses.replace(candidate, replicas=current.replicas)
            if candidate.autoscaled:
                candidate = dataclasses.replace(candidate, replicas=_within_bounds(candidate))
            validate_deployment(candidate)
            self._check_names_free(candidate, ignore=current.deployment_id)
            self._check_free_of_adapters(candidate)
            self._check_keeps_adapters(candidate)
            forced: Forced | None = None
            if candidate.revision != current.revision:
                self._check_fits(candidate)
                forced = self._compat.admit(candidate, override) if self._compat else None
            deployments = {**self._deployments, candidate.deployment_id: candidate}
            self._commit(StateChange(put_deployments=(candidate,)), deployments, self._nodes)
            if forced is not None and self._compat is not None:
                self._compat.audit(forced)
            log.info(
                "deployment_updated",
                deployment=candidate.deployment_id,
                revision=candidate.revision,
                previous_revision=current.revision,
            )
            return self._view(candidate, self._plan)

    def autoscale(
        self, deployment_id: str, replicas: int, kind: str, reason: str, signals: Signals
    ) -> tuple[int, str]:
        """The autoscaler's write of an autoscaled deployment's `replicas`, with its decision
        (one transaction, fenced like every catalogue write). A scale-up is bounded by free
        capacity: replicas placement cannot place are not asked for, and why is returned.

        Returns:
            (the replicas now desired, why fewer than `replicas` were set: placement's reason
            for the first replica it could not place; "" when all were).
        """
        self._guard()
        with self._lock:
            current = self._deployments.get(deployment_id)
            if current is None or not current.autoscaled:
                return (current.replicas if current else 0), ""
            target, short = replicas, ""
            if target > current.replicas:
                preview = self._plan_for(
                    {
                        **self._deployments,
                        deployment_id: dataclasses.replace(current, replicas=target),
                    },
                    self._nodes,
                )
                unplaced = preview.of(deployment_id)[1]
                if unplaced:
                    short = f"{len(unplaced)} cannot be placed: {unplaced[0].reason}"
                    target = max(current.replicas, target - len(unplaced))
            if target == current.replicas:
                return target, short
            candidate = dataclasses.replace(current, replicas=target)
            decision = ScaleDecision(
                deployment_id=deployment_id,
                time=self._clock.now(),
                decision=kind,
                from_replicas=current.replicas,
                to_replicas=target,
                reason=f"{reason}; {short}" if short else reason,
                signals=signals,
            )
            deployments = {**self._deployments, deployment_id: candidate}
            self._commit(
                StateChange(put_deployments=(candidate,), add_decisions=(decision,)),
                deployments,
                self._nodes,
            )
            log.info(
                "autoscaled",
                deployment=deployment_id,
                decision=kind,
                replicas=target,
                previous=current.replicas,
                reason=decision.reason,
            )
            return target, short

    def autoscaler_decisions(self, name: str, page_size: int) -> tuple[ScaleDecision, ...]:
        """The newest autoscaler decisions (of `name`, `deployments/{id-or-alias}`; "": all),
        newest first, at most `page_size` (0: 50; capped at 1,000). Raises NotFoundError."""
        self._guard()
        deployment_id = self.resolve(name).deployment_id if name else ""
        limit = min(page_size or DEFAULT_DECISIONS_PAGE, MAX_DECISIONS_PAGE)
        return self._store.list_decisions(deployment_id, limit)

    def delete(self, name: str) -> None:
        """Deletes the deployment and its placements. Raises NotFoundError."""
        self._guard()
        with self._lock:
            current = self.resolve(name)
            self._check_deletable(current.deployment_id)
            deployments = {k: v for k, v in self._deployments.items() if k != current.deployment_id}
            self._commit(
                StateChange(delete_deployments=(current.deployment_id,)), deployments, self._nodes
            )
            log.info("deployment_deleted", deployment=current.deployment_id)

    def replicas(self, name: str, page_size: int, page_token: str) -> Page:
        """The deployment's replicas in ordinal order: `Placement` values, then `Unplaced`
        ones interleaved by ordinal. Raises NotFoundError, InvalidArgumentError."""
        self._guard()
        with self._lock:
            view = self._view(self.resolve(name), self._plan)
            by_id: dict[str, Placement | Unplaced] = {p.replica_id: p for p in view.placements}
            by_id.update({u.replica_id: u for u in view.unplaced})
            ids = list(view.deployment.replica_ids())
            page, token = paginate(ids, page_size, page_token, ordered=False)
            return Page(tuple(by_id[i] for i in page if i in by_id), token)

    def explain(self, name: str) -> list[str]:
        """One header line and one line per replica (see `placement.explain`)."""
        self._guard()
        with self._lock:
            deployment = self.resolve(name)
            placements, unplaced = self._plan.of(deployment.deployment_id)
            return explain_deployment(
                deployment,
                estimate(deployment.profile, self._sizing),
                placements,
                unplaced,
                self._nodes,
                self._sizing,
                self._plan.policy,
            )

    def _check_names_free(self, candidate: Deployment, ignore: str = "") -> None:
        taken = {**{d: d for d in self._deployments}, **self._aliases}
        for name in (candidate.deployment_id, *candidate.aliases):
            owner = taken.get(name)
            if owner is not None and owner != ignore:
                what = "deployment id" if name == candidate.deployment_id else "alias"
                raise AlreadyExistsError(
                    f"{what} {name!r} is already used by deployments/{owner}",
                    reason="DEPLOYMENT_EXISTS",
                    param="deployment_id" if what == "deployment id" else "deployment.aliases",
                )

    def _check_fits(self, candidate: Deployment) -> None:
        nodes = list(self._nodes.values())
        lack = capability_error(candidate.profile, nodes)  # issue 30: engine and features
        if lack is not None:
            field, message = lack
            raise FailedPreconditionError(
                message, reason="NO_NODE_CAN_RUN", param=f"deployment.profile.{field}"
            )
        error = static_fit_error(candidate.profile, nodes, self._sizing)
        if error is not None:
            raise FailedPreconditionError(
                error, reason="DEPLOYMENT_DOES_NOT_FIT", param="deployment.profile"
            )

    def _view(self, deployment: Deployment, current: PlacementPlan) -> DeploymentView:
        placements, unplaced = current.of(deployment.deployment_id)
        ready = sum(
            1
            for p in placements
            if (r := self._observed.get(p.node, {}).get(p.replica_id)) is not None
            and r.state == READY_STATE
            and self._nodes.get(p.node) is not None
            and self._nodes[p.node].condition is not NodeCondition.NOT_READY
        )
        status = _status(deployment, placements, unplaced, ready)
        if self._status_provider is not None:
            status = self._status_provider(deployment, status)
        return DeploymentView(deployment, placements, unplaced, status)


def _status(
    deployment: Deployment,
    placements: Sequence[Placement],
    unplaced: Sequence[Unplaced],
    ready: int,
) -> DeploymentStatus:
    wanted = deployment.replicas
    if unplaced and not placements:
        phase, message = "Unplaceable", f"no replica can be placed: {unplaced[0].reason}"
    elif unplaced:
        phase = "Degraded"
        message = (
            f"{len(placements)} of {wanted} replicas placed; {unplaced[0].replica_id} "
            f"cannot be placed: {unplaced[0].reason}"
        )
    elif ready >= wanted:
        phase, message = "Available", f"{ready} of {wanted} replicas ready"
    else:
        phase = "Progressing"
        message = f"{len(placements)} of {wanted} replicas placed, {ready} ready"
    return DeploymentStatus(phase, message, ready, deployment.revision)


def _check_replicas_untouched(
    current: Deployment, incoming: Deployment, paths: Sequence[str]
) -> None:
    """Refuses an update that sets `replicas` of a deployment the autoscaler owns (a request
    that leaves it 0 or at its current value in a whole-deployment update is fine).

    Raises:
        FailedPreconditionError: `replicas` named with another value.
    """
    named = "replicas" in paths or not paths
    if named and incoming.replicas not in (0, current.replicas):
        raise FailedPreconditionError(
            f"replicas of deployments/{current.deployment_id} is set by the autoscaler "
            f"(autoscaling.enabled, now {current.replicas}, within min_replicas "
            f"{current.min_replicas} .. max_replicas {current.max_replicas}); change "
            "min_replicas / max_replicas, or disable autoscaling to set replicas",
            reason="REPLICAS_OWNED_BY_AUTOSCALER",
            param="deployment.replicas",
        )


def _within_bounds(d: Deployment) -> int:
    """An autoscaled deployment's replicas moved into its bounds (0 stays 0 with scale to
    zero)."""
    if d.replicas == 0 and d.autoscaling.scale_to_zero:
        return 0
    return min(max(d.replicas, d.replica_floor), d.max_replicas)


def _merge(current: Deployment, incoming: Deployment, paths: Sequence[str]) -> Deployment:
    """`current` with the fields named by `paths` taken from `incoming`.

    Raises:
        InvalidArgumentError: a path that is not updatable.
    """
    if not paths:
        paths = UPDATABLE_FIELDS
    merged = current
    for path in paths:
        head, _, leaf = path.partition(".")
        if head not in UPDATABLE_FIELDS or (leaf and leaf not in _NESTED.get(head, set())):
            known = ", ".join((*UPDATABLE_FIELDS, "profile.<field>", "rollout.<field>"))
            raise InvalidArgumentError(
                f"update_mask path {path!r} is not updatable; updatable: {known}",
                param="update_mask",
            )
        if leaf:
            inner = dataclasses.replace(
                getattr(merged, head), **{leaf: getattr(getattr(incoming, head), leaf)}
            )
            merged = dataclasses.replace(merged, **{head: inner})
        else:
            merged = dataclasses.replace(merged, **{head: getattr(incoming, head)})
    return merged

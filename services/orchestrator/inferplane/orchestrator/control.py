"""The orchestrator's use cases over its desired state: catalogue CRUD, fleet membership and
liveness, and (re)placement after every change.

State lives in memory and is written through to a `StateStore`: each use case computes the new
deployments/nodes and the placement plan they imply, commits them in ONE transaction, and only
then swaps them in, so memory never runs ahead of the database. Calls are serialised by a lock
(the gRPC layer runs them in worker threads). Time comes from the injected clock.

Liveness after a restart: every known node gets a full heartbeat timeout from the moment the
state is loaded, so an orchestrator restart never marks a healthy fleet NotReady.

Leadership (`inferplane.orchestrator.leadership`): the `guard` given at construction runs first
in every use case an RPC reaches (catalogue, fleet, liveness sweep); on a standby it raises
NotLeaderError (UNAVAILABLE naming the leader). `load` and the read models the reconciler uses
are not guarded: the leader calls them.

Extension points for the next steps (reconcile, rolling releases, routing table):
`placements()` is the desired placement per replica, `observed_replicas()` what node-agents
report, and `subscribe(callback)` announces every committed change.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import structlog

from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile, RolloutStrategy
from inferplane.orchestrator.catalog.sizing import SizingPolicy, estimate
from inferplane.orchestrator.catalog.validation import validate_deployment
from inferplane.orchestrator.fleet.model import (
    MAX_AGENT_VERSION,
    MAX_NODE_ADDRESS,
    MAX_NODE_NAME,
    Liveness,
    Node,
    NodeCondition,
)
from inferplane.orchestrator.placement.explain import explain_deployment
from inferplane.orchestrator.placement.model import (
    Placement,
    PlacementPlan,
    PlacementPolicy,
    Unplaced,
)
from inferplane.orchestrator.placement.planner import plan, static_fit_error
from inferplane.orchestrator.store.base import StateChange, StateStore
from inferplane.runtime import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from inferplane.runtime.clock import Clock
from inferplane.runtime.page_tokens import decode_page_token, encode_page_token

log = structlog.get_logger("inferplane.orchestrator")

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
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
)
_NESTED = {
    "profile": {f.name for f in dataclasses.fields(DeploymentProfile)},
    "rollout": {f.name for f in dataclasses.fields(RolloutStrategy)},
}


@dataclasses.dataclass(frozen=True, slots=True)
class ObservedReplica:
    """A replica as a node-agent reports it: `replica_id`, state name (`STATE_READY`...) and
    the raw report (the node-agent's `Replica` message, passed through to API responses)."""

    replica_id: str
    state: str
    raw: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentStatus:
    """What is happening to a deployment (see the proto's phases)."""

    phase: str
    message: str
    ready_replicas: int
    current_revision: str
    target_revision: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentView:
    """A deployment with its placements and status."""

    deployment: Deployment
    placements: tuple[Placement, ...]
    unplaced: tuple[Unplaced, ...]
    status: DeploymentStatus


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    items: tuple[Any, ...]
    next_page_token: str


class ControlPlane:
    """Catalogue, fleet and placement use cases (see the module docstring)."""

    def __init__(
        self,
        store: StateStore,
        policy: PlacementPolicy,
        *,
        sizing: SizingPolicy,
        liveness: Liveness,
        clock: Clock,
        guard: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._guard = guard or _no_guard
        self._policy = policy
        self._sizing = sizing
        self._liveness = liveness
        self._clock = clock
        self._lock = threading.RLock()
        self._deployments: dict[str, Deployment] = {}
        self._aliases: dict[str, str] = {}
        self._nodes: dict[str, Node] = {}
        self._liveness_base: dict[str, datetime] = {}
        self._heartbeats: dict[str, datetime] = {}
        self._observed: dict[str, dict[str, ObservedReplica]] = {}
        self._plan = PlacementPlan((), (), policy.name)
        self._listeners: list[Callable[[], None]] = []
        self._status_provider: Callable[[Deployment, DeploymentStatus], DeploymentStatus] | None = (
            None
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self) -> None:
        """Reads the persisted state, restarts liveness timers, and re-plans (committing any
        placement the plan changes, e.g. after a policy or sizing change)."""
        with self._lock:
            snapshot = self._store.load()
            now = self._clock.now()
            self._deployments = {d.deployment_id: d for d in snapshot.deployments}
            self._aliases = {a: d.deployment_id for d in snapshot.deployments for a in d.aliases}
            self._nodes = {n.name: n for n in snapshot.nodes}
            self._liveness_base = {name: now for name in self._nodes}
            self._plan = PlacementPlan(snapshot.placements, (), self._policy.name)
            self._commit(StateChange(), self._deployments, self._nodes)

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` (under the lock, keep it short) after every committed change."""
        self._listeners.append(callback)

    def set_status_provider(
        self, provider: Callable[[Deployment, DeploymentStatus], DeploymentStatus]
    ) -> None:
        """Lets the release logic (reconcile, rollouts) refine each deployment's status: it gets
        the deployment and the placement-only status and returns the status to show."""
        self._status_provider = provider

    # ---- catalogue -------------------------------------------------------------------------

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

    def create(self, deployment: Deployment, *, validate_only: bool = False) -> DeploymentView:
        """Creates a deployment and places its replicas (or, with `validate_only`, shows what
        would happen without writing anything).

        Raises:
            InvalidArgumentError: a bad field (see `catalog.validation`).
            AlreadyExistsError: the id or an alias is taken.
            FailedPreconditionError: one replica cannot fit any node of the fleet, with numbers.
        """
        self._guard()
        now = self._clock.now()
        candidate = dataclasses.replace(deployment.normalised(), create_time=now, update_time=now)
        validate_deployment(candidate)
        with self._lock:
            self._check_names_free(candidate)
            self._check_fits(candidate)
            deployments = {**self._deployments, candidate.deployment_id: candidate}
            if validate_only:
                preview = self._plan_for(deployments, self._nodes)
                return self._view(candidate, preview)
            self._commit(StateChange(create_deployments=(candidate,)), deployments, self._nodes)
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
            page, token = _paginate(ids, page_size, page_token)
            return Page(tuple(self._view(self._deployments[i], self._plan) for i in page), token)

    def update(self, incoming: Deployment, paths: Sequence[str]) -> DeploymentView:
        """Sets the masked fields (`profile.precision`-style paths allowed; empty = all
        updatable fields). A profile change gives a new revision and re-places the replicas.

        Raises:
            NotFoundError, InvalidArgumentError (unknown path or bad value), AlreadyExistsError
            (alias taken), FailedPreconditionError (no longer fits the fleet).
        """
        self._guard()
        with self._lock:
            current = self.resolve(incoming.deployment_id)
            merged = _merge(current, incoming, paths)
            candidate = dataclasses.replace(
                merged.normalised(), create_time=current.create_time, update_time=self._clock.now()
            )
            validate_deployment(candidate)
            self._check_names_free(candidate, ignore=current.deployment_id)
            if candidate.revision != current.revision:
                self._check_fits(candidate)
            deployments = {**self._deployments, candidate.deployment_id: candidate}
            self._commit(StateChange(put_deployments=(candidate,)), deployments, self._nodes)
            log.info(
                "deployment_updated",
                deployment=candidate.deployment_id,
                revision=candidate.revision,
                previous_revision=current.revision,
            )
            return self._view(candidate, self._plan)

    def delete(self, name: str) -> None:
        """Deletes the deployment and its placements. Raises NotFoundError."""
        self._guard()
        with self._lock:
            current = self.resolve(name)
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
            page, token = _paginate(ids, page_size, page_token, ordered=False)
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

    # ---- fleet -----------------------------------------------------------------------------

    def register_node(self, inventory: Node, observed: Iterable[ObservedReplica] = ()) -> Node:
        """Registers or re-registers a node with its inventory; it becomes Ready (Draining if
        it was drained). Raises InvalidArgumentError for a nameless node or a name, address or
        agent version longer than the store holds or with a NUL character."""
        self._guard()
        if not inventory.name:
            raise InvalidArgumentError(
                "status.node (the node name) is required", param="status.node"
            )
        _check_inventory(inventory)
        now = self._clock.now()
        with self._lock:
            existing = self._nodes.get(inventory.name)
            node = dataclasses.replace(
                inventory,
                unschedulable=existing.unschedulable if existing else False,
                condition=_live_condition(existing),
                last_heartbeat_time=now,
                register_time=existing.register_time
                if existing and existing.register_time
                else now,
            )
            nodes = {**self._nodes, node.name: node}
            self._commit(StateChange(put_nodes=(node,)), self._deployments, nodes)
            self._seen(node.name, now, observed)
            log.info(
                "node_registered",
                node=node.name,
                gpus=len(node.gpus),
                condition=node.condition.value,
            )
            return self.node(node.name)

    def heartbeat(self, inventory: Node, observed: Iterable[ObservedReplica] = ()) -> Node:
        """Records a heartbeat: the node is Ready (or Draining) again; a changed inventory is
        stored and re-placed. Unknown nodes are registered. Raises InvalidArgumentError as
        `register_node` does."""
        self._guard()
        _check_inventory(inventory)
        now = self._clock.now()
        with self._lock:
            existing = self._nodes.get(inventory.name)
            if existing is None:
                return self.register_node(inventory, observed)
            self._seen(existing.name, now, observed)
            condition = _live_condition(existing)
            if condition is existing.condition and inventory.inventory() == existing.inventory():
                return self.node(existing.name)
            node = dataclasses.replace(
                inventory,
                unschedulable=existing.unschedulable,
                condition=condition,
                last_heartbeat_time=now,
                register_time=existing.register_time,
            )
            nodes = {**self._nodes, node.name: node}
            self._commit(StateChange(put_nodes=(node,)), self._deployments, nodes)
            if condition is not existing.condition:
                log.info("node_condition", node=node.name, condition=condition.value)
            return self.node(node.name)

    def drain_node(self, name: str) -> Node:
        """Cordons the node (no new replicas) and places its replicas elsewhere; it reports
        Draining while it keeps heartbeating. Raises NotFoundError."""
        self._guard()
        with self._lock:
            existing = self._node(name)
            condition = (
                existing.condition
                if existing.condition is NodeCondition.NOT_READY
                else NodeCondition.DRAINING
            )
            node = dataclasses.replace(existing, unschedulable=True, condition=condition)
            nodes = {**self._nodes, node.name: node}
            self._commit(StateChange(put_nodes=(node,)), self._deployments, nodes)
            log.info("node_drained", node=node.name)
            return self.node(node.name)

    def uncordon_node(self, name: str) -> Node:
        """Makes a drained node schedulable again; it is Ready unless its heartbeats stopped.
        Raises NotFoundError."""
        self._guard()
        with self._lock:
            existing = self._node(name)
            condition = (
                existing.condition
                if existing.condition is NodeCondition.NOT_READY
                else NodeCondition.READY
            )
            node = dataclasses.replace(existing, unschedulable=False, condition=condition)
            nodes = {**self._nodes, node.name: node}
            self._commit(StateChange(put_nodes=(node,)), self._deployments, nodes)
            log.info("node_uncordoned", node=node.name)
            return self.node(node.name)

    def sweep(self) -> list[str]:
        """Marks nodes NotReady that missed `missed_heartbeats` intervals and re-places their
        replicas. Returns the names that turned NotReady (sorted)."""
        self._guard()
        now = self._clock.now()
        with self._lock:
            late = [
                n
                for name, n in sorted(self._nodes.items())
                if n.condition is not NodeCondition.NOT_READY
                and self._liveness.is_late(self._liveness_base.get(name, now), now)
            ]
            if not late:
                return []
            changed = [dataclasses.replace(n, condition=NodeCondition.NOT_READY) for n in late]
            nodes = {**self._nodes, **{n.name: n for n in changed}}
            self._commit(StateChange(put_nodes=tuple(changed)), self._deployments, nodes)
            for n in changed:
                log.warning(
                    "node_not_ready",
                    node=n.name,
                    timeout_seconds=self._liveness.timeout.total_seconds(),
                )
            return [n.name for n in changed]

    def node(self, name: str) -> Node:
        """The node with its last heartbeat time. Raises NotFoundError."""
        self._guard()
        with self._lock:
            node = self._node(name)
            beat = self._heartbeats.get(node.name)
            return dataclasses.replace(node, last_heartbeat_time=beat) if beat else node

    def list_nodes(self, page_size: int, page_token: str) -> Page:
        """Nodes in name order. Raises InvalidArgumentError for a bad token."""
        self._guard()
        with self._lock:
            page, token = _paginate(sorted(self._nodes), page_size, page_token)
            return Page(tuple(self.node(n) for n in page), token)

    @property
    def heartbeat_interval_seconds(self) -> float:
        return self._liveness.heartbeat_interval_seconds

    # ---- read models for the next steps (reconcile, rollouts, routing) --------------------

    def placements(self) -> PlacementPlan:
        """The current plan (desired placement per replica, and what cannot be placed)."""
        with self._lock:
            return self._plan

    def observed_replicas(self) -> Mapping[str, Mapping[str, ObservedReplica]]:
        """What each node-agent last reported, by node then replica id."""
        with self._lock:
            return {k: dict(v) for k, v in self._observed.items()}

    def deployments(self) -> tuple[Deployment, ...]:
        with self._lock:
            return tuple(self._deployments[k] for k in sorted(self._deployments))

    def nodes(self) -> tuple[Node, ...]:
        with self._lock:
            return tuple(self._nodes[k] for k in sorted(self._nodes))

    # ---- internals -------------------------------------------------------------------------

    def _node(self, name: str) -> Node:
        key = name.removeprefix("nodes/")
        node = self._nodes.get(key)
        if node is None:
            raise NotFoundError(f"nodes/{key} not found", reason="NODE_NOT_FOUND", param="name")
        return node

    def _seen(self, name: str, now: datetime, observed: Iterable[ObservedReplica]) -> None:
        self._liveness_base[name] = now
        self._heartbeats[name] = now
        self._observed[name] = {r.replica_id: r for r in observed}

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
        error = static_fit_error(candidate.profile, list(self._nodes.values()), self._sizing)
        if error is not None:
            raise FailedPreconditionError(
                error, reason="DEPLOYMENT_DOES_NOT_FIT", param="deployment.profile"
            )

    def _plan_for(
        self, deployments: Mapping[str, Deployment], nodes: Mapping[str, Node]
    ) -> PlacementPlan:
        previous = {p.replica_id: p for p in self._plan.placements}
        return plan(
            deployments.values(),
            [nodes[k] for k in sorted(nodes)],
            previous,
            self._policy,
            self._sizing,
        )

    def _commit(
        self,
        change: StateChange,
        deployments: dict[str, Deployment],
        nodes: dict[str, Node],
    ) -> None:
        """Re-plans for the new deployments/nodes, commits `change` plus the placement diff in
        one transaction, then swaps the new state in."""
        new_plan = self._plan_for(deployments, nodes)
        old = {p.replica_id: p for p in self._plan.placements}
        new = {p.replica_id: p for p in new_plan.placements}
        # The planner hands kept placements back as the same objects: an identity check skips
        # them before the (dataclass) comparison; only the changed ones are sorted.
        changed = [(k, p) for k, p in new.items() if (was := old.get(k)) is not p and was != p]
        full = dataclasses.replace(
            change,
            put_placements=tuple(p for _, p in sorted(changed, key=lambda kp: kp[0])),
            delete_placements=tuple(k for k in sorted(old) if k not in new),
        )
        self._store.commit(full)
        self._deployments = deployments
        self._aliases = {a: d.deployment_id for d in deployments.values() for a in d.aliases}
        self._nodes = nodes
        for name in nodes:
            self._liveness_base.setdefault(name, self._clock.now())
        moved = sorted(k for k, p in changed if k in old and old[k].node != p.node)
        if moved or len(new_plan.unplaced) != len(self._plan.unplaced):
            log.info(
                "placement_changed",
                moved=moved[:20],
                moved_count=len(moved),
                placed=len(new),
                unplaced=len(new_plan.unplaced),
            )
        self._plan = new_plan
        for callback in self._listeners:
            callback()

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


def _no_guard() -> None:
    return None


def _check_inventory(node: Node) -> None:
    """Raises InvalidArgumentError for a value longer than its column or with a NUL character:
    SQLite would keep it but PostgreSQL refuses it, so both databases answer the same."""
    for field, value, limit in (
        ("node", node.name, MAX_NODE_NAME),
        ("address", node.address, MAX_NODE_ADDRESS),
        ("agent_version", node.agent_version, MAX_AGENT_VERSION),
    ):
        if len(value) > limit:
            raise InvalidArgumentError(
                f"status.{field} must be at most {limit} characters; got {len(value)}",
                param=f"status.{field}",
            )
        if "\x00" in value:
            raise InvalidArgumentError(
                f"status.{field} must not contain NUL characters", param=f"status.{field}"
            )


def _live_condition(existing: Node | None) -> NodeCondition:
    """The condition of a node that just heartbeated."""
    if existing is not None and existing.unschedulable:
        return NodeCondition.DRAINING
    return NodeCondition.READY


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


def _paginate(
    keys: Sequence[str], page_size: int, page_token: str, *, ordered: bool = True
) -> tuple[list[str], str]:
    """A page of `keys` after the token's key. `ordered` keys are sorted (resume by value);
    otherwise the token holds an offset."""
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    start = 0
    if page_token:
        cursor = decode_page_token(page_token)
        try:
            if ordered:
                after = str(cursor["after"])
                start = next((i for i, k in enumerate(keys) if k > after), len(keys))
            else:
                start = int(cursor["offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError("page_token is not valid", param="page_token") from exc
    page = list(keys[start : start + size])
    if start + size >= len(keys):
        return page, ""
    return page, encode_page_token({"after": page[-1]} if ordered else {"offset": start + size})

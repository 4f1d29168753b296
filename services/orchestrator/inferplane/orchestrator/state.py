"""The orchestrator's desired state in memory (deployments, nodes, the placement plan, what
node-agents report) and its one write path.

State lives in memory and is written through to a `StateStore`: each use case (the catalogue's,
`catalog/service.py`; the fleet's, `fleet/service.py`) computes the new deployments/nodes, and
`_commit` re-plans, writes them and the placement diff in ONE transaction, and only then swaps
them in, so memory never runs ahead of the database. Calls are serialised by a lock (the gRPC
layer runs them in worker threads). Time comes from the injected clock.

Liveness after a restart: every known node gets a full heartbeat timeout from the moment the
state is loaded, so an orchestrator restart never marks a healthy fleet NotReady.

Leadership (`inferplane.orchestrator.leadership`): the `guard` given at construction runs first
in every use case an RPC reaches (catalogue, fleet, liveness sweep); on a standby it raises
NotLeaderError (UNAVAILABLE naming the leader). `load` and the read models the reconciler uses
are not guarded: the leader calls them.

Read models for the release logic (reconcile, rolling releases, routing table): `placements()`
is the desired placement per replica, `observed_replicas()` what node-agents report, and
`subscribe(callback)` announces every committed change.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import structlog

from inferplane.orchestrator.catalog.model import Deployment, LoraAdapter
from inferplane.orchestrator.catalog.sizing import SizingPolicy
from inferplane.orchestrator.fleet.model import Liveness, Node, ObservedReplica
from inferplane.orchestrator.placement.model import PlacementPlan, PlacementPolicy
from inferplane.orchestrator.placement.planner import plan
from inferplane.orchestrator.store.base import StateChange, StateStore
from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.pagination.page_tokens import decode_page_token, encode_page_token
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.orchestrator")

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    items: tuple[Any, ...]
    next_page_token: str


class DesiredState:
    """Deployments, nodes and the placement plan in memory, written through to the store (see
    the module docstring). The use cases are its subclasses, `Catalogue` and `Fleet`;
    `ControlPlane` is both."""

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
        # LoRA adapters by id (`catalog/adapters.py` writes them: they change no placement).
        self._adapters: dict[str, LoraAdapter] = {}
        self._liveness_base: dict[str, datetime] = {}
        self._heartbeats: dict[str, datetime] = {}
        self._observed: dict[str, dict[str, ObservedReplica]] = {}
        self._plan = PlacementPlan((), (), policy.name)
        self._listeners: list[Callable[[], None]] = []

    # ---- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        """Reads the persisted state, restarts liveness timers, and re-plans (committing any
        placement the plan changes, e.g. after a policy or sizing change)."""
        with self._lock:
            snapshot = self._store.load()
            now = self._clock.now()
            self._deployments = {d.deployment_id: d for d in snapshot.deployments}
            self._aliases = {a: d.deployment_id for d in snapshot.deployments for a in d.aliases}
            self._nodes = {n.name: n for n in snapshot.nodes}
            self._adapters = {a.adapter_id: a for a in snapshot.adapters}
            self._liveness_base = {name: now for name in self._nodes}
            self._plan = PlacementPlan(snapshot.placements, (), self._policy.name)
            self._commit(StateChange(), self._deployments, self._nodes)

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` (under the lock, keep it short) after every committed change."""
        self._listeners.append(callback)

    # ---- read models for the release logic (reconcile, rollouts, routing) -----------------

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

    # ---- the one write path ----------------------------------------------------------------

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


def _no_guard() -> None:
    return None


def paginate(
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

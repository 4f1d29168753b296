"""The storage port of the desired state: load everything, commit changes atomically.

The orchestrator keeps its working state in memory and writes through: every change (a
deployment with the placements it caused, a node condition with the replicas it moved) is one
`StateChange` committed in one transaction, so a crash never leaves a deployment without its
placements or the other way round. One orchestrator writes at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from inferplane.orchestrator.autoscale.model import ScaleDecision
from inferplane.orchestrator.catalog.model import Deployment, LoraAdapter
from inferplane.orchestrator.fleet.model import Node
from inferplane.orchestrator.placement.model import Placement


@dataclasses.dataclass(frozen=True, slots=True)
class StateSnapshot:
    """Everything persisted, each tuple sorted by its key (code-point order, as Python sorts)."""

    deployments: tuple[Deployment, ...] = ()
    nodes: tuple[Node, ...] = ()
    placements: tuple[Placement, ...] = ()
    adapters: tuple[LoraAdapter, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StateChange:
    """Upserts and deletions applied in one transaction.

    `create_deployments` are inserted (a duplicate id or alias raises AlreadyExistsError);
    `put_deployments` replace existing rows (aliases included).
    """

    create_deployments: tuple[Deployment, ...] = ()
    put_deployments: tuple[Deployment, ...] = ()
    delete_deployments: tuple[str, ...] = ()
    put_nodes: tuple[Node, ...] = ()
    put_placements: tuple[Placement, ...] = ()
    delete_placements: tuple[str, ...] = ()
    # Autoscaler decisions, written with the `replicas` change they made (issue 29).
    add_decisions: tuple[ScaleDecision, ...] = ()
    put_adapters: tuple[LoraAdapter, ...] = ()
    delete_adapters: tuple[str, ...] = ()

    def is_empty(self) -> bool:
        return not any(dataclasses.astuple(self))


class StateStore(Protocol):
    """Persistence of deployments, nodes, placements and LoRA adapters."""

    def create_schema(self) -> None:
        """Creates missing tables (idempotent)."""

    def load(self) -> StateSnapshot:
        """Reads the whole state."""

    def commit(self, change: StateChange) -> None:
        """Applies `change` atomically.

        Raises:
            AlreadyExistsError: a created deployment id or an alias is taken.
            UnavailableError: the database cannot be reached.
        """

    def list_decisions(self, deployment_id: str, limit: int) -> tuple[ScaleDecision, ...]:
        """The newest `limit` autoscaler decisions, newest first; `deployment_id` "": all."""

    def close(self) -> None:
        """Releases connections."""

"""The fleet's use cases: register and re-register nodes, heartbeats (a changed inventory is
stored and re-placed), drain and uncordon, the liveness sweep (NotReady after the missed
heartbeats, replicas placed elsewhere), and nodes read back with their last heartbeat.

Every use case reached by an RPC runs the leadership guard first and changes state through
`DesiredState._commit` (`inferplane.orchestrator.state`). The gRPC adapter is
`servicer.NodeService`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime

import structlog

from inferplane.orchestrator.fleet.model import (
    MAX_AGENT_VERSION,
    MAX_NODE_ADDRESS,
    MAX_NODE_NAME,
    Node,
    NodeCondition,
    ObservedReplica,
)
from inferplane.orchestrator.state import DesiredState, Page, paginate
from inferplane.orchestrator.store.base import StateChange
from inferplane.runtime import InvalidArgumentError, NotFoundError

log = structlog.get_logger("inferplane.orchestrator")


class Fleet(DesiredState):
    """The fleet's use cases (see the module docstring)."""

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
            page, token = paginate(sorted(self._nodes), page_size, page_token)
            return Page(tuple(self.node(n) for n in page), token)

    @property
    def heartbeat_interval_seconds(self) -> float:
        return self._liveness.heartbeat_interval_seconds

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

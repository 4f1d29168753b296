"""Placement values and the policy interface.

A placement maps a replica to a node, its device indices and the memory it reserves on each.
Policies are pure functions of their input (no clocks, no randomness, no dict-order
dependence): the same fleet and catalogue always give the same placements.

Capacity model (`Ledger`): every placeable device of a schedulable node is a slot with a
capacity and the bytes still free. A GPU slot is one healthy, unpartitioned GPU (capacity = its
memory). A CPU node has one slot: its host memory × `cpu_usable_memory_fraction`. Reservations
on a slot never add up past its capacity (integers, checked on every reserve).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Protocol

from inferplane.orchestrator.catalog.model import Accelerator
from inferplane.orchestrator.catalog.sizing import MemoryEstimate

FRACTION_DIGITS = 4


class Decision(enum.Enum):
    """How a placement came about."""

    PLACED = "placed"  # chosen by the policy in this plan
    KEPT = "kept"  # an earlier placement that still fits where it is


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """One replica to place: `{deployment_id}-{ordinal}` with the memory it needs.

    `eligible` names the nodes that have the engine and capabilities it needs
    (`placement.capabilities`); None: every node of its accelerator kind."""

    replica_id: str
    deployment_id: str
    ordinal: int
    revision: str
    estimate: MemoryEstimate
    eligible: frozenset[str] | None = None

    @property
    def devices(self) -> int:
        return self.estimate.devices

    @property
    def bytes_per_device(self) -> int:
        return self.estimate.bytes_per_device


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica sits.

    Attributes:
        gpu_indices: CUDA indices on the node, ascending; empty on a CPU node.
        memory_bytes_per_device: bytes reserved on each device (host memory on a CPU node).
        memory_fraction: the share of each device's memory the engine is started with
            (`--gpu-memory-utilization`), rounded DOWN to 4 digits so the engine never takes
            more than was reserved.
        kv_cache_bytes: the KV budget per device the sizing assumed (a CPU engine's KV size).
        free_before_bytes: free bytes on the tightest chosen device before this replica (the
            best-fit evidence); `spread_rank`: this replica is the n-th of its deployment on
            the node.
    """

    replica_id: str
    deployment_id: str
    revision: str
    node: str
    accelerator: Accelerator
    gpu_indices: tuple[int, ...]
    memory_bytes_per_device: int
    memory_fraction: float
    kv_cache_bytes: int
    decision: Decision = Decision.PLACED
    free_before_bytes: int = 0
    spread_rank: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Unplaced:
    """A replica that cannot be placed now, and exactly why (a sentence with the numbers)."""

    replica_id: str
    deployment_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementPlan:
    """The outcome of placing a catalogue on a fleet; both tuples sorted by replica id."""

    placements: tuple[Placement, ...]
    unplaced: tuple[Unplaced, ...]
    policy: str

    def of(self, deployment_id: str) -> tuple[tuple[Placement, ...], tuple[Unplaced, ...]]:
        """The placements and unplaced replicas of one deployment."""
        return (
            tuple(p for p in self.placements if p.deployment_id == deployment_id),
            tuple(u for u in self.unplaced if u.deployment_id == deployment_id),
        )


def memory_fraction(reserved: int, capacity: int) -> float:
    """`reserved / capacity` rounded down to 4 digits (an engine never exceeds its share)."""
    scale = 10**FRACTION_DIGITS
    return math.floor(reserved * scale / capacity) / scale


class Slot:
    """One device: `capacity` and `free` bytes. Mutable, owned by one `Ledger`."""

    __slots__ = ("capacity", "free", "index")

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index  # GPU index; -1 for a CPU node's host memory
        self.capacity = capacity
        self.free = capacity


class NodeSlots:
    """The slots of one schedulable node; `rank` is its position in name order, `positions`
    maps a slot's device index (-1 for host memory) to its position in `slots`."""

    __slots__ = ("accelerator", "name", "positions", "rank", "slots")

    def __init__(self, name: str, rank: int, accelerator: Accelerator, slots: list[Slot]) -> None:
        self.name = name
        self.rank = rank
        self.accelerator = accelerator
        self.slots = slots  # GPU slots in index order, or the one host-memory slot
        self.positions = {slot.index: pos for pos, slot in enumerate(slots)}


class Ledger:
    """Free memory per device of the schedulable nodes, in node-name order.

    Raises (reserve): ValueError when a reservation would exceed a slot's free bytes, so an
    oversubscription is a loud bug, never a silent one.
    """

    def __init__(self, nodes: Sequence[NodeSlots]) -> None:
        self.nodes = list(nodes)
        self.by_name = {n.name: n for n in self.nodes}

    def reserve(
        self, node: NodeSlots, slot_positions: Sequence[int], bytes_per_device: int
    ) -> None:
        for pos in slot_positions:
            slot = node.slots[pos]
            if bytes_per_device > slot.free:
                raise ValueError(
                    f"oversubscription: {bytes_per_device} B on {node.name} slot {slot.index} "
                    f"with {slot.free} B free"
                )
        for pos in slot_positions:
            node.slots[pos].free -= bytes_per_device


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyResult:
    """What a policy decided: new placements, and the requests it could not place."""

    placements: tuple[Placement, ...]
    unplaced: tuple[ReplicaRequest, ...]


class PlacementPolicy(Protocol):
    """Places replica requests on a ledger (mutating it). Must be deterministic.

    `counts[(deployment_id, node)]` holds how many replicas of a deployment already sit on a
    node (kept placements), for spreading; policies update it as they place.
    """

    name: str

    def place(
        self,
        requests: Sequence[ReplicaRequest],
        ledger: Ledger,
        counts: dict[tuple[str, str], int],
    ) -> PolicyResult: ...


def make_placement(
    request: ReplicaRequest,
    node: NodeSlots,
    slot_positions: Sequence[int],
    *,
    decision: Decision,
    free_before: int,
    spread_rank: int,
) -> Placement:
    """The `Placement` value for `request` on `node`'s slots (which must be reserved)."""
    slots = [node.slots[p] for p in slot_positions]
    capacity = min(s.capacity for s in slots)
    est = request.estimate
    return Placement(
        replica_id=request.replica_id,
        deployment_id=request.deployment_id,
        revision=request.revision,
        node=node.name,
        accelerator=node.accelerator,
        gpu_indices=tuple(sorted(s.index for s in slots))
        if node.accelerator is Accelerator.GPU
        else (),
        memory_bytes_per_device=est.bytes_per_device,
        memory_fraction=memory_fraction(est.bytes_per_device, capacity),
        kv_cache_bytes=est.kv_cache_bytes_per_device,
        decision=decision,
        free_before_bytes=free_before,
        spread_rank=spread_rank,
    )

"""Planning: from the desired catalogue, the fleet and the previous placements to a new plan.

1. Every desired replica (`{deployment}-{ordinal}`, ordinal < replicas) gets a request sized by
   `catalog.sizing.estimate`.
2. A previous placement is kept when its node is still Ready and schedulable, its devices are
   still placeable, and the (possibly new) demand still fits there: placements are stable, a
   replica moves only when it must. Kept placements are applied in (deployment id, ordinal)
   order. After a node is lost, only its replicas reach the policy: every other placement is
   kept as the same value.
3. The policy places the rest on what is left (`Ledger`).
4. Each replica that stays unplaced gets the exact reason (`diagnose`), computed once per
   deployment against the final ledger.

`static_fit_error` answers the create-time question "could one replica ever fit this fleet,
empty?", with the numbers and the tensor parallel size that would fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter

from inferplane.orchestrator.catalog.model import Accelerator, Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.sizing import (
    MemoryEstimate,
    SizingPolicy,
    estimate,
    human_bytes,
)
from inferplane.orchestrator.fleet.model import Node, NodeCondition
from inferplane.orchestrator.placement.capabilities import (
    Needs,
    eligible_nodes,
    summarize_lacks,
)
from inferplane.orchestrator.placement.model import (
    Decision,
    Ledger,
    NodeSlots,
    Placement,
    PlacementPlan,
    PlacementPolicy,
    ReplicaRequest,
    Slot,
    Unplaced,
    make_placement,
)


def build_ledger(nodes: Iterable[Node], sizing: SizingPolicy) -> Ledger:
    """Empty slots of the schedulable nodes, in name order (rank = position)."""
    ledger_nodes: list[NodeSlots] = []
    for rank, node in enumerate(sorted((n for n in nodes if n.schedulable), key=lambda n: n.name)):
        if node.accelerator is Accelerator.GPU:
            slots = [Slot(g.index, g.memory_bytes) for g in node.placeable_gpus()]
        else:
            slots = [Slot(-1, cpu_capacity(node, sizing))]
        ledger_nodes.append(NodeSlots(node.name, rank, node.accelerator, slots))
    return Ledger(ledger_nodes)


def cpu_capacity(node: Node, sizing: SizingPolicy) -> int:
    """Bytes of a CPU node's host memory replicas may reserve."""
    return int(node.memory_bytes * sizing.cpu_usable_memory_fraction)


def plan(
    deployments: Iterable[Deployment],
    nodes: Sequence[Node],
    previous: Mapping[str, Placement],
    policy: PlacementPolicy,
    sizing: SizingPolicy,
) -> PlacementPlan:
    """The placement plan (deterministic for equal inputs; see the module docstring).

    Cost: one pass over the desired replicas keeps the previous placements that still fit (a
    few look-ups and a ledger reservation each), then the policy places the rest only: a
    re-plan after one node of 10,000 is lost places just that node's replicas
    (`bench/placement_scale.py`).
    """
    ledger = build_ledger(nodes, sizing)
    counts: dict[tuple[str, str], int] = {}
    kept: list[Placement] = []
    to_place: list[ReplicaRequest] = []
    needs_of: dict[str, Needs] = {}
    for deployment in sorted(deployments, key=attrgetter("deployment_id")):
        est = estimate(deployment.profile, sizing)
        needs = needs_of[deployment.deployment_id] = Needs.of(deployment.profile)
        eligible = eligible_nodes(needs, nodes)
        on_node: dict[str, int] = {}  # this deployment's kept replicas per node
        for ordinal, replica_id in enumerate(deployment.replica_ids()):
            before = previous.get(replica_id)
            placement = (
                None
                if before is None or not _still_capable(before, needs, eligible, nodes)
                else _keep(before, deployment, est, ordinal, ledger, on_node)
            )
            if placement is None:
                to_place.append(
                    ReplicaRequest(
                        replica_id,
                        deployment.deployment_id,
                        ordinal,
                        deployment.revision,
                        est,
                        eligible,
                    )
                )
            else:
                kept.append(placement)
        for name, count in on_node.items():
            key = (deployment.deployment_id, name)
            counts[key] = counts.get(key, 0) + count
    result = policy.place(to_place, ledger, counts)
    reasons: dict[str, str] = {}
    unplaced: list[Unplaced] = []
    for request in result.unplaced:
        if request.deployment_id not in reasons:
            needs = needs_of[request.deployment_id]
            reasons[request.deployment_id] = diagnose(request, nodes, ledger, needs)
        unplaced.append(
            Unplaced(request.replica_id, request.deployment_id, reasons[request.deployment_id])
        )
    return PlacementPlan(
        placements=tuple(sorted((*kept, *result.placements), key=attrgetter("replica_id"))),
        unplaced=tuple(sorted(unplaced, key=attrgetter("replica_id"))),
        policy=policy.name,
    )


def _still_capable(
    previous: Placement, needs: Needs, eligible: frozenset[str] | None, nodes: Sequence[Node]
) -> bool:
    """Whether the previous placement's node may keep the replica: it can run `needs`, or it
    has not reported its engines yet (its replica stays until it does)."""
    if eligible is None or previous.node in eligible:
        return True
    node = next((n for n in nodes if n.name == previous.node), None)
    return node is not None and node.engines is None


def _keep(
    previous: Placement,
    deployment: Deployment,
    est: MemoryEstimate,
    ordinal: int,
    ledger: Ledger,
    on_node: dict[str, int],
) -> Placement | None:
    """Replica `ordinal` of `deployment` where `previous` put it, reserved on the ledger and
    counted in `on_node`: `previous` itself when nothing changed, a KEPT placement for a new
    revision or demand that still fits there, or None when it must move."""
    if previous.accelerator is not est.accelerator:
        return None
    node = ledger.by_name.get(previous.node)
    if node is None:  # gone, NotReady, draining or cordoned
        return None
    indices = previous.gpu_indices
    if node.accelerator is Accelerator.CPU:
        positions = [0]
    elif len(indices) == 1:  # the common case, without a comprehension
        positions = [node.positions.get(indices[0], -1)]
    else:
        positions = [node.positions.get(i, -1) for i in indices]
    if -1 in positions:  # that GPU is gone, unhealthy or partitioned now
        return None
    need = est.bytes_per_device
    slots = node.slots
    if len(positions) != est.devices or min([slots[p].free for p in positions]) < need:
        return None
    ledger.reserve(node, positions, need)
    count = on_node.get(node.name, 0) + 1
    on_node[node.name] = count
    if previous.revision == deployment.revision and previous.memory_bytes_per_device == need:
        return previous
    request = ReplicaRequest(
        previous.replica_id, deployment.deployment_id, ordinal, deployment.revision, est
    )
    return make_placement(
        request,
        node,
        positions,
        decision=Decision.KEPT,
        free_before=min([slots[p].free for p in positions]) + need,
        spread_rank=count,
    )


def diagnose(
    request: ReplicaRequest, nodes: Sequence[Node], ledger: Ledger, wanted: Needs | None = None
) -> str:
    """Exactly why `request` cannot be placed now: node counts by cause (nodes that lack the
    engine or a capability `wanted` asks for first, naming what each lacks), and the closest
    node."""
    est = request.estimate
    devices, need = est.devices, est.bytes_per_device
    gpu = est.accelerator is Accelerator.GPU
    kind = "GPU" if gpu else "CPU"
    if gpu:
        needs = f"needs {devices} GPU{'s' if devices > 1 else ''} with {human_bytes(need)} free"
        needs += " each on one node" if devices > 1 else ""
    else:
        needs = f"needs {human_bytes(need)} of host memory on a CPU node"
    head = f"{needs} ({est.describe()})"
    candidates = sorted(
        (n for n in nodes if n.accelerator is est.accelerator), key=lambda n: n.name
    )
    if not candidates:
        return f"{head}; no {kind} node is registered"
    parts = []
    if wanted is not None and request.eligible is not None:
        lacking = [n for n in candidates if n.name not in request.eligible]
        count, shown = summarize_lacks(wanted, lacking)
        if count:
            parts.append(f"{count} lack what it needs ({wanted.describe()}): {shown}")
        candidates = [n for n in candidates if n.name in request.eligible]
    not_ready = draining = too_few = too_small = full = 0
    closest: tuple[int, int, str] | None = None  # (-fitting devices, -kth free, node)
    for node in candidates:
        if node.condition is NodeCondition.NOT_READY:
            not_ready += 1
            continue
        if not node.schedulable:
            draining += 1
            continue
        slots = ledger.by_name[node.name].slots
        if len(slots) < devices:
            too_few += 1
            continue
        capacities = sorted((s.capacity for s in slots), reverse=True)
        if capacities[devices - 1] < need:
            too_small += 1
            continue
        full += 1
        frees = sorted((s.free for s in slots), reverse=True)
        fitting = sum(1 for f in frees if f >= need)
        key = (-fitting, -frees[devices - 1], node.name)
        if closest is None or key < closest:
            closest = key
    if not_ready:
        parts.append(f"{not_ready} NotReady")
    if draining:
        parts.append(f"{draining} draining or unschedulable")
    if too_few:
        parts.append(f"{too_few} have fewer than {devices} placeable GPUs")
    if too_small:
        what = "GPUs" if gpu else "usable host memory"
        parts.append(f"{too_small} have {what} smaller than {human_bytes(need)}")
    if full and closest is not None:
        fitting, kth_free, name = -closest[0], -closest[1], closest[2]
        if gpu:
            detail = (
                f"closest: {name} has {fitting} GPU{'s' if fitting != 1 else ''} with "
                f"≥ {human_bytes(need)} free"
            )
            if devices > 1:
                detail += f", its {_ordinal(devices)}-freest GPU has {human_bytes(kth_free)}"
            else:
                detail += f"; its freest GPU has {human_bytes(kth_free)}"
        else:
            detail = f"closest: {name} has {human_bytes(kth_free)} free"
        parts.append(f"{full} lack free memory ({detail})")
    total = sum(1 for n in nodes if n.accelerator is est.accelerator)
    return f"{head}; 0 of {total} {kind} nodes can host it: " + ", ".join(parts)


def static_fit_error(
    profile: DeploymentProfile, nodes: Sequence[Node], sizing: SizingPolicy
) -> str | None:
    """Why one replica could never fit the fleet even if it were empty, or None.

    Only nodes of the replica's accelerator kind count (any condition: a NotReady node may come
    back). With no such node registered yet the answer is None (placement will say so).
    """
    est = estimate(profile, sizing)
    if est.accelerator is Accelerator.CPU:
        cpu_nodes = [n for n in nodes if n.accelerator is Accelerator.CPU]
        if not cpu_nodes:
            return None
        best = min(cpu_nodes, key=lambda n: (-cpu_capacity(n, sizing), n.name))
        if est.bytes_per_device <= cpu_capacity(best, sizing):
            return None
        share = round(sizing.cpu_usable_memory_fraction * 100)
        usable = human_bytes(cpu_capacity(best, sizing))
        return (
            f"{est.describe()}; the largest CPU node offers {usable}"
            f" ({share}% of {human_bytes(best.memory_bytes)} on {best.name})"
        )
    gpu_nodes = [n for n in nodes if n.accelerator is Accelerator.GPU]
    if not gpu_nodes:
        return None
    devices = est.devices
    shapes = [
        (sorted((g.memory_bytes for g in n.placeable_gpus()), reverse=True), n) for n in gpu_nodes
    ]
    max_gpus = max(len(caps) for caps, _ in shapes)
    if max_gpus < devices:
        biggest = min(shapes, key=lambda s: (-len(s[0]), s[1].name))[1]
        return (
            f"{est.describe()}; TP={devices} needs {devices} GPUs on one node but the largest "
            f"node offers {max_gpus} placeable GPUs ({biggest.name})"
        )
    allows = max(caps[devices - 1] for caps, _ in shapes if len(caps) >= devices)
    if est.bytes_per_device <= allows:
        return None
    caps, group = min(shapes, key=lambda s: (-sum(s[0]), s[1].name))
    offer = (
        f"the largest GPU group on one node offers {human_bytes(sum(caps))} "
        f"({len(caps)} × {human_bytes(caps[0])} on {group.name}) but TP={devices} allows "
        f"{human_bytes(allows)}"
    )
    return f"{est.describe()}; {offer}; {_suggest(profile, shapes, sizing)}"


def _suggest(
    profile: DeploymentProfile, shapes: list[tuple[list[int], Node]], sizing: SizingPolicy
) -> str:
    tp = profile.tensor_parallel_size or 1
    max_gpus = max(len(caps) for caps, _ in shapes)
    candidate = tp * 2
    while candidate <= max_gpus:
        heads = profile.num_kv_heads
        if heads and (heads % candidate == 0 or candidate % heads == 0):
            trial = estimate(dataclasses.replace(profile, tensor_parallel_size=candidate), sizing)
            allows = max(
                (caps[candidate - 1] for caps, _ in shapes if len(caps) >= candidate), default=0
            )
            if trial.bytes_per_device <= allows:
                return (
                    f"tensor_parallel_size={candidate} would need "
                    f"{human_bytes(trial.bytes_per_device)} per GPU and fits"
                )
        candidate *= 2
    return (
        f"no tensor parallel size up to {max_gpus} fits: use a smaller precision, fewer "
        "max_num_seqs or a shorter expected context"
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def estimate_for(deployment: Deployment, sizing: SizingPolicy) -> MemoryEstimate:
    """`estimate(deployment.profile, sizing)` (a convenience for callers holding a deployment)."""
    return estimate(deployment.profile, sizing)

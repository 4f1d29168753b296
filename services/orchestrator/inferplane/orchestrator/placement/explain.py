"""Human explanations of a deployment's placement: one line per replica, with the numbers.

Example (a TP8 replica on a DGX B200 node):

    kimi-k2-5-0 → b200-0001 GPUs 0-7: 147.7 GB per GPU = 0.8205 of 180 GB (engine started with
    --gpu-memory-utilization 0.8205); best fit: the tightest chosen GPU had 180 GB free and keeps
    32.3 GB; spread: 1st replica of kimi-k2-5 on b200-0001
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from inferplane.orchestrator.catalog.model import Accelerator, Deployment
from inferplane.orchestrator.catalog.sizing import MemoryEstimate, SizingPolicy, human_bytes
from inferplane.orchestrator.fleet.model import Node
from inferplane.orchestrator.placement.model import Decision, Placement, Unplaced
from inferplane.orchestrator.placement.planner import cpu_capacity


def gpu_ranges(indices: Sequence[int]) -> str:
    """(0, 1, 2, 3, 6) → "0-3,6"."""
    parts: list[str] = []
    start = prev = None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif prev is not None and i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def explain_placement(p: Placement, nodes: Mapping[str, Node], sizing: SizingPolicy) -> str:
    """Why replica `p` sits where it does, with its memory share and the best-fit evidence."""
    node = nodes.get(p.node)
    reserved = human_bytes(p.memory_bytes_per_device)
    if p.accelerator is Accelerator.CPU:
        capacity = cpu_capacity(node, sizing) if node else 0
        where = f"{p.replica_id} → {p.node} (CPU node)"
        share = (
            f"{reserved} of host memory = {p.memory_fraction:g} of {human_bytes(capacity)} usable"
            f"; engine KV cache {human_bytes(p.kv_cache_bytes)}"
        )
    else:
        gpu = {g.index: g for g in node.gpus}.get(p.gpu_indices[0]) if node else None
        capacity = gpu.memory_bytes if gpu else 0
        plural = "GPUs" if len(p.gpu_indices) > 1 else "GPU"
        where = f"{p.replica_id} → {p.node} {plural} {gpu_ranges(p.gpu_indices)}"
        share = (
            f"{reserved} per GPU = {p.memory_fraction:g} of {human_bytes(capacity)} "
            f"(engine started with --gpu-memory-utilization {p.memory_fraction:g})"
        )
    if p.decision is Decision.KEPT:
        why = "kept where it was: it still fits, and replicas move only when they must"
    else:
        device = "device" if p.accelerator is Accelerator.CPU else "chosen GPU"
        why = (
            f"best fit: the tightest {device} had {human_bytes(p.free_before_bytes)} free and "
            f"keeps {human_bytes(p.free_before_bytes - p.memory_bytes_per_device)}"
        )
    spread = f"spread: {_ordinal(p.spread_rank)} replica of {p.deployment_id} on {p.node}"
    return f"{where}: {share}; {why}; {spread}"


def explain_deployment(
    deployment: Deployment,
    estimate: MemoryEstimate,
    placements: Sequence[Placement],
    unplaced: Sequence[Unplaced],
    nodes: Mapping[str, Node],
    sizing: SizingPolicy,
    policy: str,
) -> list[str]:
    """A header line (what one replica needs, how many are placed) then one line per replica
    in replica-id order."""
    header = (
        f"{deployment.name} (revision {deployment.revision}, policy {policy}): "
        f"{deployment.replicas} replica{'s' if deployment.replicas != 1 else ''} wanted, "
        f"{len(placements)} placed, {len(unplaced)} unplaced; each replica: {estimate.describe()}"
    )
    lines: list[tuple[str, str]] = [
        (p.replica_id, explain_placement(p, nodes, sizing)) for p in placements
    ]
    lines += [(u.replica_id, f"{u.replica_id} cannot be placed: {u.reason}") for u in unplaced]
    return [header, *(line for _, line in sorted(lines, key=_replica_order))]


def _replica_order(item: tuple[str, str]) -> tuple[str, int]:
    base, _, ordinal = item[0].rpartition("-")
    return (base, int(ordinal)) if ordinal.isdigit() else (item[0], 0)

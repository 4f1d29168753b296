"""Placement at fleet scale: a realistic catalogue on 10 to 10,000 simulated DGX B200 nodes.

Fleet: N nodes `b200-NNNNN`, each 8 GPUs × 180 GB (DGX B200: 1,440 GB of HBM3e per node).
Catalogue (architecture numbers from each model's config.json; replica counts per 10 nodes,
scaled linearly with the fleet: 26,700 replicas on 1,000 nodes, 267,000 on 10,000):

| deployment | params (total/active) | precision | TP | seqs × context | per 10 nodes |
|---|---|---|---|---|---|
| kimi-k2.5 | 1T / 32B (MoE, MLA) | int4 (GPTQ-style) | 8 | 64 × 16k | 1 |
| gpt-oss-120b | 117B / 5.1B (MoE) | nvfp4 (MXFP4 stand-in) | 1 | 128 × 8k | 6 |
| llama-3.3-70b | 70.6B | fp8, fp8 KV | 1 | 64 × 8k | 8 |
| qwen3-32b | 32.8B | bf16 | 1 | 32 × 4k | 12 |
| llama-3.1-8b, qwen2.5-7b, mistral-7b, qwen3-8b | 7–8B | bf16/fp8 | 1 | 8–16 × 4–8k | 24–36 |
| qwen3-embedding-8b/-0.6b, bge-m3 | 0.6–7.6B | bf16/fp16 | 1 | 32 × 0.5–1k | 12–48 |

The 7–8B models and the embedding models take 3–20 % of a GPU each: they share GPUs (among
themselves and with the holes the large models leave) with explicit memory fractions.

Measured, per fleet size:

- `placement_seconds` = wall time of one full `plan()` (sizing, ledger, policy, diagnosis) on
  an empty fleet, best of 3 (GC off while timed); the plan must be identical on every run
  (determinism). `replicas placed` out of wanted.
- `replace_after_node_loss_seconds` = wall time of the `plan()` the control plane makes when
  one node turns NotReady (the node holding the most replicas, ties by name), with the full
  plan as the previous placements, best of 3. The bench exits with an error unless exactly
  that node's replicas moved (every other placement is the identical value), all of them
  were placed again and no GPU holds more than its memory.
- Packing efficiency = L / U where U = GPUs holding at least one replica and
  L = Σ reserved bytes of the placed replicas / 180 GB, the continuous lower bound on the
  number of GPUs any placement of those replicas needs (Martello & Toth's L1 bound for bin
  packing, "Lower bounds and reduction procedures for the bin packing problem", 1990). 1.0
  means every used GPU is full.

Goals (issue #20): at 10,000 nodes, placement < 2 s and packing efficiency ≥ 0.97.

Run: `.venv/bin/python bench/placement_scale.py` (needs the editable install; ~30 s, most of
it at 10,000 nodes). Last lines: `placement_seconds_1000_nodes: X`,
`packing_efficiency_1000_nodes: Y`, `replace_after_node_loss_seconds_10000_nodes: Z`,
`placement_seconds_10000_nodes: X` and `packing_efficiency_10000_nodes: Y`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.sizing import GB, SizingPolicy, estimate
from inferplane.orchestrator.fleet.model import Gpu, Node, NodeCondition
from inferplane.orchestrator.placement.best_fit import BestFitSpreadPolicy
from inferplane.orchestrator.placement.model import Placement, PlacementPlan
from inferplane.orchestrator.placement.planner import plan

GPU_BYTES = 180 * GB
GPUS_PER_NODE = 8
B = 10**9


def _profile(
    params: float,
    precision: str,
    layers: int,
    kv_heads: int,
    head_dim: int,
    seqs: int,
    context: int,
    *,
    tp: int = 1,
    active: float = 0,
    kv: str = "auto",
    max_len: int = 0,
) -> DeploymentProfile:
    return DeploymentProfile(
        model_source="hub",
        precision=precision,
        parameter_count=int(params),
        active_parameter_count=int(active),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_cache_dtype=kv,
        tensor_parallel_size=tp,
        max_model_len=max_len or context,
        max_num_seqs=seqs,
        expected_context_tokens=context,
    )


# (deployment id, profile, replicas per 10 nodes)
CATALOGUE: tuple[tuple[str, DeploymentProfile, int], ...] = (
    # MLA: 576-element latent per token per layer → kv_heads=1, head_dim=288.
    (
        "kimi-k2.5",
        _profile(1000 * B, "int4-gptq", 61, 1, 288, 64, 16384, tp=8, active=32 * B, max_len=262144),
        1,
    ),
    (
        "gpt-oss-120b",
        _profile(116.8 * B, "nvfp4", 36, 8, 64, 128, 8192, active=5.1 * B, max_len=131072),
        6,
    ),
    ("llama-3.3-70b", _profile(70.6 * B, "fp8", 80, 8, 128, 64, 8192, kv="fp8", max_len=131072), 8),
    ("qwen3-32b", _profile(32.8 * B, "bf16", 64, 8, 128, 32, 4096, max_len=32768), 12),
    ("llama-3.1-8b", _profile(8.03 * B, "bf16", 32, 8, 128, 16, 8192), 36),
    ("qwen2.5-7b", _profile(7.62 * B, "bf16", 28, 4, 128, 16, 8192), 36),
    ("mistral-7b", _profile(7.25 * B, "bf16", 32, 8, 128, 8, 8192), 24),
    ("qwen3-8b", _profile(8.19 * B, "fp8", 36, 8, 128, 16, 4096), 36),
    ("qwen3-embedding-8b", _profile(7.57 * B, "bf16", 36, 8, 128, 32, 1024), 12),
    ("qwen3-embedding-0.6b", _profile(0.6 * B, "bf16", 28, 8, 128, 32, 1024), 48),
    ("bge-m3", _profile(0.568 * B, "fp16", 24, 16, 64, 32, 512), 48),
)


def fleet(nodes: int) -> list[Node]:
    return [
        Node(
            name=f"b200-{i:05d}",
            address=f"10.0.{i // 250}.{i % 250}:50052",
            gpus=tuple(
                Gpu(index=g, memory_bytes=GPU_BYTES, model="NVIDIA B200")
                for g in range(GPUS_PER_NODE)
            ),
            cpu_count=224,
            memory_bytes=2 * 10**12,
        )
        for i in range(nodes)
    ]


def catalogue(nodes: int) -> list[Deployment]:
    scale = nodes / 10
    return [
        Deployment(
            deployment_id=name, profile=profile, replicas=max(1, round(per10 * scale))
        ).normalised()
        for name, profile, per10 in CATALOGUE
    ]


def packing_efficiency(result: PlacementPlan) -> tuple[float, int, float]:
    """(L / U, U, L): see the module docstring."""
    used = {(p.node, i) for p in result.placements for i in p.gpu_indices}
    reserved = sum(p.memory_bytes_per_device * len(p.gpu_indices) for p in result.placements)
    lower = reserved / GPU_BYTES
    return (lower / len(used) if used else 0.0), len(used), lower


def timed(call: Callable[[], PlacementPlan], repeats: int) -> tuple[float, PlacementPlan]:
    """Best wall time of `repeats` calls (GC off while timed) and the plan, which must be the
    same every time."""
    times: list[float] = []
    first: PlacementPlan | None = None
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
        gc.enable()
        if first is None:
            first = result
        elif result != first:
            raise SystemExit("placement is not deterministic: two runs gave different plans")
    assert first is not None
    return min(times), first


def check_capacity(result: PlacementPlan) -> None:
    """Exits unless every GPU holds at most its memory."""
    used: dict[tuple[str, int], int] = defaultdict(int)
    for p in result.placements:
        for i in p.gpu_indices:
            used[(p.node, i)] += p.memory_bytes_per_device
    over = [key for key, total in used.items() if total > GPU_BYTES]
    if over:
        raise SystemExit(f"over-committed GPUs: {over[:5]}")


def lose_busiest_node(
    fleet_nodes: Sequence[Node],
    deployments: Sequence[Deployment],
    before: PlacementPlan,
    repeats: int,
) -> tuple[float, str, int]:
    """Re-plans with the node holding the most replicas NotReady; checks that exactly its
    replicas moved. Returns (best seconds, node, replicas moved)."""
    per_node = Counter(p.node for p in before.placements)
    lost = min(per_node, key=lambda name: (-per_node[name], name))
    nodes = [
        dataclasses.replace(n, condition=NodeCondition.NOT_READY) if n.name == lost else n
        for n in fleet_nodes
    ]
    previous: dict[str, Placement] = {p.replica_id: p for p in before.placements}
    sizing, policy = SizingPolicy(), BestFitSpreadPolicy()
    seconds, after = timed(lambda: plan(deployments, nodes, previous, policy, sizing), repeats)
    moved = {p.replica_id for p in after.placements if previous.get(p.replica_id) != p}
    on_lost = {p.replica_id for p in before.placements if p.node == lost}
    if moved != on_lost or len(after.placements) != len(before.placements):
        raise SystemExit(
            f"losing {lost} moved {len(moved)} replicas, {len(moved - on_lost)} of them from "
            f"healthy nodes; {len(before.placements) - len(after.placements)} left unplaced"
        )
    if any(p.node == lost for p in after.placements):
        raise SystemExit(f"a replica is still placed on the lost node {lost}")
    check_capacity(after)
    return seconds, lost, len(moved)


def run(nodes: int, repeats: int) -> tuple[float, float, float]:
    """(placement seconds, packing efficiency, re-placement seconds) for `nodes` nodes."""
    fleet_nodes = fleet(nodes)
    deployments = catalogue(nodes)
    wanted = sum(d.replicas for d in deployments)
    sizing, policy = SizingPolicy(), BestFitSpreadPolicy()
    seconds, first = timed(lambda: plan(deployments, fleet_nodes, {}, policy, sizing), repeats)
    check_capacity(first)
    efficiency, used, lower = packing_efficiency(first)
    demand = sum(estimate(d.profile, sizing).total_bytes * d.replicas for d in deployments)
    print(
        f"{nodes:>5} nodes ({nodes * GPUS_PER_NODE} GPUs): placed {len(first.placements)}/{wanted} "
        f"replicas in {seconds:.3f} s (best of {repeats}); demand "
        f"{demand / (nodes * GPUS_PER_NODE * GPU_BYTES):.1%} of fleet memory; GPUs used {used}, "
        f"lower bound {lower:.1f}; packing efficiency {efficiency:.4f}"
    )
    if first.unplaced:
        print(f"      unplaced: {first.unplaced[0].replica_id}: {first.unplaced[0].reason}")
    replace, lost, moved = lose_busiest_node(fleet_nodes, deployments, first, repeats)
    print(
        f"      {lost} lost: its {moved} replicas placed elsewhere, nothing else moved, in "
        f"{replace:.3f} s (best of {repeats})"
    )
    return seconds, efficiency, replace


def main() -> None:
    sizing = SizingPolicy()
    print("per-replica memory (GB per GPU × GPUs):")
    for name, profile, per10 in CATALOGUE:
        est = estimate(profile, sizing)
        print(f"  {name:<22} {est.bytes_per_device / GB:7.1f} × {est.devices}  ({per10}/10 nodes)")
    results = {n: run(n, 3) for n in (10, 100, 1000, 10000)}
    seconds, efficiency, _ = results[1000]
    print(f"placement_seconds_1000_nodes: {seconds:.3f}")
    print(f"packing_efficiency_1000_nodes: {efficiency:.4f}")
    seconds, efficiency, replace = results[10000]
    print(f"replace_after_node_loss_seconds_10000_nodes: {replace:.3f}")
    print(f"placement_seconds_10000_nodes: {seconds:.3f}")
    print(f"packing_efficiency_10000_nodes: {efficiency:.4f}")


if __name__ == "__main__":
    main()

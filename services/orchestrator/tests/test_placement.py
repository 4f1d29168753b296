"""Placement: determinism, spread, tensor parallel on one node, fractional sharing that never
oversubscribes, exclusions, CPU nodes, stability, and the unplaceable reasons."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.sizing import GB, SizingPolicy, estimate
from inferplane.orchestrator.fleet.model import Gpu, GpuPartition, Node, NodeCondition
from inferplane.orchestrator.placement.best_fit import BestFitSpreadPolicy
from inferplane.orchestrator.placement.model import Decision, PlacementPlan
from inferplane.orchestrator.placement.planner import plan
from inferplane.orchestrator.placement.registry import build_policy, default_policies
from inferplane.runtime import ConfigError

SIZING = SizingPolicy()
POLICY = BestFitSpreadPolicy()


def profile(
    params: int, *, tp: int = 1, seqs: int = 8, ctx: int = 4096, **kw: object
) -> DeploymentProfile:
    values: dict[str, object] = dict(
        model_source="m",
        precision="bf16",
        parameter_count=params,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        tensor_parallel_size=tp,
        max_model_len=ctx,
        max_num_seqs=seqs,
    )
    values.update(kw)
    return DeploymentProfile(**values)  # type: ignore[arg-type]


def dep(name: str, prof: DeploymentProfile, replicas: int = 1) -> Deployment:
    return Deployment(name, prof, replicas=replicas).normalised()


def node(name: str, gpus: int = 8, memory: int = 80 * GB, **kw: object) -> Node:
    return Node(name=name, gpus=tuple(Gpu(i, memory) for i in range(gpus)), **kw)  # type: ignore[arg-type]


def place(
    deployments: list[Deployment], nodes: list[Node], previous: dict | None = None
) -> PlacementPlan:
    return plan(deployments, nodes, previous or {}, POLICY, SIZING)


SMALL = profile(1_000_000_000)  # 2 GB weights + 4.3 GB KV + 2.5 GB overhead ≈ 8.8 GB


def test_same_input_same_plan_whatever_the_input_order() -> None:
    deployments = [dep("a", SMALL, 5), dep("b", profile(8_000_000_000), 3), dep("c", SMALL, 7)]
    nodes = [node(f"n{i}", gpus=2) for i in range(4)]
    first = place(deployments, nodes)
    again = place(list(reversed(deployments)), list(reversed(nodes)))
    assert first == again
    assert len(first.placements) == 15


def test_replicas_of_a_deployment_spread_across_nodes() -> None:
    result = place([dep("a", SMALL, 4)], [node(f"n{i}") for i in range(4)])
    assert sorted(p.node for p in result.placements) == ["n0", "n1", "n2", "n3"]
    assert {p.spread_rank for p in result.placements} == {1}


def test_tensor_parallel_replica_spans_aligned_contiguous_gpus_of_one_node() -> None:
    big = profile(70_000_000_000, tp=4, num_layers=80)
    # n0: GPU 1 is unhealthy, so no aligned window 0-3 there; 4-7 is the first aligned window.
    broken = Node(name="n0", gpus=tuple(Gpu(i, 80 * GB, healthy=i != 1) for i in range(8)))
    result = place([dep("big", big, 2)], [broken, node("n1")])
    by_node = {p.node: p.gpu_indices for p in result.placements}
    assert by_node == {"n0": (4, 5, 6, 7), "n1": (0, 1, 2, 3)}
    need = estimate(big, SIZING).bytes_per_device
    assert all(p.memory_bytes_per_device == need for p in result.placements)


def test_fractional_replicas_share_a_gpu_with_fractions_that_add_up_to_at_most_one() -> None:
    result = place([dep("a", SMALL, 7)], [node("n0", gpus=1, memory=60 * GB)])
    assert len(result.placements) == 6 and len(result.unplaced) == 1  # 6 × 8.8 GB ≤ 60 GB
    assert {p.gpu_indices for p in result.placements} == {(0,)}
    assert sum(p.memory_bytes_per_device for p in result.placements) <= 60 * GB
    assert sum(p.memory_fraction for p in result.placements) <= 1.0
    p = result.placements[0]
    assert p.memory_fraction == int(p.memory_bytes_per_device * 10_000 / (60 * GB)) / 10_000


def test_notready_unschedulable_unhealthy_and_mig_capacity_is_never_used() -> None:
    mig = Gpu(0, 80 * GB, partitions=(GpuPartition("MIG-1", "3g.40gb", 40 * GB),))
    nodes = [
        node("down", condition=NodeCondition.NOT_READY),
        node("cordoned", unschedulable=True, condition=NodeCondition.DRAINING),
        Node(name="sick", gpus=(Gpu(0, 80 * GB, healthy=False), mig)),
        node("ok", gpus=1),
    ]
    result = place([dep("a", SMALL, 20)], nodes)
    assert {p.node for p in result.placements} == {"ok"}
    assert result.unplaced  # 20 × 8.8 GB > 80 GB
    reason = result.unplaced[0].reason
    assert "0 of 4 GPU nodes can host it: 1 NotReady, 1 draining or unschedulable, " in reason
    assert "1 have fewer than 1 placeable GPUs, 1 lack free memory (closest: ok has 0 GPUs" in (
        reason
    )


def test_cpu_replicas_go_to_cpu_nodes_and_gpu_replicas_never_do() -> None:
    tiny = profile(750_000, engine="vllm-cpu", precision="fp32", num_layers=2, head_dim=32)
    cpu = Node(name="laptop", cpu_count=2, memory_bytes=16 * GB)
    result = place([dep("tiny", tiny), dep("gpu-model", SMALL)], [cpu])
    (placed,) = result.placements
    assert (placed.replica_id, placed.node, placed.gpu_indices) == ("tiny-0", "laptop", ())
    # 8 sequences × 4,096 tokens × 4 KiB (2 layers × 8 KV heads × 32 × K and V × fp32): bytes
    assert placed.kv_cache_bytes == 8 * 4096 * 4096
    (unplaced,) = result.unplaced
    assert unplaced.replica_id == "gpu-model-0"
    assert unplaced.reason.endswith("; no GPU node is registered")


def test_placements_are_kept_when_the_fleet_grows_and_moved_off_a_lost_node() -> None:
    deployments = [dep("a", SMALL, 4)]
    first = place(deployments, [node("n0"), node("n1")])
    previous = {p.replica_id: p for p in first.placements}
    grown = place(deployments, [node("n0"), node("n1"), node("n2")], previous)
    assert grown.placements == first.placements  # nothing moves just because a node joined
    lost = place(
        deployments,
        [node("n0", condition=NodeCondition.NOT_READY), node("n1"), node("n2")],
        previous,
    )
    moved = {p.replica_id: p for p in lost.placements}
    for replica_id, before in previous.items():
        if before.node == "n1":
            assert moved[replica_id] == before
        else:
            assert moved[replica_id].node != "n0"
    assert not lost.unplaced


def test_a_grown_profile_is_kept_in_place_when_it_still_fits() -> None:
    first = place([dep("a", SMALL)], [node("n0")])
    bigger = dep("a", dataclasses.replace(SMALL, max_num_seqs=16))
    again = place([bigger], [node("n0")], {p.replica_id: p for p in first.placements})
    (p,) = again.placements
    assert (p.node, p.gpu_indices, p.decision) == ("n0", (0,), Decision.KEPT)
    assert p.revision == bigger.revision != first.placements[0].revision


def test_unknown_policy_lists_the_known_ones() -> None:
    try:
        build_policy("random", default_policies())
    except ConfigError as exc:
        assert str(exc) == "unknown placement policy 'random'; known: best_fit_spread"
    else:  # pragma: no cover
        raise AssertionError("expected ConfigError")


@st.composite
def fleets_and_catalogues(draw: st.DrawFn) -> tuple[list[Node], list[Deployment]]:
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        count = draw(st.integers(0, 8))
        gpus = tuple(
            Gpu(g, draw(st.sampled_from([24, 40, 80, 141])) * GB, healthy=draw(st.booleans()))
            for g in range(count)
        )
        memory = draw(st.integers(4, 64)) * GB
        nodes.append(Node(name=f"n{i}", gpus=gpus, memory_bytes=memory, cpu_count=4))
    deployments = []
    for j in range(draw(st.integers(1, 6))):
        tp = draw(st.sampled_from([1, 1, 1, 2, 4, 8]))
        cpu = tp == 1 and draw(st.integers(0, 4)) == 0
        deployments.append(
            dep(
                f"d{j}",
                profile(
                    draw(st.integers(100_000_000, 80_000_000_000)),
                    tp=tp,
                    seqs=draw(st.integers(1, 64)),
                    ctx=draw(st.sampled_from([512, 2048, 8192])),
                    precision=draw(st.sampled_from(["bf16", "fp8", "int4-awq", "nvfp4"])),
                    engine="vllm-cpu" if cpu else "vllm",
                ),
                draw(st.integers(1, 12)),
            )
        )
    return nodes, deployments


@settings(max_examples=150, deadline=None)
@given(fleets_and_catalogues())
def test_property_placement_never_oversubscribes_and_tp_stays_on_one_node(
    case: tuple[list[Node], list[Deployment]],
) -> None:
    nodes, deployments = case
    result = place(deployments, nodes)
    by_name = {n.name: n for n in nodes}
    used: dict[tuple[str, int], int] = defaultdict(int)
    fractions: dict[tuple[str, int], float] = defaultdict(float)
    wanted = {d.deployment_id: d for d in deployments}
    for p in result.placements:
        n = by_name[p.node]
        est = estimate(wanted[p.deployment_id].profile, SIZING)
        assert p.memory_bytes_per_device == est.bytes_per_device
        if n.gpus:
            assert len(p.gpu_indices) == est.devices == len(set(p.gpu_indices))
            healthy = {g.index for g in n.placeable_gpus()}
            assert set(p.gpu_indices) <= healthy
            for i in p.gpu_indices:
                used[(p.node, i)] += p.memory_bytes_per_device
                fractions[(p.node, i)] += p.memory_fraction
        else:
            assert p.gpu_indices == () and est.devices == 1
            used[(p.node, -1)] += p.memory_bytes_per_device
    for (name, index), total in used.items():
        n = by_name[name]
        capacity = (
            {g.index: g.memory_bytes for g in n.gpus}[index]
            if index >= 0
            else int(n.memory_bytes * SIZING.cpu_usable_memory_fraction)
        )
        assert total <= capacity
        if index >= 0:
            assert fractions[(name, index)] <= 1.0 + 1e-9
    assert len(result.placements) + len(result.unplaced) == sum(d.replicas for d in deployments)
    assert place(list(reversed(deployments)), list(reversed(nodes))) == result

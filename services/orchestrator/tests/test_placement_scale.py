"""Placement on a large fleet (issue #20): losing one node re-places exactly its replicas and
nothing else, through the planner and through the control plane's liveness sweep; the spread
caps never over-commit a GPU, and a node exceeds its soft spread cap only where that saves
opening an empty GPU."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence

from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.sizing import GB, SizingPolicy, estimate
from inferplane.orchestrator.control import ControlPlane
from inferplane.orchestrator.fleet.model import Gpu, Liveness, Node, NodeCondition
from inferplane.orchestrator.placement.best_fit import BestFitSpreadPolicy
from inferplane.orchestrator.placement.model import (
    Decision,
    Ledger,
    PlacementPlan,
    PolicyResult,
    ReplicaRequest,
)
from inferplane.orchestrator.placement.planner import plan
from inferplane.orchestrator.store.base import StateChange, StateSnapshot
from inferplane.testing.clock import FakeClock

SIZING = SizingPolicy()
GPU_BYTES = 180 * GB
NODES = 600
B = 10**9


def _profile(
    params: float, precision: str, layers: int, seqs: int, context: int, *, tp: int = 1
) -> DeploymentProfile:
    return DeploymentProfile(
        model_source="hub",
        precision=precision,
        parameter_count=int(params),
        num_layers=layers,
        num_kv_heads=8,
        head_dim=128,
        tensor_parallel_size=tp,
        max_model_len=context,
        max_num_seqs=seqs,
    )


# (deployment id, profile, replicas per 10 nodes): tensor parallel, whole-GPU and fractional
# replicas, like bench/placement_scale.py's catalogue.
CATALOGUE = (
    ("large-tp4", _profile(200 * B, "fp8", 60, 32, 8192, tp=4), 1),
    ("big", _profile(70 * B, "fp8", 80, 32, 8192), 8),
    ("mid", _profile(32 * B, "bf16", 64, 16, 4096), 12),
    ("small", _profile(8 * B, "bf16", 32, 16, 4096), 36),
    ("tiny", _profile(0.6 * B, "bf16", 28, 32, 1024), 48),
)


def fleet(nodes: int) -> list[Node]:
    return [
        Node(name=f"gpu-{i:04d}", gpus=tuple(Gpu(g, GPU_BYTES) for g in range(8)))
        for i in range(nodes)
    ]


def catalogue(nodes: int) -> list[Deployment]:
    return [
        Deployment(name, profile, replicas=per10 * nodes // 10).normalised()
        for name, profile, per10 in CATALOGUE
    ]


def used_bytes(result: PlacementPlan) -> dict[tuple[str, int], int]:
    used: dict[tuple[str, int], int] = defaultdict(int)
    for p in result.placements:
        for i in p.gpu_indices:
            used[(p.node, i)] += p.memory_bytes_per_device
    return used


def busiest(result: PlacementPlan) -> str:
    """The node holding the most replicas (ties: the first name)."""
    per_node = Counter(p.node for p in result.placements)
    return min(per_node, key=lambda name: (-per_node[name], name))


def lose(nodes: Sequence[Node], name: str) -> list[Node]:
    return [
        dataclasses.replace(n, condition=NodeCondition.NOT_READY) if n.name == name else n
        for n in nodes
    ]


class RecordingPolicy:
    """The real policy, recording the replica ids each `place` call is asked to place."""

    def __init__(self) -> None:
        self._inner = BestFitSpreadPolicy()
        self.name = self._inner.name
        self.asked: list[set[str]] = []

    def place(
        self,
        requests: Sequence[ReplicaRequest],
        ledger: Ledger,
        counts: dict[tuple[str, str], int],
    ) -> PolicyResult:
        self.asked.append({r.replica_id for r in requests})
        return self._inner.place(requests, ledger, counts)


class RecordingStore:
    """A `StateStore` in memory that keeps every committed change."""

    def __init__(self, snapshot: StateSnapshot) -> None:
        self._snapshot = snapshot
        self.changes: list[StateChange] = []

    def create_schema(self) -> None:
        pass

    def load(self) -> StateSnapshot:
        return self._snapshot

    def commit(self, change: StateChange) -> None:
        self.changes.append(change)

    def close(self) -> None:
        pass


def test_losing_one_node_re_places_exactly_its_replicas_and_keeps_every_other() -> None:
    """Invariant: after one node of many is lost, every replica on a healthy node keeps its
    placement value unchanged, only the lost node's replicas are handed to the policy, all of
    them are placed on other nodes, no GPU holds more than its memory, and the re-plan is
    deterministic."""
    nodes, deployments = fleet(NODES), catalogue(NODES)
    before = plan(deployments, nodes, {}, BestFitSpreadPolicy(), SIZING)
    assert not before.unplaced
    lost = busiest(before)
    on_lost = {p.replica_id for p in before.placements if p.node == lost}
    assert len(on_lost) > 20  # a busy node: large, whole-GPU and fractional replicas
    previous = {p.replica_id: p for p in before.placements}
    remaining = lose(nodes, lost)
    policy = RecordingPolicy()

    after = plan(deployments, remaining, previous, policy, SIZING)

    assert policy.asked == [on_lost]
    assert not after.unplaced
    assert len(after.placements) == len(before.placements)
    changed = {p.replica_id for p in after.placements if previous[p.replica_id] != p}
    assert changed == on_lost
    for p in after.placements:
        if p.replica_id in on_lost:
            assert p.node != lost and p.decision is Decision.PLACED
        else:
            assert p is previous[p.replica_id]
    assert all(total <= GPU_BYTES for total in used_bytes(after).values())
    shuffled = plan(
        list(reversed(deployments)), list(reversed(remaining)), previous, policy, SIZING
    )
    assert shuffled == after


def test_the_liveness_sweep_commits_only_the_lost_nodes_replicas() -> None:
    """Invariant: when one node of many stops heartbeating, the control plane's sweep commits
    that node as NotReady plus new placements for exactly its replicas: no other placement
    is written, deleted or changed, so the reconcile loop starts only those replicas."""
    nodes, deployments = fleet(NODES), catalogue(NODES)
    store = RecordingStore(StateSnapshot(tuple(deployments), tuple(nodes)))
    clock = FakeClock()
    liveness = Liveness()
    control = ControlPlane(
        store, BestFitSpreadPolicy(), sizing=SIZING, liveness=liveness, clock=clock
    )
    control.load()
    before = control.placements()
    assert len(before.placements) == sum(d.replicas for d in deployments)
    lost = busiest(before)
    on_lost = {p.replica_id for p in before.placements if p.node == lost}

    clock.advance(liveness.timeout.total_seconds() + 1)
    for node in nodes:
        if node.name != lost:
            control.heartbeat(node)
    assert len(store.changes) == 1  # heartbeats with an unchanged inventory write nothing
    assert control.sweep() == [lost]

    change = store.changes[-1]
    assert [(n.name, n.condition) for n in change.put_nodes] == [(lost, NodeCondition.NOT_READY)]
    assert {p.replica_id for p in change.put_placements} == on_lost
    assert all(p.node != lost for p in change.put_placements)
    assert change.delete_placements == ()
    after = {p.replica_id: p for p in control.placements().placements}
    for p in before.placements:
        if p.replica_id not in on_lost:
            assert after[p.replica_id] == p
    assert not control.placements().unplaced


def _one_gpu_nodes(count: int, memory: int) -> list[Node]:
    return [Node(name=f"n{i}", gpus=(Gpu(0, memory),)) for i in range(count)]


def test_a_node_exceeds_the_soft_cap_only_to_fill_a_used_gpu_never_the_hard_cap() -> None:
    """Invariant: replicas of one deployment go beyond the soft spread cap (twice the even
    share) on a node only into a GPU already in use, never beyond the hard cap (three times),
    which saves the GPUs the soft cap alone opens half empty (issue #20).

    Six one-GPU nodes, each GPU holding nine small replicas; one anchor replica on n0; twelve
    small replicas: soft cap 4, hard cap 6. The soft cap alone uses n0 + two more GPUs."""
    small = _profile(1 * B, "bf16", 32, 8, 4096)
    size = estimate(small, SIZING).bytes_per_device
    nodes = _one_gpu_nodes(6, 9 * size + 1)
    deployments = [
        Deployment("anchor", small, replicas=1).normalised(),
        Deployment("small", small, replicas=12).normalised(),
    ]

    result = plan(deployments, nodes, {}, BestFitSpreadPolicy(), SIZING)
    per_node = Counter(p.node for p in result.placements if p.deployment_id == "small")
    assert per_node == {"n0": 6, "n1": 6}  # n1's GPU was in use before its 5th and 6th
    assert all(total <= 9 * size + 1 for total in used_bytes(result).values())

    soft_only = plan(deployments, nodes, {}, BestFitSpreadPolicy(2.0, 2.0), SIZING)
    per_node = Counter(p.node for p in soft_only.placements if p.deployment_id == "small")
    assert per_node == {"n0": 4, "n1": 4, "n2": 4}


def test_the_hard_cap_holds_even_where_a_used_gpu_has_room() -> None:
    """Invariant: a node never takes more of one deployment than the hard cap (three times the
    even share) while another node can take the replica, even if its used GPU has room.

    Four one-GPU nodes, each GPU holding forty replicas; twenty replicas: soft cap 10, hard
    cap 15. Filling used GPUs first puts fifteen on n0, then opens n1 for the other five."""
    small = _profile(1 * B, "bf16", 32, 8, 4096)
    size = estimate(small, SIZING).bytes_per_device
    nodes = _one_gpu_nodes(4, 40 * size)
    result = plan(
        [Deployment("small", small, replicas=20).normalised()],
        nodes,
        {},
        BestFitSpreadPolicy(),
        SIZING,
    )
    assert Counter(p.node for p in result.placements) == {"n0": 15, "n1": 5}


def test_the_caps_yield_when_no_node_under_them_has_room() -> None:
    """Invariant: the spread caps are preferences, never refusals: when only nodes at the cap
    have room, replicas still go there, the node holding the fewest of the deployment first
    (spread before best fit), and no GPU is over-committed."""
    small = _profile(1 * B, "bf16", 32, 8, 4096)
    size = estimate(small, SIZING).bytes_per_device
    roomy = _one_gpu_nodes(3, 9 * size)
    # Eligible (one GPU), so they count for the caps, but no replica fits them.
    cramped = [Node(name=f"c{i}", gpus=(Gpu(0, size - 1),)) for i in range(3)]
    nodes = [*roomy, *cramped]

    # Six replicas on six nodes: cap 1; the roomy nodes take one each, then one more each.
    six = plan(
        [Deployment("small", small, replicas=6).normalised()],
        nodes,
        {},
        BestFitSpreadPolicy(),
        SIZING,
    )
    assert Counter(p.node for p in six.placements) == {"n0": 2, "n1": 2, "n2": 2}
    assert not six.unplaced
    # Thirty: caps 10 and 15, but the three roomy GPUs hold nine each.
    thirty = plan(
        [Deployment("small", small, replicas=30).normalised()],
        nodes,
        {},
        BestFitSpreadPolicy(),
        SIZING,
    )
    assert Counter(p.node for p in thirty.placements) == {"n0": 9, "n1": 9, "n2": 9}
    assert len(thirty.unplaced) == 3
    assert all(total <= 9 * size for total in used_bytes(thirty).values())

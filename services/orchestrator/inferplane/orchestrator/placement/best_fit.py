"""`best_fit_spread`: best-fit decreasing with a deployment's replicas spread across nodes.

Order: replicas by memory over all their devices, largest first (ties: more devices first, then
deployment id, then ordinal) — first-/best-fit decreasing is the classic bin-packing heuristic
with a worst case of 11/9·OPT + 6/9 bins (Dósa 2007, "The Tight Bound of First Fit Decreasing
Bin-Packing Algorithm Is FFD(I) ≤ 11/9·OPT(I) + 6/9").

For each replica the candidate is chosen by, in order:

1. spread cap: a node holding fewer of the deployment's replicas than the cap before one at
   or above it. The cap is 1 while replicas <= eligible nodes, else
   ceil(max_skew × replicas / nodes) (max_skew 2: a node may hold up to twice its even
   share), so losing one node loses few replicas while small replicas can still fill the
   holes on GPUs already in use instead of opening empty ones (`bench/placement_scale.py`
   measures both);
2. fewest untouched devices: a GPU that already holds replicas and has room is used before an
   empty one is opened (spreading beyond the even share must not cost GPUs);
3. spread: a node holding the fewest replicas of the same deployment;
4. topology (tensor parallel only; all GPUs of a group have the same memory size, because
   the engine gets one memory fraction for all of them): GPUs with contiguous indices aligned
   to the group size, then any contiguous run, then any GPUs of the node;
5. best fit: the least memory left free on the chosen devices afterwards (keeps large holes
   for large replicas, Johnson 1973);
6. node name, then GPU indices (explicit tie-break: deterministic).

Replicas of one deployment share one demand, so each deployment is placed as a batch with one
min-heap per spread level holding every node's best candidate: O((N·G + R) log N) per
deployment for N nodes of G GPUs and R replicas, which keeps 1,000 nodes well under a second.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from inferplane.orchestrator.placement.model import (
    Decision,
    Ledger,
    NodeSlots,
    Placement,
    PolicyResult,
    ReplicaRequest,
    make_placement,
)

# (untouched devices, topology class, bytes left free, node rank, slot positions)
_Candidate = tuple[int, int, int, int, tuple[int, ...]]


class BestFitSpreadPolicy:
    """Best-fit decreasing with spread (see the module docstring)."""

    name = "best_fit_spread"

    def __init__(self, max_skew: float = 2.0) -> None:
        self._max_skew = max_skew

    def place(
        self,
        requests: Sequence[ReplicaRequest],
        ledger: Ledger,
        counts: dict[tuple[str, str], int],
    ) -> PolicyResult:
        order = sorted(
            requests,
            key=lambda r: (-r.estimate.total_bytes, -r.devices, r.deployment_id, r.ordinal),
        )
        placements: list[Placement] = []
        unplaced: list[ReplicaRequest] = []
        for _, batch in itertools.groupby(order, key=lambda r: r.deployment_id):
            self._place_batch(list(batch), ledger, counts, placements, unplaced)
        return PolicyResult(tuple(placements), tuple(unplaced))

    def _place_batch(
        self,
        batch: list[ReplicaRequest],
        ledger: Ledger,
        counts: dict[tuple[str, str], int],
        placements: list[Placement],
        unplaced: list[ReplicaRequest],
    ) -> None:
        first = batch[0]
        deployment = first.deployment_id
        devices, need = first.devices, first.bytes_per_device
        accelerator = first.estimate.accelerator
        nodes = {
            n.rank: n
            for n in ledger.nodes
            if n.accelerator is accelerator and len(n.slots) >= devices
        }
        existing = sum(counts.get((deployment, n.name), 0) for n in nodes.values())
        wanted = existing + len(batch)
        share = _skew_cap(wanted, len(nodes), self._max_skew)
        heaps: dict[int, list[_Candidate]] = {}
        for node in nodes.values():
            candidate = _best_candidate(node, devices, need)
            if candidate is not None:
                heaps.setdefault(counts.get((deployment, node.name), 0), []).append(candidate)
        for heap in heaps.values():
            heapq.heapify(heap)
        for position, request in enumerate(batch):
            tops = [(lvl >= share, heap[0][0], lvl) for lvl, heap in heaps.items() if heap]
            if not tops:
                unplaced.extend(batch[position:])
                return
            level = min(tops)[2]
            *_, rank, slots = heapq.heappop(heaps[level])
            node = nodes[rank]
            free_before = min(node.slots[p].free for p in slots)
            ledger.reserve(node, slots, need)
            counts[(deployment, node.name)] = level + 1
            placements.append(
                make_placement(
                    request,
                    node,
                    slots,
                    decision=Decision.PLACED,
                    free_before=free_before,
                    spread_rank=level + 1,
                )
            )
            candidate = _best_candidate(node, devices, need)
            if candidate is not None:
                heapq.heappush(heaps.setdefault(level + 1, []), candidate)


def _skew_cap(replicas: int, nodes: int, max_skew: float) -> int:
    if replicas <= nodes:
        return 1
    return max(1, math.ceil(max_skew * replicas / max(1, nodes)))


def _best_candidate(node: NodeSlots, devices: int, need: int) -> _Candidate | None:
    """The node's best slots for a replica of `devices` × `need` bytes, or None if none fit."""
    slots = node.slots
    if devices == 1:
        best: _Candidate | None = None
        for pos, slot in enumerate(slots):
            free = slot.free
            if free >= need:
                candidate = (int(free == slot.capacity), 0, free - need, node.rank, (pos,))
                if best is None or candidate < best:
                    best = candidate
        return best
    fitting = [pos for pos, slot in enumerate(slots) if slot.free >= need]
    if len(fitting) < devices:
        return None
    fits = set(fitting)
    best: _Candidate | None = None
    for start in range(len(slots) - devices + 1):
        window = tuple(range(start, start + devices))
        if not all(p in fits for p in window):
            continue
        first, last = slots[start].index, slots[start + devices - 1].index
        # One engine gets one memory fraction for all its GPUs: they must be the same size.
        if last - first != devices - 1 or any(
            slots[p].capacity != slots[start].capacity for p in window
        ):
            continue
        candidate = (
            sum(1 for p in window if slots[p].free == slots[p].capacity),
            0 if first % devices == 0 else 1,
            sum(slots[p].free - need for p in window),
            node.rank,
            window,
        )
        if best is None or candidate < best:
            best = candidate
    by_capacity: dict[int, list[int]] = {}
    for pos in fitting:
        by_capacity.setdefault(slots[pos].capacity, []).append(pos)
    for capacity in sorted(by_capacity):
        group = by_capacity[capacity]
        if len(group) < devices:
            continue
        chosen = tuple(
            sorted(
                sorted(
                    group, key=lambda p: (slots[p].free == capacity, slots[p].free, slots[p].index)
                )[:devices]
            )
        )
        loose = (
            sum(1 for p in chosen if slots[p].free == capacity),
            2,
            sum(slots[p].free - need for p in chosen),
            node.rank,
            chosen,
        )
        if best is None or loose < best:
            best = loose
    return best

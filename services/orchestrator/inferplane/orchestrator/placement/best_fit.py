"""`best_fit_spread`: best-fit decreasing with a deployment's replicas spread across nodes.

Order: replicas by memory over all their devices, largest first (ties: more devices first, then
deployment id, then ordinal) — first-/best-fit decreasing is the classic bin-packing heuristic
with a worst case of 11/9·OPT + 6/9 bins (Dósa 2007, "The Tight Bound of First Fit Decreasing
Bin-Packing Algorithm Is FFD(I) ≤ 11/9·OPT(I) + 6/9").

Candidates are the nodes of the replica's accelerator kind that have its engine and the
capabilities it needs (`ReplicaRequest.eligible`, `placement.capabilities`).

Spread caps, per deployment and node: 1 while replicas <= eligible nodes (strict spread), else
ceil(skew × replicas / nodes) — the soft cap with `max_skew` (2: twice the even share), the hard
cap with `max_skew_to_save_gpus` (3). While another node has room, losing one node thus loses
at most three times a deployment's even share. The hard cap exists because small replicas of
one deployment cannot fill a GPU under the soft cap alone (ten 7.35 GB embedding replicas use
74 of 180 GB): the holes left on nodes at the soft cap went unused and half-empty GPUs were
opened elsewhere, about 2 % more GPUs than with the hard cap on the catalogue of
`bench/placement_scale.py` (issue #20).

For each replica the candidate is chosen by, in order:

1. hard cap: a node under it before one at or above it;
2. fewest untouched devices: a GPU that already holds replicas and has room is used before an
   empty one is opened;
3. soft cap: a node under it before one at or above it (so a node exceeds the soft cap only
   where that saves opening a GPU);
4. topology (tensor parallel only; all GPUs of a group have the same memory size, because
   the engine gets one memory fraction for all of them): GPUs with contiguous indices aligned
   to the group size, then any contiguous run, then any GPUs of the node;
5. best fit: the least memory left free on the chosen devices afterwards, over every node of
   the same cap class (keeps large holes for large replicas, Johnson 1973);
6. spread: a node holding the fewest replicas of the same deployment;
7. node name, then GPU indices (explicit tie-break: deterministic).

Nodes at or above the hard cap (only used once no other node fits) are taken by untouched
devices, then spread, then topology, best fit and name.

Replicas of one deployment share one demand, so each deployment is placed as a batch with
min-heaps holding every eligible node's best candidate (one entry per node, replaced when a
replica lands there): O(N·G + R·(G + log N)) per deployment for N nodes of G GPUs and R
replicas, never a scan of the fleet per replica (`bench/placement_scale.py` runs 10,000 nodes).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from operator import attrgetter

from inferplane.orchestrator.catalog.model import Accelerator
from inferplane.orchestrator.catalog.sizing import MemoryEstimate
from inferplane.orchestrator.placement.model import (
    Decision,
    Ledger,
    NodeSlots,
    Placement,
    PolicyResult,
    ReplicaRequest,
    make_placement,
    memory_fraction,
)

# A node's best slots for one replica: (untouched devices, topology class, bytes left free on
# them afterwards, slot positions).
_Fit = tuple[int, int, int, tuple[int, ...]]
_MASK = (1 << 32) - 1  # the node's position in a heap key (`_key`)


class BestFitSpreadPolicy:
    """Best-fit decreasing with spread (see the module docstring).

    Args:
        max_skew: the soft cap, in multiples of a deployment's even share per node.
        max_skew_to_save_gpus: the hard cap, in the same unit (raised to `max_skew` if lower).
    """

    name = "best_fit_spread"

    def __init__(self, max_skew: float = 2.0, max_skew_to_save_gpus: float = 3.0) -> None:
        self._max_skew = max_skew
        self._hard_skew = max(max_skew, max_skew_to_save_gpus)

    def place(
        self,
        requests: Sequence[ReplicaRequest],
        ledger: Ledger,
        counts: dict[tuple[str, str], int],
    ) -> PolicyResult:
        # One sort key per batch rather than per replica. A batch is one deployment's replicas
        # with one demand (`plan` gives every replica of a deployment the same estimate object).
        by_deployment: dict[str, list[ReplicaRequest]] = {}
        for request in requests:
            by_deployment.setdefault(request.deployment_id, []).append(request)
        batches: list[list[ReplicaRequest]] = []
        for group in by_deployment.values():
            demand = group[0].estimate
            if all(r.estimate is demand for r in group):
                batches.append(group)
                continue
            by_demand: dict[MemoryEstimate, list[ReplicaRequest]] = {}
            for request in group:
                by_demand.setdefault(request.estimate, []).append(request)
            batches.extend(by_demand.values())
        for batch in batches:
            batch.sort(key=attrgetter("ordinal"))
        batches.sort(
            key=lambda b: (
                -b[0].estimate.total_bytes,
                -b[0].devices,
                b[0].deployment_id,
                b[0].ordinal,
            )
        )
        placements: list[Placement] = []
        unplaced: list[ReplicaRequest] = []
        for batch in batches:
            self._place_batch(batch, ledger, counts, placements, unplaced)
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
        deployment, revision = first.deployment_id, first.revision
        est = first.estimate
        devices, need, accelerator = est.devices, est.bytes_per_device, est.accelerator
        # A node is its position in `nodes` (rank order) in the heap keys and lists below.
        eligible = first.eligible  # one deployment per batch: one list of capable nodes
        nodes = sorted(
            (
                n
                for n in ledger.nodes
                if n.accelerator is accelerator
                and len(n.slots) >= devices
                and (eligible is None or n.name in eligible)
            ),
            key=attrgetter("rank"),
        )
        levels = [counts.get((deployment, n.name), 0) for n in nodes]
        wanted = sum(levels) + len(batch)
        caps = (
            _skew_cap(wanted, len(nodes), self._max_skew),
            _skew_cap(wanted, len(nodes), self._hard_skew),
        )
        hard = caps[1]
        # Nodes under the hard cap have one entry in `open_`, the others one in `full` (see
        # `_key`), their best slots in `chosen`. `full` is only read once `open_` is empty, and
        # `open_` never refills then (levels only grow), so nodes that reach the hard cap are
        # parked and their fits computed only if that happens.
        open_: list[int] = []
        full: list[int] = []
        parked: list[int] = []
        chosen: list[tuple[int, ...]] = [()] * len(nodes)
        for at, node in enumerate(nodes):
            if levels[at] >= hard:
                parked.append(at)
                continue
            fit = _best_fit(node, devices, need)
            if fit is not None:
                open_.append(_key(fit, levels[at], at, caps))
                chosen[at] = fit[3]
        heapq.heapify(open_)
        # The best entry of `open_` is held out of the heap: after a replica lands, the node's
        # next key goes back with one heappushpop, which returns it at once when the node is
        # still the best (the common case: small replicas filling one GPU's hole).
        current = heapq.heappop(open_) if open_ else -1
        # A single-GPU replica's Placement is built here, with the values `make_placement`
        # gives, from this batch's constants and one memory fraction per GPU size: a fleet
        # of 10,000 nodes places 267,000 replicas (`bench/placement_scale.py`).
        fast = devices == 1 and accelerator is Accelerator.GPU
        fractions: dict[int, float] = {}
        kv = est.kv_cache_bytes_per_device
        reserve, append = ledger.reserve, placements.append
        for position, request in enumerate(batch):
            from_open = current >= 0
            if from_open:
                at = current & _MASK
            else:
                for parked_at in parked:
                    fit = _best_fit(nodes[parked_at], devices, need)
                    if fit is not None:
                        heapq.heappush(full, _key(fit, levels[parked_at], parked_at, caps))
                        chosen[parked_at] = fit[3]
                parked.clear()
                if not full:
                    unplaced.extend(batch[position:])
                    break
                at = heapq.heappop(full) & _MASK
            node, slots = nodes[at], chosen[at]
            if devices == 1:
                free_before = node.slots[slots[0]].free
            else:
                free_before = min([node.slots[p].free for p in slots])
            reserve(node, slots, need)
            level = levels[at] = levels[at] + 1
            if fast:
                slot = node.slots[slots[0]]
                fraction = fractions.get(slot.capacity)
                if fraction is None:
                    fraction = fractions[slot.capacity] = memory_fraction(need, slot.capacity)
                placement = Placement(
                    request.replica_id,
                    deployment,
                    revision,
                    node.name,
                    accelerator,
                    (slot.index,),
                    need,
                    fraction,
                    kv,
                    Decision.PLACED,
                    free_before,
                    level,
                )
            else:
                placement = make_placement(
                    request,
                    node,
                    slots,
                    decision=Decision.PLACED,
                    free_before=free_before,
                    spread_rank=level,
                )
            append(placement)
            if from_open and level >= hard:
                parked.append(at)
                fit = None
            elif devices == 1 and free_before - need >= need:
                # Still the node's best: it was the tightest fitting slot, is now used and
                # tighter still (see `_best_fit`), so no scan.
                fit = (0, 0, free_before - 2 * need, slots)
            else:
                fit = _best_fit(node, devices, need)
            if fit is not None:
                chosen[at] = fit[3]
                key = _key(fit, level, at, caps)
                if from_open:
                    current = heapq.heappushpop(open_, key)
                else:
                    heapq.heappush(full, key)
            elif from_open:
                current = heapq.heappop(open_) if open_ else -1
        for at, level in enumerate(levels):
            if level:
                counts[(deployment, nodes[at].name)] = level


def _key(fit: _Fit, level: int, rank: int, caps: tuple[int, int]) -> int:
    """The heap key of a node's best fit given the node's level and the (soft, hard) caps.

    Under the hard cap the key orders by (untouched devices, at or above the soft cap,
    topology, bytes left, level, node rank); at or above it by (untouched devices, level,
    topology, bytes left, node rank). The fields are packed into one integer (rank and level
    in 32 bits each, bytes left in 64, topology in 2; the leading field unbounded) so that a
    heap of 10,000 nodes compares single integers, not tuples whose leading fields are
    mostly equal; the rank, unique per node, makes every key unique (`key & _MASK`).
    """
    untouched, topology, left, _ = fit
    soft, hard = caps
    if level < hard:
        head = (untouched << 1 | (level >= soft)) << 2 | topology
        return (((head << 64 | left) << 32 | level) << 32) | rank
    head = (untouched << 32 | level) << 2 | topology
    return ((head << 64 | left) << 32) | rank


def _skew_cap(replicas: int, nodes: int, skew: float) -> int:
    """Replicas of one deployment a node may hold: 1 while `replicas` <= `nodes`, else
    ceil(skew × replicas / nodes)."""
    if replicas <= nodes:
        return 1
    return max(1, math.ceil(skew * replicas / max(1, nodes)))


def _best_fit(node: NodeSlots, devices: int, need: int) -> _Fit | None:
    """The node's best slots for a replica of `devices` × `need` bytes, or None if none fit."""
    slots = node.slots
    if devices == 1:
        # The hot path (most replicas): no tuple per slot; the first position wins ties.
        best_untouched, best_free, best_pos = 2, 0, -1
        for pos, slot in enumerate(slots):
            free = slot.free
            if free >= need:
                untouched = int(free == slot.capacity)
                if untouched < best_untouched or (untouched == best_untouched and free < best_free):
                    best_untouched, best_free, best_pos = untouched, free, pos
        if best_pos < 0:
            return None
        return (best_untouched, 0, best_free - need, (best_pos,))
    fitting = [pos for pos, slot in enumerate(slots) if slot.free >= need]
    if len(fitting) < devices:
        return None
    fits = set(fitting)
    best: _Fit | None = None
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
            chosen,
        )
        if best is None or loose < best:
            best = loose
    return best

"""LoRA adapter affinity (issue 29): among the replicas a request's policy would accept, prefer
one whose engine already holds the request's adapter, so a replica loads an adapter only on a
miss and the adapters a deployment serves stay spread over few replicas each.

Applied once for every policy (`Admission._try` runs it on the policy's choice): the policy
chooses as usual; when its choice does not hold the adapter and its engine state is known
(`engine_state.EngineStates`, from the replica state stream), the least loaded replica that
holds it, can take a request now and is under the bounded-load cap ceil(c·(m+1)/n) (the cap
prefix affinity uses: `ReplicaSet.bound`) takes the request instead. Otherwise the policy's
choice stands, and that replica loads the adapter (vLLM loads a LoRA adapter on a request that
names it). An unknown state (no stream, stale) means no preference. Cost: O(replicas holding
the adapter) per request, found through `EngineStates.holders` (no scan of the set).
"""

from __future__ import annotations

from collections.abc import Collection

from inferplane.router.engine_state import EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.replicas import ReplicaKey, ReplicaSet

#: `ReplicaSet.cache` key of the set's replica id → index map (membership only).
_IDS = "adapter_affinity.ids"


class AdapterAffinity:
    """Prefers replicas holding a request's LoRA adapter (module docstring).

    Args:
        engines: the replicas' engine states (their `loaded_adapters`).
        load_factor: c of the bounded-load cap (the router's `load_factor`).
    """

    def __init__(self, engines: EngineStates, load_factor: float = 1.25) -> None:
        self._engines = engines
        self._c = load_factor
        self.redirected = 0  # requests sent to a holder instead of the policy's choice

    def prefer(
        self,
        replicas: ReplicaSet,
        chosen: int,
        request: RequestFeatures,
        exclude: Collection[ReplicaKey] = (),
    ) -> int:
        """`chosen` (the policy's index into `replicas`), or the index of a replica that holds
        `request.adapter` as the module docstring says (never one in `exclude`: replicas the
        request already tried, or outside a gateway's subset)."""
        adapter = request.adapter
        if not adapter:
            return chosen
        engines = self._engines
        state = engines.get(replicas.endpoints[chosen].replica_id)
        if state is None or adapter in state.loaded_adapters:
            return chosen
        holders = engines.holders(adapter)
        if not holders:
            return chosen
        ids: dict[str, int] | None = replicas.cache.get(_IDS)
        if ids is None:
            ids = replicas.cache[_IDS] = {e.replica_id: i for i, e in enumerate(replicas.endpoints)}
        cap = replicas.bound(self._c)
        best: int | None = None
        for replica_id in holders:
            i = ids.get(replica_id)
            if i is None or not replicas.can_take(i) or replicas.in_flight[i] >= cap:
                continue
            if exclude and replicas.keys[i] in exclude:
                continue
            held = engines.get(replica_id)
            if held is None or adapter not in held.loaded_adapters:
                continue  # stale
            if best is None or (replicas.in_flight[i], i) < (replicas.in_flight[best], best):
                best = i
        if best is None:
            return chosen
        self.redirected += 1
        return best

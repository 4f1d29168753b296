"""`prefix_affinity`: send a request where its prompt prefix is most likely in the KV cache.

1. The longest prefix block hash (see `inferplane.router.features`) this router has routed
   before names the replica that holds it: use it if it is under the bounded-load cap.
   Multi-turn conversations and requests sharing a long system prompt land together.
2. Otherwise consistent hashing with bounded loads on the conversation root (tools, system
   and first user turn): every router instance agrees on where a new conversation goes.
3. Otherwise (everything near the bound, or at its concurrency cap) the least loaded replica.

The bounded-load cap ceil(c·(m+1)/n) (Mirrokni, Thorup, Zadimoghaddam, SODA 2018,
arXiv:1608.01350) keeps a popular prefix from overloading one replica: past the cap, requests
spill to the next replica on the ring, which then caches that prefix too.
"""

from __future__ import annotations

import collections

from inferplane.router.features import RequestFeatures
from inferplane.router.policies.hashring import bounded_choice, ring_fallbacks
from inferplane.router.replicas import ReplicaKey, ReplicaSet


class PrefixAffinity:
    """Approximate prefix-cache-aware routing; `max_entries` bounds the block table (LRU)."""

    def __init__(self, load_factor: float = 1.25, max_entries: int = 200_000) -> None:
        self._c = load_factor
        self._max = max_entries
        self._blocks: collections.OrderedDict[int, ReplicaKey] = collections.OrderedDict()

    def choose(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        chosen = self._cached(replicas, request)
        if chosen is None and request.root is not None:
            chosen = bounded_choice(replicas, request.root, self._c)
        if chosen is None:
            chosen = replicas.least_loaded()
        if chosen is not None and request.prefix_blocks:
            self._remember(request.prefix_blocks, replicas.keys[chosen])
        return chosen

    def remember(self, request: RequestFeatures, key: ReplicaKey) -> None:
        """Records that `request` went to replica `key` though this policy did not choose it
        (`precise_prefix` keeps this table current for when it falls back to it)."""
        if request.prefix_blocks:
            self._remember(request.prefix_blocks, key)

    def fallbacks(
        self, replicas: ReplicaSet, request: RequestFeatures, chosen: int | None, n: int
    ) -> list[int]:
        """Ring order from the conversation root (where every router sends it next when its
        replica leaves); the prefix table is not touched."""
        if request.root is None:
            return replicas.least_loaded_others(chosen, n)
        return ring_fallbacks(replicas, request.root, chosen, n)

    def _cached(self, replicas: ReplicaSet, request: RequestFeatures) -> int | None:
        blocks = self._blocks
        for h in reversed(request.prefix_blocks):
            key = blocks.get(h)
            if key is None:
                continue
            i = replicas.index.get(key)
            if i is None or not replicas.can_take(i):
                return None
            return i if replicas.in_flight[i] < replicas.bound(self._c) else None
        return None

    def _remember(self, prefix_blocks: tuple[int, ...], key: ReplicaKey) -> None:
        blocks = self._blocks
        for h in prefix_blocks:
            blocks[h] = key
            blocks.move_to_end(h)
        while len(blocks) > self._max:
            blocks.popitem(last=False)

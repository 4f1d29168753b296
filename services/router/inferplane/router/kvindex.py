"""Which replica holds which KV block: the router's index of its replicas' prefix caches.

Filled from each replica's state stream (`replica_watch.py`: vLLM's KV events, translated by
the replica into content hashes, `inferplane.kvblocks.chain`), read by the `precise_prefix`
policy. A hash covers its block's token ids, the LoRA adapter and every block before it
(chained), so "replica r holds hash h_i" means r has the whole prefix up to block i cached.

Layout: block hash → its holders (replica ids), and per replica the set of its hashes (for
a `removed` event, a `reset` snapshot and a replica that leaves). Memory is bounded by
`max_entries` (hash, replica) pairs; past it, the block hash least recently stored or matched
(by any replica) is dropped with all its holders (LRU over hashes: a shared system prompt
matched by every request stays; a conversation nobody continues goes first). The engines
evict their own blocks and say so (`removed`), so the cap is only a guard against a router
following more KV than its memory allows. No I/O, no locks: one event loop writes and reads.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence


class KvIndex:
    """Block content hash → replicas holding it; replica → its hashes.

    Args:
        max_entries: the most (hash, replica) pairs held (> 0); past it the least recently
            stored or matched hash is dropped with all its holders.

    Raises:
        ValueError: `max_entries` is not positive.
    """

    def __init__(self, max_entries: int = 2_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._max = max_entries
        # hash → holders, in LRU order (least recently stored or matched first).
        self._holders: collections.OrderedDict[int, set[str]] = collections.OrderedDict()
        self._by_replica: dict[str, set[int]] = {}
        self._entries = 0
        self.evicted = 0

    def __len__(self) -> int:
        """(hash, replica) pairs held."""
        return self._entries

    @property
    def max_entries(self) -> int:
        return self._max

    def blocks(self, replica: str) -> int:
        """Blocks indexed for `replica`."""
        return len(self._by_replica.get(replica, ()))

    def replicas(self) -> Iterable[str]:
        """Replica ids with at least one indexed block."""
        return self._by_replica.keys()

    def holders(self, block: int) -> frozenset[str]:
        """The replicas holding `block` (empty if none); does not count as a match."""
        return frozenset(self._holders.get(block, ()))

    def store(self, replica: str, hashes: Iterable[int]) -> None:
        """`replica` cached these blocks (vLLM's BlockStored); each becomes most recent."""
        mine = self._by_replica.get(replica)
        if mine is None:
            mine = self._by_replica[replica] = set()
        holders_of = self._holders
        for h in hashes:
            holders = holders_of.get(h)
            if holders is None:
                holders = holders_of[h] = set()
            else:
                holders_of.move_to_end(h)
            if replica not in holders:
                holders.add(replica)
                mine.add(h)
                self._entries += 1
        self._evict()

    def remove(self, replica: str, hashes: Iterable[int]) -> None:
        """`replica` evicted these blocks (vLLM's BlockRemoved); unknown ones are ignored."""
        mine = self._by_replica.get(replica)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._unhold(h, replica)
        if not mine:
            del self._by_replica[replica]

    def drop(self, replica: str) -> None:
        """Forgets every block of `replica` (a reset snapshot, a gap, or it left the table)."""
        mine = self._by_replica.pop(replica, None)
        if not mine:
            return
        for h in mine:
            self._unhold(h, replica)

    def reset(self, replica: str, hashes: Iterable[int]) -> None:
        """`replica` holds exactly these blocks now (a stream's first update, a cache reset)."""
        self.drop(replica)
        self.store(replica, hashes)

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per replica, how many leading blocks of `hashes` (a prompt's chained block hashes,
        in order) it holds; replicas holding none are absent.

        O(blocks × holders), stopping at the first block nobody still in the running holds.
        The matched blocks count as used (LRU).
        """
        out: dict[str, int] = {}
        if not hashes:
            return out
        holders_of = self._holders
        first = holders_of.get(hashes[0])
        if not first:
            return out
        holders_of.move_to_end(hashes[0])
        alive = set(first)
        depth = 1
        for h in hashes[1:]:
            holders = holders_of.get(h)
            if not holders:
                break
            still = alive & holders
            if not still:
                break
            holders_of.move_to_end(h)
            for r in alive - still:
                out[r] = depth
            alive = still
            depth += 1
        for r in alive:
            out[r] = depth
        return out

    def _unhold(self, h: int, replica: str) -> None:
        holders = self._holders.get(h)
        if holders is None or replica not in holders:
            return
        holders.discard(replica)
        self._entries -= 1
        if not holders:
            del self._holders[h]

    def _evict(self) -> None:
        holders_of = self._holders
        while self._entries > self._max and holders_of:
            h, holders = holders_of.popitem(last=False)
            for r in holders:
                mine = self._by_replica.get(r)
                if mine is not None:
                    mine.discard(h)
                    if not mine:
                        del self._by_replica[r]
            self._entries -= len(holders)
            self.evicted += 1

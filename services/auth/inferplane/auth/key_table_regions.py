"""The key table's entries across regions: `RegionalEntries`, the base of
`key_table.KeyTableFeed` holding what regions add to it (docs/regions.md).

- each own key's entries are built with this region's share of its rate limits
  (`inferplane.auth.shares`), and built again when the shares move (`_reshare`);
- month tokens are this region's ledger plus what the other regions last reported
  (`_months_of`, the global budgets);
- the peers' keys (`inferplane.auth.peers.PeerKeyTable`) are merged into the table
  (`_merge_peers`);
- `_note`: how a key's new entries differ from the table's, for the changes sent to routers.

Without peers (one cell) each of these is the single-region behaviour.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection
from datetime import datetime

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.domain import ApiKey
from inferplane.auth.key_entries import Built, Change, build_entries
from inferplane.auth.ledger import SqlUsageLedger
from inferplane.auth.peers import PEER_KEY_PREFIX, PeerKeyTable
from inferplane.auth.shares import has_rate_limits


class RegionalEntries:
    """The table's per-key state and its region-aware building; `KeyTableFeed` sets the
    attributes below in its `__init__` and provides `_set` (store a key's entries)."""

    _ledger: SqlUsageLedger
    _peers: PeerKeyTable | None
    _peer_version: int
    _shares_version: int
    _by_key: dict[str, Built]
    _keys: dict[str, ApiKey]
    _months: dict[str, int]
    _size: int

    def _set(
        self, key_id: str, key: ApiKey | None, built: Built, change: Change, now: datetime
    ) -> None:
        raise NotImplementedError

    def _shares_now(self) -> int:
        return -1 if self._peers is None else self._peers.shares.version

    def _build(self, key: ApiKey, month: int, now: datetime) -> Built:
        """`key`'s entries, with this region's share of its rate limits when it has peers and
        the key is homed in a region and not pinned (`inferplane.auth.shares`)."""
        share = None
        if self._peers is not None and key.home_region and not key.region_pinned:
            limits = auth_pb2.Limits(**dataclasses.asdict(key.limits))
            share = self._peers.shares.limits_for(key.key_id, key.home_region, limits)
        return build_entries(key, month, now, share)

    async def _reshare(self, change: Change, now: datetime) -> None:
        """Builds again (in a worker thread) the entries of the own keys with rate limits when
        the shares changed since they were built, and notes what differs in `change`. Runs
        under the feed's lock: the table does not change meanwhile."""
        version = self._shares_now()
        if version == self._shares_version:
            return
        limited = [
            (key_id, key, self._months.get(key_id, 0))
            for key_id, key in self._keys.items()
            if has_rate_limits(key.limits)
        ]

        def build() -> dict[str, Built]:
            return {key_id: self._build(key, month, now) for key_id, key, month in limited}

        for key_id, built in (await asyncio.to_thread(build) if limited else {}).items():
            self._set(key_id, self._keys[key_id], built, change, now)
        self._shares_version = version

    def _months_of(self, key_ids: Collection[str], now: datetime) -> dict[str, int]:
        """The month tokens of `key_ids`: this region's ledger plus, with peers, what the
        other regions last reported (absent: none)."""
        found: dict[str, int] = self._ledger.month_tokens_of(key_ids, now)
        if self._peers is not None:
            self._peers.add_others(found, key_ids, now)
        return found

    def _merge_peers(self, change: Change, now: datetime, *, force: bool) -> None:
        """Makes the peers' keys in the table what `PeerKeyTable.built` says, when they may
        have changed since the last merge (or `force`), and notes what differs in `change`."""
        peers = self._peers
        if peers is None or (peers.version == self._peer_version and not force):
            return
        self._peer_version = peers.version
        own = {h for k, b in self._by_key.items() if not k.startswith(PEER_KEY_PREFIX) for h in b}
        tables = peers.built(now, own)
        for key_id in [k for k in self._by_key if k.startswith(PEER_KEY_PREFIX)]:
            if key_id not in tables:
                tables[key_id] = {}
        for key_id, built in tables.items():
            self._note(key_id, built, change)
            if built:
                self._by_key[key_id] = built
            else:
                self._by_key.pop(key_id, None)

    def _note(self, key_id: str, built: Built, change: Change) -> None:
        """Notes in `change` how `built` differs from `key_id`'s entries in the table (the
        caller then stores or drops them), and counts the difference in size."""
        old = self._by_key.get(key_id, {})
        for secret_hash, (raw, entry) in built.items():
            before = old.get(secret_hash)
            if before is None or before[0] != raw:
                change.put(secret_hash, entry)
        for secret_hash in old.keys() - built.keys():
            change.drop(secret_hash)
        self._size += len(built) - len(old)

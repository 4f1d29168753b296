"""The routing table routers watch and the routers' shares of each replica's cap.

- `table.py`: the table (model → ready replicas; LoRA adapters' routes on their base's
  replicas; a release's revision shares), content versions, per-model filtering, a router's
  view with its shares and lease epoch.
- `shares.py`: the shared-caps rule (what routers may hold never sums past a cap; leases,
  acknowledged shrinks, hand-over between leaders), the per-router lease state, the split.
- `hub.py`: `RoutingHub`, the latest table, its watchers, renewals, lease expiry and the grants
  journal.
"""

from inferplane.orchestrator.routing.hub import RoutingHub
from inferplane.orchestrator.routing.shares import (
    DEFAULT_LEASE_MARGIN_SECONDS,
    DEFAULT_LEASE_SECONDS,
    JOURNAL_RETRY_SECONDS,
    Grants,
    GrantsJournal,
)
from inferplane.orchestrator.routing.table import (
    ReplicaKey,
    adapter_routes,
    filter_table,
    make_table,
    revision_shares,
    table_version,
)

__all__ = [
    "DEFAULT_LEASE_MARGIN_SECONDS",
    "DEFAULT_LEASE_SECONDS",
    "JOURNAL_RETRY_SECONDS",
    "Grants",
    "GrantsJournal",
    "ReplicaKey",
    "RoutingHub",
    "adapter_routes",
    "filter_table",
    "make_table",
    "revision_shares",
    "table_version",
]

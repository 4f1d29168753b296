"""Whether the stack's routers admit requests on their shares of the replicas' caps yet: the
last step of `Stack.start` (services/router/README.md, "Shared caps").

With shared caps a router admits to a replica only within the share the orchestrator granted
it, and only while it holds a lease. An orchestrator that cannot adopt what a previous term
granted (a first start on an empty database, or a restart after a term that wrote nothing)
grants every share as 0 for the router lease + its margin (15 + 1 s) after it starts leading,
since an earlier orchestrator's leases may still run; a request sent then waits in the
router's admission queue and, past its timeout (5 s), gets 429 `model_overloaded`. With a fake
engine the replicas are routable well within those 16 s, so the stack waits for the shares
instead of handing out an endpoint whose first request would be refused.

The routers' view comes from their Prometheus metrics (`router/metrics.py`):
`inferplane_router_cap_lease_valid` (1 while the router holds its lease; absent when caps are
not shared: `--no-shared-caps`) and `inferplane_router_cap_share_requests{replica}` (its share
of each replica's cap in its current table).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from inferplane.api.orchestrator.v1 import orchestrator_pb2

_LEASE = re.compile(r"^inferplane_router_cap_lease_valid(?:\{\})? (\S+)$", re.MULTILINE)
_SHARE = re.compile(
    r"^inferplane_router_cap_share_requests\{([^}]*)\} (\S+)$",
    re.MULTILINE,
)
_REPLICA_LABEL = re.compile(r'(?:^|,)replica="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True, slots=True)
class RouterCaps:
    """One router's shared-caps state as its metrics show it.

    Attributes:
        lease_valid: whether it holds its lease; None when it does not share caps (it
            enforces whole caps alone, so it admits at once).
        shares: replica id → this router's share of the replica's cap (requests).
    """

    lease_valid: bool | None
    shares: Mapping[str, int]


def parse_router_caps(metrics_text: str) -> RouterCaps:
    """Reads a router's `/metrics` page (Prometheus text format 0.0.4).

    Raises:
        ValueError: a sample's value is not a number.
    """
    lease = _LEASE.search(metrics_text)
    shares: dict[str, int] = {}
    for match in _SHARE.finditer(metrics_text):
        replica = _REPLICA_LABEL.search(match.group(1))
        if replica is not None:
            shares[replica.group(1)] = int(float(match.group(2)))
    return RouterCaps(
        lease_valid=None if lease is None else float(lease.group(1)) == 1.0,
        shares=shares,
    )


def admission_gap(
    routers: Mapping[str, RouterCaps], endpoints: Sequence[orchestrator_pb2.RouteEndpoint]
) -> str:
    """Why the routers would not admit a request to every endpoint yet, or "" when they do.

    They do when every router that shares caps holds its lease and, for each endpoint with a
    cap (`max_concurrency` > 0; an uncapped one has no share), the routers' shares add up to
    the cap: the orchestrator has granted all of it (it splits the whole cap among the routers
    holding a lease, so the sum falls short only while it still waits out earlier leases or
    moves room between routers).

    Args:
        routers: router process name → its state (`parse_router_caps`).
        endpoints: the routable replicas (`RouteEndpoint`: `replica_id`, `max_concurrency`).
    """
    shared = {name: caps for name, caps in routers.items() if caps.lease_valid is not None}
    if not shared:
        return ""
    for name, caps in shared.items():
        if not caps.lease_valid:
            return f"{name} holds no lease on its shares of the replicas' caps"
    for endpoint in endpoints:
        if endpoint.max_concurrency <= 0:
            continue
        granted = sum(caps.shares.get(endpoint.replica_id, 0) for caps in shared.values())
        if granted < endpoint.max_concurrency:
            return (
                f"the routers hold {granted} of the {endpoint.max_concurrency} requests of "
                f"{endpoint.replica_id}'s cap"
            )
    return ""

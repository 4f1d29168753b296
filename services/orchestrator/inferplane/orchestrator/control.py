"""The orchestrator's use cases over its desired state, as one object: `ControlPlane`.

- `state.DesiredState`: deployments, nodes, the placement plan and what node-agents report, in
  memory and written through to the store in one transaction per change; the read models the
  release logic uses (`placements()`, `observed_replicas()`, `subscribe(callback)`).
- `catalog.service.Catalogue`: the catalogue's use cases (deployments, their replicas, placement
  explained, status).
- `fleet.service.Fleet`: the fleet's use cases (register, heartbeat, drain, uncordon, sweep).
"""

from __future__ import annotations

from inferplane.orchestrator.catalog.service import Catalogue
from inferplane.orchestrator.fleet.service import Fleet


class ControlPlane(Catalogue, Fleet):
    """Catalogue, fleet and placement use cases on one desired state (module docstring).

    Args (keywords after `policy`): `sizing` (memory per replica), `liveness` (heartbeat
    timeout), `clock`, `guard` (runs first in every use case an RPC reaches; raises
    NotLeaderError on a standby; None: always allowed).
    """

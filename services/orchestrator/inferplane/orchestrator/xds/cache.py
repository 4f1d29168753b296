"""Immutable, versioned xDS snapshots per Envoy node id, checked for consistency before they are
published (go-control-plane's `pkg/cache/v3`: `Snapshot`, `Consistent()`, `SetSnapshot`).

A snapshot holds, per type URL, resources by name and a version that is a content hash of
them (16 hex digits of SHA-256 over each resource's deterministic serialization), so a restarted
control plane serving the same config gives Envoy the versions it already has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import structlog
from google.protobuf.message import Message

from inferplane.edge import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE

log = structlog.get_logger("inferplane.orchestrator.xds")

#: ADS order: clusters before their endpoints, listeners before their routes (Envoy's
#: eventual-consistency guidance for aggregated streams).
ADS_ORDER: tuple[str, ...] = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)
ANY_NODE = ""
"""The cache key a snapshot is served under for nodes that have none of their own."""


class InconsistentSnapshotError(ValueError):
    """A snapshot references a resource it does not hold (the message lists every problem)."""


def _name(resource: Message) -> str:
    return str(getattr(resource, "name", "") or getattr(resource, "cluster_name", ""))


def _version(resources: Sequence[Message]) -> str:
    digest = hashlib.sha256()
    for resource in resources:
        data = resource.SerializeToString(deterministic=True)
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """Resources by type URL (each a name → message mapping, sorted by name) and their versions.

    Build with `Snapshot.of(...)`; never mutate the messages afterwards.
    """

    resources: Mapping[str, Mapping[str, Message]]
    versions: Mapping[str, str]

    @classmethod
    def of(cls, by_type: Mapping[str, Sequence[Message]]) -> Snapshot:
        """A snapshot of `by_type` (e.g. `inferplane.edge.build_xds_resources(config)`).

        Raises: ValueError for two resources of one type with the same name.
        """
        resources: dict[str, Mapping[str, Message]] = {}
        versions: dict[str, str] = {}
        for type_url in ADS_ORDER:
            items = sorted(by_type.get(type_url, ()), key=_name)
            named = {_name(r): r for r in items}
            if len(named) != len(items):
                raise ValueError(f"duplicate resource names in {type_url}")
            resources[type_url] = MappingProxyType(named)
            versions[type_url] = _version(items)
        return cls(MappingProxyType(resources), MappingProxyType(versions))

    def problems(self) -> list[str]:
        """What `consistent()` would complain about: clusters referenced by routes that do not
        exist, EDS clusters without a ClusterLoadAssignment, route configurations referenced
        by listeners that do not exist. An assignment with no endpoint is valid: the replicas
        cluster is empty until the first replica of the fleet is ready (the router cluster
        cannot be, `EdgeConfig` refuses an edge without routers)."""
        clusters = self.resources.get(CLUSTER_TYPE, {})
        assignments = self.resources.get(ENDPOINT_TYPE, {})
        routes = self.resources.get(ROUTE_TYPE, {})
        found: list[str] = []
        for route_config in routes.values():
            for host in route_config.virtual_hosts:  # type: ignore[attr-defined]
                for route in host.routes:
                    if route.HasField("route") and route.route.cluster not in clusters:
                        found.append(
                            f"route {route_config.name}/{host.name} → cluster "  # type: ignore[attr-defined]
                            f"{route.route.cluster} is not in the snapshot"
                        )
        for name, cluster in clusters.items():
            if cluster.type == cluster.EDS:  # type: ignore[attr-defined]
                eds_name = cluster.eds_cluster_config.service_name or name  # type: ignore[attr-defined]
                assignment = assignments.get(eds_name)
                if assignment is None:
                    found.append(f"EDS cluster {name} has no ClusterLoadAssignment")
        for listener in self.resources.get(LISTENER_TYPE, {}).values():
            for wanted in _rds_names(listener):
                if wanted not in routes:
                    found.append(
                        f"listener {listener.name} → route configuration {wanted} is not in "  # type: ignore[attr-defined]
                        "the snapshot"
                    )
        return found

    def consistent(self) -> None:
        """Raises InconsistentSnapshotError listing every dangling reference."""
        found = self.problems()
        if found:
            raise InconsistentSnapshotError("; ".join(found))


def _rds_names(listener: Message) -> list[str]:
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    names = []
    for chain in listener.filter_chains:  # type: ignore[attr-defined]
        for network_filter in chain.filters:
            if network_filter.typed_config.Is(hcm_pb2.HttpConnectionManager.DESCRIPTOR):
                hcm = hcm_pb2.HttpConnectionManager()
                network_filter.typed_config.Unpack(hcm)
                if hcm.HasField("rds"):
                    names.append(hcm.rds.route_config_name)
    return names


class SnapshotCache:
    """The latest consistent snapshot per node id; ADS streams wait on it (one event loop)."""

    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._changed = asyncio.Condition()
        self._generation = 0

    def get(self, node_id: str) -> Snapshot | None:
        """The node's snapshot, else the one set for `ANY_NODE`, else None."""
        return self._snapshots.get(node_id) or self._snapshots.get(ANY_NODE)

    @property
    def generation(self) -> int:
        """Bumped by every `set_snapshot`; streams compare it to know when to look again."""
        return self._generation

    async def set_snapshot(self, node_id: str, snapshot: Snapshot) -> None:
        """Publishes `snapshot` for `node_id` (`ANY_NODE`: every node without its own).

        Raises: InconsistentSnapshotError; the previous snapshot then stays in place.
        """
        snapshot.consistent()
        self._snapshots[node_id] = snapshot
        self._generation += 1
        log.info("xds_snapshot_set", node=node_id or "*", versions=dict(snapshot.versions))
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_change(self, generation: int) -> int:
        """Returns once the generation differs from `generation`; returns the new one."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._generation != generation)
        return self._generation

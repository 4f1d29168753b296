"""The orchestrator's `edge_region` reaches the edge it configures over ADS (`EdgeConfig.region`:
the region's ready route and served-region header, docs/regions.md)."""

from __future__ import annotations

from pathlib import Path

from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from inferplane.edge import LISTENER_TYPE, REGION_FILTERS, build_xds_resources
from inferplane.orchestrator.app import build_components

from .conftest import make_settings


def _pushed_edge(tmp_path: Path, region: str) -> tuple[str, list[str]]:
    """The region of the edge the orchestrator configures, and its listener's http filters
    as pushed over ADS."""
    settings = make_settings(
        tmp_path,
        reconcile=False,
        edge_routers=("127.0.0.1:7001",),
        edge_auth_address="127.0.0.1:7002",
        edge_region=region,
    )
    edge = build_components(settings).edge
    assert edge is not None
    (listener,) = build_xds_resources(edge.config)[LISTENER_TYPE]
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)  # type: ignore[attr-defined]
    return edge.config.region, [f.name for f in manager.http_filters]


def test_edge_region_reaches_the_pushed_edge(tmp_path: Path) -> None:
    region, filters = _pushed_edge(tmp_path / "eu", "eu")
    assert region == "eu"
    assert tuple(filters[: len(REGION_FILTERS)]) == REGION_FILTERS
    region, filters = _pushed_edge(tmp_path / "none", "")
    assert region == ""
    assert not set(REGION_FILTERS) & set(filters)

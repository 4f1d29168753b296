"""The web console's route at the edge (issue 21): `/console/` goes to the console cluster
with ext_authz and the OpenAI filters off for that route only; without a console endpoint
nothing changes."""

from __future__ import annotations

from typing import Any

import inferplane.edge as edge
from inferplane.edge import EdgeConfig, Endpoint, build_xds_resources
from inferplane.edge._clusters import CONSOLE_CLUSTER

BASE = {
    "router_endpoints": (Endpoint.parse("127.0.0.1:7001"),),
    "auth_endpoint": Endpoint.parse("127.0.0.1:7002"),
    "listen_port": 18080,
    "admin_port": 19901,
}


def _routes(config: EdgeConfig) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = edge.build_route_config(config)["virtual_hosts"][0]["routes"]
    return routes


def _disabled(route: dict[str, Any]) -> set[str]:
    per_filter = route.get("typed_per_filter_config", {})
    return {name for name, value in per_filter.items() if value.get("disabled")}


def test_console_route_skips_ext_authz_and_every_other_route_keeps_one_authenticator() -> None:
    config = EdgeConfig(console_endpoint="127.0.0.1:7009", **BASE)
    routes = _routes(config)
    console = [r for r in routes if r["match"].get("prefix") == "/console/"]
    assert len(console) == 1 and console[0]["route"]["cluster"] == CONSOLE_CLUSTER
    assert console[0]["route"]["timeout"] == "0s"  # the playground streams
    assert {
        "envoy.filters.http.ext_authz",
        "envoy.filters.http.grpc_json_transcoder",
        "inferplane.stream_router",
        "inferplane.error_shaper",
        "envoy.filters.http.ext_proc",
    } <= _disabled(console[0])
    redirect = [r for r in routes if r["match"].get("path") == "/console"]
    assert redirect[0]["redirect"] == {"path_redirect": "/console/"}
    for route in routes:
        if route in console or route in redirect or route["match"].get("path") == "/health":
            continue
        if route.get("direct_response", {}).get("status") == 405:  # Envoy's own answer
            continue
        # Every other route keeps exactly one authenticator: ext_authz, or the picker.
        off = _disabled(route)
        authenticators = {"envoy.filters.http.ext_authz", "envoy.filters.http.ext_proc"} - off
        assert len(authenticators) == 1, route["match"]
    # The console route comes before the catch-all OpenAI and 404 routes.
    assert routes.index(console[0]) < [r["match"].get("prefix") for r in routes].index("/v1/")


def test_console_cluster_speaks_http1_over_the_edges_mtls() -> None:
    config = EdgeConfig(console_endpoint="127.0.0.1:7009", upstream_tls_dir="/pki", **BASE)
    [cluster] = [c for c in edge.build_clusters(config) if c["name"] == CONSOLE_CLUSTER]
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["explicit_http_config"] == {"http_protocol_options": {}}
    tls = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["alpn_protocols"] == ["http/1.1"]
    assert tls["tls_certificates"][0]["certificate_chain"]["filename"] == "/pki/edge.crt"
    # The others stay HTTP/2 with ALPN h2, and xDS carries the console's endpoint too.
    others = [c for c in edge.build_clusters(config) if c["name"] != CONSOLE_CLUSTER]
    assert all(
        c["transport_socket"]["typed_config"]["common_tls_context"]["alpn_protocols"] == ["h2"]
        for c in others
    )
    resources = build_xds_resources(config)
    assert len(resources[edge.ENDPOINT_TYPE]) == len(resources[edge.CLUSTER_TYPE]) == 4


def test_without_a_console_nothing_changes() -> None:
    config = EdgeConfig(**BASE)
    assert not [r for r in _routes(config) if "console" in str(r["match"])]
    assert CONSOLE_CLUSTER not in {c["name"] for c in edge.build_clusters(config)}

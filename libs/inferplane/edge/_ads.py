"""The minimal bootstrap of an Envoy edge configured over ADS: its identity, its admin API and
one static cluster pointing at the xDS server (the orchestrator); listeners, routes, clusters
and endpoints all come over ADS (`build_xds_resources` on the server side).

State-of-the-world ADS over one gRPC stream: Envoy subscribes CDS then EDS then LDS (and RDS)
and ACKs each push; endpoint and route changes leave running streams alone (see
`docs/envoy.md`, "xDS").
"""

from __future__ import annotations

from inferplane.edge._base import Resource, duration, render_yaml
from inferplane.edge._bootstrap import connection_cap, node_and_admin
from inferplane.edge._clusters import (
    UPSTREAM_KEEPALIVE,
    build_upstream_tls,
    http2_options,
    lb_endpoints,
)
from inferplane.edge._config import Endpoint

XDS_CLUSTER = "inferplane_xds"


def build_ads_bootstrap(
    xds: Endpoint | str,
    *,
    node_id: str = "inferplane-edge",
    node_cluster: str = "inferplane-edge",
    admin_host: str = "127.0.0.1",
    admin_port: int = 9901,
    connect_timeout_s: float = 2.0,
    max_connections: int = 50_000,
    upstream_tls_dir: str = "",
) -> Resource:
    """A Bootstrap dict (proto3 JSON mapping) for `envoy -c`.

    Args:
        xds: the ADS server (`host:port`, HTTP/2 h2c): the orchestrator's gRPC port.
        node_id / node_cluster: the identity the server keys its snapshot by (must match the
            orchestrator's `edge_node_id`).
        admin_host / admin_port: Envoy's admin API; keep it on loopback.
        connect_timeout_s: timeout connecting to the xDS server (Envoy retries with backoff).
        max_connections: global cap on downstream connections (overload manager).
        upstream_tls_dir: the edge's identity folder (`build_upstream_tls`): the xDS stream
            uses mutual TLS; empty: plaintext h2c (development only).

    Raises: EdgeConfigError for a malformed `xds` address.
    """
    server = xds if isinstance(xds, Endpoint) else Endpoint.parse(xds)
    bootstrap: Resource = {
        **node_and_admin(node_id, node_cluster, admin_host, admin_port),
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {
            "clusters": [
                {
                    "name": XDS_CLUSTER,
                    "type": "STATIC" if server.is_ip else "STRICT_DNS",
                    "connect_timeout": duration(connect_timeout_s),
                    "typed_extension_protocol_options": http2_options(UPSTREAM_KEEPALIVE),
                    "load_assignment": {
                        "cluster_name": XDS_CLUSTER,
                        "endpoints": [{"lb_endpoints": lb_endpoints((server,))}],
                    },
                }
            ]
        },
        "overload_manager": connection_cap(max_connections),
    }
    if upstream_tls_dir:
        cluster = bootstrap["static_resources"]["clusters"][0]
        cluster["transport_socket"] = build_upstream_tls(upstream_tls_dir)
    return bootstrap


def render_ads_bootstrap(xds: Endpoint | str, **kwargs: object) -> str:
    """`build_ads_bootstrap(xds, **kwargs)` as YAML text for `envoy -c`."""
    return render_yaml(
        build_ads_bootstrap(xds, **kwargs),  # type: ignore[arg-type]
        generated_by="inferplane.edge.render_ads_bootstrap",
    )

"""The minimal bootstrap of an Envoy edge configured over ADS: its identity, its admin API and
one static cluster pointing at the xDS server (the orchestrator); listeners, routes, clusters
and endpoints all come over ADS (`build_xds_resources` on the server side).

Recipe measured in `notes/envoy_edge_probe.md` §6.
"""

from __future__ import annotations

import yaml

from inferplane.edge._config import Endpoint
from inferplane.edge._resources import (
    UPSTREAM_KEEPALIVE,
    Resource,
    _Dumper,
    _duration,
    build_upstream_tls,
)

XDS_CLUSTER = "inferplane_xds"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_DOWNSTREAM_CONNECTIONS = (
    "type.googleapis.com/"
    "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)


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
        "node": {"id": node_id, "cluster": node_cluster},
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
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
                    "connect_timeout": _duration(connect_timeout_s),
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": _HTTP_OPTIONS,
                            "explicit_http_config": {
                                "http2_protocol_options": {
                                    "connection_keepalive": UPSTREAM_KEEPALIVE
                                }
                            },
                        }
                    },
                    "load_assignment": {
                        "cluster_name": XDS_CLUSTER,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": server.host,
                                                    "port_value": server.port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ]
        },
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": _DOWNSTREAM_CONNECTIONS,
                        "max_active_downstream_connections": max_connections,
                    },
                }
            ]
        },
    }
    if upstream_tls_dir:
        cluster = bootstrap["static_resources"]["clusters"][0]
        cluster["transport_socket"] = build_upstream_tls(upstream_tls_dir)
    return bootstrap


def render_ads_bootstrap(xds: Endpoint | str, **kwargs: object) -> str:
    """`build_ads_bootstrap(xds, **kwargs)` as YAML text for `envoy -c`."""
    header = "# Generated by inferplane.edge.render_ads_bootstrap; do not edit.\n"
    return header + yaml.dump(
        build_ads_bootstrap(xds, **kwargs),  # type: ignore[arg-type]
        Dumper=_Dumper,
        sort_keys=False,
        width=100,
    )

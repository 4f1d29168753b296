"""The edge's upstream Clusters (router, auth, replicas, console, the trace collector) and
their endpoints, and the cluster pieces the node-local Envoy and the ADS bootstrap share with
them: HTTP/2 keepalives, circuit breakers and buffer limits (`cluster_limits`), and the
upstream mutual TLS socket.
"""

from __future__ import annotations

from pathlib import Path

from inferplane.edge._base import (
    HTTP_OPTIONS_KEY,
    HTTP_OPTIONS_TYPE,
    TYPE_URL_PREFIX,
    Resource,
    duration,
)
from inferplane.edge._config import EdgeConfig, Endpoint
from inferplane.edge._region import picker_health_check
from inferplane.wire.headers import DESTINATION_ENDPOINT, PICK_NAMESPACE

ROUTER_CLUSTER = "inferplane_router"
AUTH_CLUSTER = "inferplane_auth"
#: The replica processes; the endpoint picker's list chooses the host (override_host).
REPLICAS_CLUSTER = "inferplane_replicas"
#: The web console (`EdgeConfig.console_endpoint`): HTTP/1.1, its own sign-in.
CONSOLE_CLUSTER = "inferplane_console"
#: The OpenTelemetry collector (`EdgeConfig.otlp_traces_endpoint`): OTLP/gRPC over h2c.
OTLP_CLUSTER = "inferplane_otlp"
#: The telemetry service (`EdgeConfig.telemetry_endpoint`): the access log of routed requests.
TELEMETRY_CLUSTER = "inferplane_telemetry"

_OVERRIDE_HOST = (
    TYPE_URL_PREFIX + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_ROUND_ROBIN = (
    TYPE_URL_PREFIX + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
_UPSTREAM_TLS = TYPE_URL_PREFIX + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"

# HTTP/2 keepalive towards our gRPC services (ADS and upstream clusters): finds a dead service
# behind a silent network within ~35 s. Our servers accept pings every 10 s or slower
# (inferplane.runtime MIN_PING_INTERVAL_MS); faster ones would earn a GOAWAY.
UPSTREAM_KEEPALIVE = {"interval": "30s", "timeout": "5s"}
# The replicas cluster's: replica processes run on other machines (GPU nodes), whose cable or
# switch may die under streams in flight. Envoy learns it only from an unanswered ping, so
# this bounds how long such a stream waits before it ends with an error, and how long a
# request picked before the routing table dropped the node waits before Envoy retries it on
# the next replica of its pick: interval × 1.15 (Envoy's default jitter) + timeout ≈ 18 s,
# against ~40 s at UPSTREAM_KEEPALIVE (measured by tests/multihost). 11 s, not 10: a ping
# delayed on the wire must still not arrive sooner than MIN_PING_INTERVAL_MS after the last.
REPLICA_KEEPALIVE = {"interval": "11s", "timeout": "5s"}


def http2_options(keepalive: dict[str, str]) -> Resource:
    """`typed_extension_protocol_options` of a cluster to a gRPC service: HTTP/2 (h2c, or h2
    over the TLS socket's ALPN) with `keepalive` (`UPSTREAM_KEEPALIVE` or
    `REPLICA_KEEPALIVE`) as the connection's ping interval and timeout."""
    return {
        HTTP_OPTIONS_KEY: {
            "@type": HTTP_OPTIONS_TYPE,
            "explicit_http_config": {
                "http2_protocol_options": {"connection_keepalive": keepalive},
            },
        }
    }


def cluster_limits(
    name: str, config: EdgeConfig, keepalive: dict[str, str] = UPSTREAM_KEEPALIVE
) -> Resource:
    """The fields every inferplane cluster starts from, the edge's and the node Envoy's: its
    `name`, `config.connect_timeout_s`, the per-connection buffer limit
    (`config.buffer_limit_bytes`: bodies are buffered whole), HTTP/2 with `keepalive`, and
    circuit breakers at `config.max_concurrent_requests` (connections, pending and active
    requests; Envoy's defaults, 1,024 each, would cap long generations far too early)."""
    return {
        "name": name,
        "connect_timeout": duration(config.connect_timeout_s),
        "per_connection_buffer_limit_bytes": config.buffer_limit_bytes,
        "typed_extension_protocol_options": http2_options(keepalive),
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": config.max_concurrent_requests,
                    "max_pending_requests": config.max_concurrent_requests,
                    "max_requests": config.max_concurrent_requests,
                }
            ]
        },
    }


def build_upstream_tls(tls_dir: str, identity: str = "edge", peer: str = "") -> Resource:
    """The edge's mutual TLS toward inferplane's services: Envoy presents the
    `identity` (`<tls_dir>/<identity>.crt`, `.key`; the node-local Envoy uses `node-agent`)
    and trusts servers whose certificate chains to `<tls_dir>/ca.crt` (and, with `peer`,
    carries that identity as a DNS name); ALPN h2 (every upstream is gRPC). Files are read
    when the cluster is built (a new push or an edge restart serves a renewed certificate)."""
    folder = Path(tls_dir)
    validation: Resource = {"trusted_ca": {"filename": str(folder / "ca.crt")}}
    if peer:
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": peer}}
        ]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _UPSTREAM_TLS,
            "common_tls_context": {
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "alpn_protocols": ["h2"],
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": str(folder / f"{identity}.crt")},
                        "private_key": {"filename": str(folder / f"{identity}.key")},
                    }
                ],
                "validation_context": validation,
            },
        },
    }


def lb_endpoints(endpoints: tuple[Endpoint, ...]) -> list[Resource]:
    """`lb_endpoints` of a ClusterLoadAssignment: one socket address per endpoint, in order."""
    return [
        {"endpoint": {"address": {"socket_address": {"address": e.host, "port_value": e.port}}}}
        for e in endpoints
    ]


def _cluster_endpoints(config: EdgeConfig) -> dict[str, tuple[Endpoint, ...]]:
    clusters = {
        ROUTER_CLUSTER: config.router_endpoints,
        AUTH_CLUSTER: (config.auth_endpoint,),
        REPLICAS_CLUSTER: config.replica_endpoints,
    }
    if config.console_endpoint is not None:
        clusters[CONSOLE_CLUSTER] = (config.console_endpoint,)
    if config.telemetry_endpoint is not None:
        clusters[TELEMETRY_CLUSTER] = (config.telemetry_endpoint,)
    return clusters


def _override_host_policy() -> Resource:
    """Envoy's override_host load balancing: the first host of the picker's list, retries
    down the list. A pick that names no host of the cluster (a replica not yet in EDS) falls
    back to round robin. Only the metadata source is read: with a header source too, Envoy
    concatenates the sources header first, so a client-sent header would win. The host that
    served is not written back (`selected_host_key` is missing from xds-protos 1.85's
    OverrideHost, so the orchestrator could not push it): the replica names itself in its
    summary trailers (`inferplane.wire.ResponseSummary`)."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _OVERRIDE_HOST,
                        "override_host_sources": [
                            {
                                "metadata": {
                                    "key": PICK_NAMESPACE,
                                    "path": [{"key": DESTINATION_ENDPOINT}],
                                }
                            }
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {"@type": _ROUND_ROBIN},
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


def build_endpoints(config: EdgeConfig) -> list[Resource]:
    """One ClusterLoadAssignment (`ENDPOINT_TYPE`) per cluster, for EDS."""
    return [
        {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints(endpoints)}]}
        for name, endpoints in _cluster_endpoints(config).items()
    ]


def build_clusters(config: EdgeConfig, *, eds: bool = False) -> list[Resource]:
    """The router, auth and replicas Clusters (`CLUSTER_TYPE`), HTTP/2 (h2c) to gRPC services,
    the console's (HTTP/1.1) when `config.console_endpoint` is set and telemetry's when
    `config.telemetry_endpoint` is.

    With `eds` the endpoints come from `build_endpoints` over ADS; otherwise they are inline
    (STATIC for IP literals, STRICT_DNS for names).
    """
    clusters = []
    for name, endpoints in _cluster_endpoints(config).items():
        keepalive = REPLICA_KEEPALIVE if name == REPLICAS_CLUSTER else UPSTREAM_KEEPALIVE
        cluster = cluster_limits(name, config, keepalive)
        if config.upstream_tls_dir:
            cluster["transport_socket"] = build_upstream_tls(config.upstream_tls_dir)
        if name == CONSOLE_CLUSTER:
            # The console is an HTTP/1.1 web server (aiohttp), not gRPC.
            options = cluster["typed_extension_protocol_options"]
            options[HTTP_OPTIONS_KEY]["explicit_http_config"] = {"http_protocol_options": {}}
            if config.upstream_tls_dir:
                context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
                context["alpn_protocols"] = ["http/1.1"]
        if name == REPLICAS_CLUSTER:
            cluster["load_balancing_policy"] = _override_host_policy()
            cluster["circuit_breakers"]["thresholds"][0]["retry_budget"] = {
                "budget_percent": {"value": config.retry_budget_percent},
                "min_retry_concurrency": config.min_retry_concurrency,
            }
        else:
            # Generations and picks vary from ms to minutes: balance on active requests.
            cluster["lb_policy"] = "LEAST_REQUEST"
        if name == ROUTER_CLUSTER and config.region:
            # The region's ready route counts the healthy routers (`_region.py`).
            cluster["health_checks"] = [picker_health_check()]
        if eds:
            cluster["type"] = "EDS"
            cluster["eds_cluster_config"] = {
                "eds_config": {"ads": {}, "resource_api_version": "V3"}
            }
        else:
            static = all(e.is_ip for e in endpoints)
            cluster["type"] = "STATIC" if static else "STRICT_DNS"
            if not static:
                cluster["dns_lookup_family"] = "V4_PREFERRED"
            cluster["load_assignment"] = {
                "cluster_name": name,
                "endpoints": [{"lb_endpoints": lb_endpoints(endpoints)}],
            }
        clusters.append(cluster)
    otlp = build_otlp_cluster(config)
    if otlp is not None:
        clusters.append(otlp)
    return clusters


def build_otlp_cluster(config: EdgeConfig) -> Resource | None:
    """The collector's Cluster (None without `config.otlp_traces_endpoint`): HTTP/2 h2c,
    inline endpoints (STATIC for an IP, STRICT_DNS for a name) even when the others come by
    EDS, and never the services' mutual TLS (a collector is not an inferplane service)."""
    endpoint = config.otlp_traces_endpoint
    if endpoint is None:
        return None
    cluster = cluster_limits(OTLP_CLUSTER, config)
    cluster["lb_policy"] = "LEAST_REQUEST"
    cluster["type"] = "STATIC" if endpoint.is_ip else "STRICT_DNS"
    if not endpoint.is_ip:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    cluster["load_assignment"] = {
        "cluster_name": OTLP_CLUSTER,
        "endpoints": [{"lb_endpoints": lb_endpoints((endpoint,))}],
    }
    return cluster

"""The node-local Envoy: a conformant gateway's endpoint (Gateway API Inference Extension) in
front of the replica processes of one node, built from the edge's own filter builders.

A gateway (Envoy Gateway, kgateway, Istio...) asks inferplane's router in its gateway mode
for a pick and sends the client's OpenAI request to the picked endpoint
(`inferplane.wire.headers.DESTINATION_ENDPOINT`) = `<node address>:<this Envoy's port>`, with
the replica process in `REPLICA_ADDRESS_HEADER` (`inferplane.wire.headers.REPLICA_ADDRESS`).
This Envoy maps REST ⇄ gRPC exactly as the edge does (the same error shaper, json_to_metadata
rule, stream router, field guard and transcoder, from `build_http_filters`), without
ext_authz (the gateway asked auth) or the picker call (the gateway did), then forwards over
mutual TLS to the replica through an ORIGINAL_DST cluster reading that header;
`lua/node_guard.lua` first refuses any replica address that is not on this node (a 421 in
OpenAI's shape).

    text = render_node_bootstrap(NodeEnvoyConfig(listen_port=8000, upstream_tls_dir="/tls"))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inferplane.edge._base import HCM_TYPE, Resource, lua_filter, render_bootstrap, render_lua
from inferplane.edge._bootstrap import static_bootstrap
from inferplane.edge._clusters import REPLICA_KEEPALIVE, build_upstream_tls, cluster_limits
from inferplane.edge._config import EdgeConfig, Endpoint, load_descriptor_set
from inferplane.edge._errors import EdgeConfigError
from inferplane.edge._filters import build_http_filters
from inferplane.edge._listener import access_log, hcm_limits, listener
from inferplane.edge._replies import build_local_reply_config, cel, mapper
from inferplane.edge._routes import health_route, route_to
from inferplane.wire.headers import REPLICA_ADDRESS

NODE_LISTENER_NAME = "inferplane_node"
NODE_ROUTE_CONFIG_NAME = "inferplane_node_routes"
#: The replica processes of this node: ORIGINAL_DST on `REPLICA_ADDRESS_HEADER`.
NODE_REPLICAS_CLUSTER = "inferplane_node_replicas"
#: The request header naming the replica process (`host:port`), set by the endpoint picker in
#: gateway mode beside the picked endpoint (`inferplane.wire.headers.DESTINATION_ENDPOINT`).
#: An alias of `inferplane.wire.headers.REPLICA_ADDRESS`, its one definition.
REPLICA_ADDRESS_HEADER = REPLICA_ADDRESS
#: The node Envoy's filters in chain order (pinned by a test): the edge's, less the auth
#: failure guard, ext_authz, ext_proc and the picker guard, plus the node guard.
NODE_FILTER_ORDER: tuple[str, ...] = (
    "inferplane.error_shaper",
    "inferplane.node_guard",
    "envoy.filters.http.json_to_metadata",
    "inferplane.stream_router",
    "inferplane.field_guard",
    "envoy.filters.http.grpc_json_transcoder",
    "envoy.filters.http.router",
)
_NODE_SERVICES = ("inferplane.inference.v1.InferenceService",)
#: `EdgeConfig`'s defaults: the limits the node Envoy shares with the edge default to the
#: edge's own, written once there.
_EDGE_DEFAULT: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(EdgeConfig)
    if f.default is not dataclasses.MISSING
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeEnvoyConfig:
    """Everything the node-local Envoy is built from. Ports are TCP ports, durations
    seconds, sizes bytes.

    Attributes:
        listen_host / listen_port: where the gateway connects (plain HTTP/1.1 or h2c, the
            InferencePool's `appProtocol`); `listen_port` is the pool's only `targetPorts`
            entry and the router's `gateway_node_port`. Clients never reach it: the
            NetworkPolicy admits the gateway's namespace only.
        upstream_tls_dir: the CA folder (`ca.crt`, `<identity>.crt`, `<identity>.key`) for
            mutual TLS to the replica processes; empty: plaintext h2c (development only).
        identity: the identity presented to replicas and expected from them: a replica
            process serves with its node-agent's certificate, and admits `node-agent` callers
            on InferenceService (inferplane.replica.app, INFERENCE_CALLERS).
        admin_host / admin_port: Envoy's admin API (keep it on loopback).
        node_id / node_cluster: the Envoy node identity.
        max_request_bytes / max_audio_request_bytes: body limits, as `EdgeConfig`.
        connect_timeout_s, stream_idle_timeout_s, request_headers_timeout_s: as `EdgeConfig`.
        max_concurrent_requests / max_connections: the replica cluster's circuit breakers
            and the downstream connection cap.
        access_log: one JSON access-log line per request on stdout.
        The limits and timeouts default to `EdgeConfig`'s own defaults.
        descriptor_set: the `FileDescriptorSet` the transcoder uses.
    """

    listen_host: str = "0.0.0.0"
    listen_port: int = 8000
    upstream_tls_dir: str = ""
    identity: str = "node-agent"
    admin_host: str = "127.0.0.1"
    admin_port: int = 9902
    node_id: str = "inferplane-node"
    node_cluster: str = "inferplane-node"
    max_request_bytes: int = _EDGE_DEFAULT["max_request_bytes"]
    max_audio_request_bytes: int = _EDGE_DEFAULT["max_audio_request_bytes"]
    connect_timeout_s: float = _EDGE_DEFAULT["connect_timeout_s"]
    stream_idle_timeout_s: float = _EDGE_DEFAULT["stream_idle_timeout_s"]
    request_headers_timeout_s: float = _EDGE_DEFAULT["request_headers_timeout_s"]
    max_concurrent_requests: int = _EDGE_DEFAULT["max_concurrent_requests"]
    max_connections: int = _EDGE_DEFAULT["max_connections"]
    access_log: bool = _EDGE_DEFAULT["access_log"]
    descriptor_set: bytes = dataclasses.field(default_factory=load_descriptor_set, repr=False)

    def __post_init__(self) -> None:
        for name in ("listen_port", "admin_port"):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise EdgeConfigError(f"{name}={port} is outside 1..65535")
        if self.listen_port == self.admin_port and self.listen_host == self.admin_host:
            raise EdgeConfigError(f"listen_port and admin_port are both {self.listen_port}")
        if not self.identity:
            raise EdgeConfigError("identity is empty")
        self.edge()  # the shared limits' own checks

    def edge(self) -> EdgeConfig:
        """The `EdgeConfig` the shared filter and local-reply builders read: this Envoy's
        limits, timeouts and descriptor set (its router and auth endpoints are never used:
        the node Envoy has no ext_authz, ext_proc or clusters of theirs)."""
        unused = Endpoint(self.admin_host, self.admin_port)
        return EdgeConfig(
            router_endpoints=(unused,),
            auth_endpoint=unused,
            listen_host=self.listen_host,
            listen_port=self.listen_port,
            admin_host=self.admin_host,
            admin_port=self.admin_port,
            node_id=self.node_id,
            node_cluster=self.node_cluster,
            max_request_bytes=self.max_request_bytes,
            max_audio_request_bytes=self.max_audio_request_bytes,
            connect_timeout_s=self.connect_timeout_s,
            stream_idle_timeout_s=self.stream_idle_timeout_s,
            request_headers_timeout_s=self.request_headers_timeout_s,
            max_concurrent_requests=self.max_concurrent_requests,
            max_connections=self.max_connections,
            access_log=self.access_log,
            descriptor_set=self.descriptor_set,
            services=_NODE_SERVICES,
        )


def build_node_http_filters(config: NodeEnvoyConfig) -> list[Resource]:
    """The node Envoy's http_filters in `NODE_FILTER_ORDER`: the edge's own filter objects
    (`build_http_filters`, so the REST ⇄ gRPC mapping has one source) and the node guard
    right after the error shaper (its 421 is shaped, and nothing is buffered first)."""
    edge = {f["name"]: f for f in build_http_filters(config.edge())}
    guard = lua_filter(
        "inferplane.node_guard", render_lua("node_guard", REPLICA_HEADER=REPLICA_ADDRESS_HEADER)
    )
    return [guard if name == "inferplane.node_guard" else edge[name] for name in NODE_FILTER_ORDER]


def build_node_local_reply_config(config: NodeEnvoyConfig) -> Resource:
    """The edge's local-reply mappers, after one that passes the node guard's 421 (already
    OpenAI-shaped) through unchanged."""
    mappers = build_local_reply_config(config.edge())["mappers"]
    passthrough = mapper(
        cel("response.code_details == 'lua_response' && response.code == 421"), None
    )
    return {"mappers": [passthrough, *mappers]}


def build_node_route_config(config: NodeEnvoyConfig) -> Resource:
    """`GET /health` → Envoy's own 200 (kubelet probes; no guard, no transcoder), `/v1/` and
    `/internal/events/` (after the stream router) → the replica the header names, anything
    else → 404. No retries: ORIGINAL_DST would retry the same replica, and the gateway's
    pick names one."""
    health = health_route(("inferplane.node_guard", "envoy.filters.http.grpc_json_transcoder"))
    return {
        "name": NODE_ROUTE_CONFIG_NAME,
        "virtual_hosts": [
            {
                "name": "openai",
                "domains": ["*"],
                "routes": [
                    health,
                    route_to("/v1/", NODE_REPLICAS_CLUSTER),
                    route_to("/internal/events/", NODE_REPLICAS_CLUSTER),
                    {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
                ],
            }
        ],
    }


def build_node_cluster(config: NodeEnvoyConfig) -> Resource:
    """The replica processes: ORIGINAL_DST on `REPLICA_ADDRESS_HEADER` (a host per address
    seen, cleaned up when idle), HTTP/2 with the edge's replica keepalive, mutual TLS as
    `identity` expecting the same identity from the replica."""
    cluster = cluster_limits(NODE_REPLICAS_CLUSTER, config.edge(), REPLICA_KEEPALIVE)
    cluster["type"] = "ORIGINAL_DST"
    cluster["lb_policy"] = "CLUSTER_PROVIDED"
    cluster["original_dst_lb_config"] = {
        "use_http_header": True,
        "http_header_name": REPLICA_ADDRESS_HEADER,
    }
    if config.upstream_tls_dir:
        cluster["transport_socket"] = build_upstream_tls(
            config.upstream_tls_dir, config.identity, peer=config.identity
        )
    return cluster


def build_node_bootstrap(config: NodeEnvoyConfig) -> Resource:
    """A static Bootstrap: the listener (plain HTTP/1.1 or h2c), the replica cluster, the
    admin API and the downstream connection cap."""
    edge = config.edge()
    hcm: Resource = {
        "@type": HCM_TYPE,
        "stat_prefix": "node",
        "codec_type": "AUTO",
        "server_name": "inferplane",
        # The gateway is the caller: its request id and auth's trusted headers stay.
        "use_remote_address": False,
        **hcm_limits(edge),
        "local_reply_config": build_node_local_reply_config(config),
        "http_filters": build_node_http_filters(config),
        "route_config": build_node_route_config(config),
    }
    if config.access_log:
        hcm["access_log"] = access_log()
    return static_bootstrap(
        edge, [listener(NODE_LISTENER_NAME, edge, hcm)], [build_node_cluster(config)]
    )


def render_node_bootstrap(config: NodeEnvoyConfig, *, fmt: str = "yaml") -> str:
    """The node Envoy's bootstrap as text for `envoy -c` ("yaml" or "json").

    Raises: ValueError for another `fmt`.
    """
    return render_bootstrap(
        build_node_bootstrap(config), fmt, generated_by="inferplane.edge.render_node_bootstrap"
    )

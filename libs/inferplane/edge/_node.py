"""The node-local Envoy: a conformant gateway's endpoint (Gateway API Inference Extension) in
front of the replica processes of one node, built from the edge's own filter builders.

A gateway (Envoy Gateway, kgateway, Istio...) asks inferplane's router in its gateway mode
for a pick (`inferplane.router.picker.GatewayMode`) and sends the client's OpenAI request to
`x-gateway-destination-endpoint` = `<node address>:<this Envoy's port>`, with the replica
process in `x-inferplane-replica-address`. This Envoy maps REST ⇄ gRPC exactly as the edge
does (the same error shaper, json_to_metadata rule, stream router, field guard and
transcoder, from `build_http_filters`), without ext_authz (the gateway asked auth) or the
picker call (the gateway did), then forwards over mutual TLS to the replica through an
ORIGINAL_DST cluster reading that header; `lua/node_guard.lua` first refuses any replica
address that is not on this node (a 421 in OpenAI's shape).

    text = render_node_bootstrap(NodeEnvoyConfig(listen_port=8000, upstream_tls_dir="/tls"))
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml

from inferplane.edge._config import EdgeConfig, Endpoint, MiB, load_descriptor_set
from inferplane.edge._errors import EdgeConfigError
from inferplane.edge._resources import (
    _DOWNSTREAM_CONNECTIONS,
    _FILTER_CONFIG,
    _HCM,
    _HTTP_OPTIONS,
    _LUA,
    _LUA_PER_ROUTE,
    HEALTH_BODY,
    HEALTH_PATH,
    REPLICA_KEEPALIVE,
    Resource,
    _access_log,
    _cel,
    _Dumper,
    _duration,
    _mapper,
    _method_is,
    build_http_filters,
    build_local_reply_config,
    build_upstream_tls,
    lua_source,
)

NODE_LISTENER_NAME = "inferplane_node"
NODE_ROUTE_CONFIG_NAME = "inferplane_node_routes"
#: The replica processes of this node: ORIGINAL_DST on `REPLICA_ADDRESS_HEADER`.
NODE_REPLICAS_CLUSTER = "inferplane_node_replicas"
#: The request header naming the replica process (`host:port`), set by the endpoint picker in
#: gateway mode beside `x-gateway-destination-endpoint`.
REPLICA_ADDRESS_HEADER = "x-inferplane-replica-address"
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
            on InferenceService (node_agent/replica/app.py, INFERENCE_CALLERS).
        admin_host / admin_port: Envoy's admin API (keep it on loopback).
        node_id / node_cluster: the Envoy node identity.
        max_request_bytes / max_audio_request_bytes: body limits, as `EdgeConfig`.
        connect_timeout_s, stream_idle_timeout_s, request_headers_timeout_s: as `EdgeConfig`.
        max_concurrent_requests / max_connections: the replica cluster's circuit breakers
            and the downstream connection cap.
        access_log: one JSON access-log line per request on stdout.
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
    max_request_bytes: int = 8 * MiB
    max_audio_request_bytes: int = 26 * MiB
    connect_timeout_s: float = 2.0
    stream_idle_timeout_s: float = 900.0
    request_headers_timeout_s: float = 10.0
    max_concurrent_requests: int = 100_000
    max_connections: int = 50_000
    access_log: bool = True
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
            max_request_bytes=self.max_request_bytes,
            max_audio_request_bytes=self.max_audio_request_bytes,
            connect_timeout_s=self.connect_timeout_s,
            stream_idle_timeout_s=self.stream_idle_timeout_s,
            request_headers_timeout_s=self.request_headers_timeout_s,
            max_concurrent_requests=self.max_concurrent_requests,
            max_connections=self.max_connections,
            access_log=self.access_log,
            slot_log=False,
            descriptor_set=self.descriptor_set,
            services=_NODE_SERVICES,
        )


def build_node_http_filters(config: NodeEnvoyConfig) -> list[Resource]:
    """The node Envoy's http_filters in `NODE_FILTER_ORDER`: the edge's own filter objects
    (`build_http_filters`, so the REST ⇄ gRPC mapping has one source) and the node guard
    right after the error shaper (its 421 is shaped, and nothing is buffered first)."""
    edge = {f["name"]: f for f in build_http_filters(config.edge())}
    guard = {
        "name": "inferplane.node_guard",
        "typed_config": {
            "@type": _LUA,
            "default_source_code": {
                "inline_string": lua_source("node_guard").replace(
                    "__REPLICA_HEADER__", REPLICA_ADDRESS_HEADER
                )
            },
        },
    }
    return [guard if name == "inferplane.node_guard" else edge[name] for name in NODE_FILTER_ORDER]


def build_node_local_reply_config(config: NodeEnvoyConfig) -> Resource:
    """The edge's local-reply mappers, after one that passes the node guard's 421 (already
    OpenAI-shaped) through unchanged."""
    mappers = build_local_reply_config(config.edge())["mappers"]
    passthrough = _mapper(
        _cel("response.code_details == 'lua_response' && response.code == 421"), None
    )
    return {"mappers": [passthrough, *mappers]}


def build_node_route_config(config: NodeEnvoyConfig) -> Resource:
    """`GET /health` → Envoy's own 200 (kubelet probes; no guard, no transcoder), `/v1/` and
    `/internal/events/` (after the stream router) → the replica the header names, anything
    else → 404. No retries: ORIGINAL_DST would retry the same replica, and the gateway's
    pick names one."""
    health = {
        "match": {"path": HEALTH_PATH, "headers": [_method_is("GET")]},
        "direct_response": {"status": 200, "body": {"inline_string": HEALTH_BODY}},
        "response_headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
        "typed_per_filter_config": {
            "inferplane.node_guard": {"@type": _LUA_PER_ROUTE, "disabled": True},
            "envoy.filters.http.grpc_json_transcoder": {"@type": _FILTER_CONFIG, "disabled": True},
        },
    }

    def to_replica(prefix: str) -> Resource:
        return {
            "match": {"prefix": prefix},
            "route": {"cluster": NODE_REPLICAS_CLUSTER, "timeout": "0s"},
        }

    return {
        "name": NODE_ROUTE_CONFIG_NAME,
        "virtual_hosts": [
            {
                "name": "openai",
                "domains": ["*"],
                "routes": [
                    health,
                    to_replica("/v1/"),
                    to_replica("/internal/events/"),
                    {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
                ],
            }
        ],
    }


def build_node_cluster(config: NodeEnvoyConfig) -> Resource:
    """The replica processes: ORIGINAL_DST on `REPLICA_ADDRESS_HEADER` (a host per address
    seen, cleaned up when idle), HTTP/2 with the edge's replica keepalive, mutual TLS as
    `identity` expecting the same identity from the replica."""
    cluster: Resource = {
        "name": NODE_REPLICAS_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": REPLICA_ADDRESS_HEADER,
        },
        "connect_timeout": _duration(config.connect_timeout_s),
        "per_connection_buffer_limit_bytes": config.edge().buffer_limit_bytes,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {
                    "http2_protocol_options": {"connection_keepalive": REPLICA_KEEPALIVE}
                },
            }
        },
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
    if config.upstream_tls_dir:
        cluster["transport_socket"] = build_upstream_tls(
            config.upstream_tls_dir, config.identity, peer=config.identity
        )
    return cluster


def build_node_bootstrap(config: NodeEnvoyConfig) -> Resource:
    """A static Bootstrap: the listener (plain HTTP/1.1 or h2c), the replica cluster, the
    admin API and the downstream connection cap."""
    hcm: Resource = {
        "@type": _HCM,
        "stat_prefix": "node",
        "codec_type": "AUTO",
        "server_name": "inferplane",
        # The gateway is the caller: its x-request-id and auth's x-inferplane-* headers stay.
        "use_remote_address": False,
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "stream_idle_timeout": _duration(config.stream_idle_timeout_s),
        "request_headers_timeout": _duration(config.request_headers_timeout_s),
        "local_reply_config": build_node_local_reply_config(config),
        "http_filters": build_node_http_filters(config),
        "route_config": build_node_route_config(config),
    }
    if config.access_log:
        hcm["access_log"] = _access_log()
    listener = {
        "name": NODE_LISTENER_NAME,
        "address": {
            "socket_address": {"address": config.listen_host, "port_value": config.listen_port}
        },
        "per_connection_buffer_limit_bytes": config.edge().buffer_limit_bytes,
        "enable_reuse_port": False,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    return {
        "node": {"id": config.node_id, "cluster": config.node_cluster},
        "admin": {
            "address": {
                "socket_address": {"address": config.admin_host, "port_value": config.admin_port}
            }
        },
        "static_resources": {"listeners": [listener], "clusters": [build_node_cluster(config)]},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": _DOWNSTREAM_CONNECTIONS,
                        "max_active_downstream_connections": config.max_connections,
                    },
                }
            ]
        },
    }


def render_node_bootstrap(config: NodeEnvoyConfig, *, fmt: str = "yaml") -> str:
    """The node Envoy's bootstrap as text for `envoy -c` ("yaml" or "json").

    Raises: ValueError for another `fmt`.
    """
    bootstrap: Any = build_node_bootstrap(config)
    if fmt == "json":
        return json.dumps(bootstrap, indent=2) + "\n"
    if fmt == "yaml":
        header = "# Generated by inferplane.edge.render_node_bootstrap; do not edit.\n"
        return header + yaml.dump(
            bootstrap, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True
        )
    raise ValueError(f"unknown format {fmt!r}; expected 'yaml' or 'json'")

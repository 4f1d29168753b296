"""inferplane.edge: the Envoy edge (OpenAI REST + SSE → gRPC) as data, and its process runner.

    config = EdgeConfig(router_endpoints=(Endpoint.parse("127.0.0.1:7001"),),
                        auth_endpoint=Endpoint.parse("127.0.0.1:7002"), listen_port=8080)
    text = render_static_bootstrap(config)            # the local stack's bootstrap (YAML)
    with EnvoyProcess.from_config(config, data_dir):  # started, LIVE; stopped on exit
        ...
    build_xds_resources(config)                       # the same edge for an ADS server
    render_node_bootstrap(NodeEnvoyConfig(...))       # the node-local Envoy (gateway path)
    known_request_fields(config.descriptor_set, config.services)  # the field guard's tables

Design and measurements: notes/envoy_edge_probe.md; the Lua filters live in `lua/`.
"""

from inferplane.edge._ads import build_ads_bootstrap, render_ads_bootstrap
from inferplane.edge._config import (
    DEFAULT_SERVICES,
    EdgeConfig,
    Endpoint,
    MiB,
    load_descriptor_set,
)
from inferplane.edge._errors import EdgeConfigError, EdgeError, EnvoyStartError
from inferplane.edge._fields import (
    BodyRoute,
    FieldKind,
    KnownFields,
    Nested,
    known_request_fields,
    render_lua_tables,
    template_lua_pattern,
)
from inferplane.edge._node import (
    NODE_FILTER_ORDER,
    NODE_REPLICAS_CLUSTER,
    REPLICA_ADDRESS_HEADER,
    NodeEnvoyConfig,
    build_node_bootstrap,
    render_node_bootstrap,
)
from inferplane.edge._process import EnvoyProcess, envoy_binary, validate_bootstrap
from inferplane.edge._resources import (
    AUTH_CLUSTER,
    BOOTSTRAP_TYPE,
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    FILTER_ORDER,
    LISTENER_NAME,
    LISTENER_TYPE,
    METADATA_NAMESPACE,
    PICK_KEY,
    PICK_NAMESPACE,
    PICKER_FILTERS,
    REPLICAS_CLUSTER,
    ROUTE_CONFIG_NAME,
    ROUTE_TYPE,
    ROUTER_CLUSTER,
    SERVED_KEY,
    build_bootstrap,
    build_clusters,
    build_endpoints,
    build_ext_proc_filter,
    build_http_connection_manager,
    build_http_filters,
    build_listener,
    build_local_reply_config,
    build_route_config,
    build_xds_resources,
    lua_source,
    prune_descriptor_set,
    render_static_bootstrap,
    to_proto,
)

__all__ = [
    "AUTH_CLUSTER",
    "BOOTSTRAP_TYPE",
    "CLUSTER_TYPE",
    "DEFAULT_SERVICES",
    "ENDPOINT_TYPE",
    "FILTER_ORDER",
    "LISTENER_NAME",
    "LISTENER_TYPE",
    "METADATA_NAMESPACE",
    "NODE_FILTER_ORDER",
    "NODE_REPLICAS_CLUSTER",
    "PICKER_FILTERS",
    "PICK_KEY",
    "PICK_NAMESPACE",
    "REPLICAS_CLUSTER",
    "REPLICA_ADDRESS_HEADER",
    "ROUTER_CLUSTER",
    "ROUTE_CONFIG_NAME",
    "ROUTE_TYPE",
    "SERVED_KEY",
    "BodyRoute",
    "EdgeConfig",
    "EdgeConfigError",
    "EdgeError",
    "Endpoint",
    "EnvoyProcess",
    "EnvoyStartError",
    "FieldKind",
    "KnownFields",
    "MiB",
    "Nested",
    "NodeEnvoyConfig",
    "build_ads_bootstrap",
    "build_bootstrap",
    "build_clusters",
    "build_endpoints",
    "build_ext_proc_filter",
    "build_http_connection_manager",
    "build_http_filters",
    "build_listener",
    "build_local_reply_config",
    "build_node_bootstrap",
    "build_route_config",
    "build_xds_resources",
    "envoy_binary",
    "known_request_fields",
    "load_descriptor_set",
    "lua_source",
    "prune_descriptor_set",
    "render_ads_bootstrap",
    "render_lua_tables",
    "render_node_bootstrap",
    "render_static_bootstrap",
    "template_lua_pattern",
    "to_proto",
    "validate_bootstrap",
]

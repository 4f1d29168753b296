"""inferplane.edge: the Envoy edge (OpenAI REST + SSE → gRPC) as data, and its process runner.

    config = EdgeConfig(router_endpoints=(Endpoint.parse("127.0.0.1:7001"),),
                        auth_endpoint=Endpoint.parse("127.0.0.1:7002"), listen_port=8080)
    text = render_static_bootstrap(config)            # the local stack's bootstrap (YAML)
    with EnvoyProcess.from_config(config, data_dir):  # started, LIVE; stopped on exit
        ...
    build_xds_resources(config)                       # the same edge for an ADS server
    render_node_bootstrap(NodeEnvoyConfig(...))       # the node-local Envoy (gateway path)
    EnvoyProcess.from_global_config(GlobalTierConfig(regions={"eu": [...], "us": [...]}),
                                    data_dir)         # the global tier before the regions
    known_request_fields(config.descriptor_set, config.services)  # the field guard's tables

Which module builds what: this folder's README; why each non-obvious Envoy setting is there,
with its public source: `docs/envoy.md`; the Lua filters live in `lua/`. Header names come
from their one definition, `inferplane.wire.headers`: `PICK_NAMESPACE`, `PICK_KEY`
(`DESTINATION_ENDPOINT`), `SERVED_KEY` (`DESTINATION_ENDPOINT_SERVED`) and
`REPLICA_ADDRESS_HEADER` (`REPLICA_ADDRESS`) are its names under the edge's older spelling.
"""

from inferplane.edge._ads import build_ads_bootstrap, render_ads_bootstrap
from inferplane.edge._base import (
    BOOTSTRAP_TYPE,
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    lua_source,
)
from inferplane.edge._bootstrap import (
    build_bootstrap,
    build_xds_resources,
    render_static_bootstrap,
    to_proto,
)
from inferplane.edge._clusters import (
    AUTH_CLUSTER,
    REPLICAS_CLUSTER,
    ROUTER_CLUSTER,
    build_clusters,
    build_endpoints,
)
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
from inferplane.edge._filters import (
    FILTER_ORDER,
    METADATA_NAMESPACE,
    PICKER_FILTERS,
    build_ext_proc_filter,
    build_http_filters,
    prune_descriptor_set,
)
from inferplane.edge._global import (
    GlobalTierConfig,
    build_global_bootstrap,
    home_cluster,
    pinned_cluster,
    render_global_bootstrap,
)
from inferplane.edge._listener import LISTENER_NAME, build_http_connection_manager, build_listener
from inferplane.edge._node import (
    NODE_FILTER_ORDER,
    NODE_REPLICAS_CLUSTER,
    REPLICA_ADDRESS_HEADER,
    NodeEnvoyConfig,
    build_node_bootstrap,
    render_node_bootstrap,
)
from inferplane.edge._process import EnvoyProcess, envoy_binary, validate_bootstrap
from inferplane.edge._region import REGION_FILTERS
from inferplane.edge._replies import build_local_reply_config
from inferplane.edge._routes import ROUTE_CONFIG_NAME, build_route_config
from inferplane.wire.headers import DESTINATION_ENDPOINT as PICK_KEY
from inferplane.wire.headers import DESTINATION_ENDPOINT_SERVED as SERVED_KEY
from inferplane.wire.headers import PICK_NAMESPACE

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
    "REGION_FILTERS",
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
    "GlobalTierConfig",
    "KnownFields",
    "MiB",
    "Nested",
    "NodeEnvoyConfig",
    "build_ads_bootstrap",
    "build_bootstrap",
    "build_clusters",
    "build_endpoints",
    "build_ext_proc_filter",
    "build_global_bootstrap",
    "build_http_connection_manager",
    "build_http_filters",
    "build_listener",
    "build_local_reply_config",
    "build_node_bootstrap",
    "build_route_config",
    "build_xds_resources",
    "envoy_binary",
    "home_cluster",
    "known_request_fields",
    "load_descriptor_set",
    "lua_source",
    "pinned_cluster",
    "prune_descriptor_set",
    "render_ads_bootstrap",
    "render_global_bootstrap",
    "render_lua_tables",
    "render_node_bootstrap",
    "render_static_bootstrap",
    "template_lua_pattern",
    "to_proto",
    "validate_bootstrap",
]

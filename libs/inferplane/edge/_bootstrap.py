"""The edge as a whole: the static Bootstrap (`envoy -c`), its text, the pieces every
inferplane bootstrap shares (node identity and admin API, the downstream connection cap),
and the same resources as xds-protos messages for the orchestrator's ADS server.

The static bootstrap and the xDS resources come from the same builders, so the local stack
and the orchestrator-pushed edge cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from inferplane.edge._base import (
    BOOTSTRAP_TYPE,
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    TYPE_URL_PREFIX,
    Resource,
    render_bootstrap,
)
from inferplane.edge._clusters import build_clusters, build_endpoints
from inferplane.edge._config import EdgeConfig
from inferplane.edge._listener import build_listener
from inferplane.edge._routes import build_route_config

_DOWNSTREAM_CONNECTIONS = (
    TYPE_URL_PREFIX
    + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)


def node_and_admin(node_id: str, node_cluster: str, admin_host: str, admin_port: int) -> Resource:
    """A bootstrap's `node` (the identity xDS snapshots are keyed by) and `admin` (the admin
    API's address: keep it on loopback, it can shut Envoy down)."""
    return {
        "node": {"id": node_id, "cluster": node_cluster},
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
    }


def connection_cap(max_connections: int) -> Resource:
    """A bootstrap's `overload_manager`: at most `max_connections` downstream connections
    over all listeners (Envoy refuses more; without a cap it warns at start-up)."""
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": _DOWNSTREAM_CONNECTIONS,
                    "max_active_downstream_connections": max_connections,
                },
            }
        ]
    }


def static_bootstrap(
    config: EdgeConfig, listeners: list[Resource], clusters: list[Resource]
) -> Resource:
    """A static Bootstrap (`BOOTSTRAP_TYPE`) of `listeners` and `clusters`, with
    `config`'s node identity, admin API and downstream connection cap (the edge's and the
    node Envoy's)."""
    return {
        **node_and_admin(config.node_id, config.node_cluster, config.admin_host, config.admin_port),
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "overload_manager": connection_cap(config.max_connections),
    }


def build_bootstrap(config: EdgeConfig) -> Resource:
    """A static Bootstrap (`BOOTSTRAP_TYPE`) holding the listener and clusters."""
    return static_bootstrap(config, [build_listener(config)], build_clusters(config))


def render_static_bootstrap(config: EdgeConfig, *, fmt: str = "yaml") -> str:
    """The static bootstrap as text for `envoy -c`: `fmt` is "yaml" or "json".

    Raises: ValueError for another `fmt`.
    """
    return render_bootstrap(
        build_bootstrap(config), fmt, generated_by="inferplane.edge.render_static_bootstrap"
    )


#: The one typed_config the xds-protos wheel lacks (Envoy's body size limit filter, newer than
#: the wheel), as Envoy's own `body_size_limit.proto` defines it.
_BODY_SIZE_LIMIT_PROTO = "envoy/extensions/filters/http/body_size_limit/v3/body_size_limit.proto"


def _register_body_size_limit() -> None:
    """Adds `BodySizeLimit` (`max_request_bytes`: UInt32Value, field 1) to the default pool,
    so json_format can parse it inside an `Any`; a no-op when the pool has it."""
    from google.protobuf import descriptor_pb2, descriptor_pool, wrappers_pb2

    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_BODY_SIZE_LIMIT_PROTO)
        return
    except KeyError:
        pass
    uint32 = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name=_BODY_SIZE_LIMIT_PROTO,
        package="envoy.extensions.filters.http.body_size_limit.v3",
        syntax="proto3",
        dependency=[wrappers_pb2.DESCRIPTOR.name],
    )
    file.message_type.add(name="BodySizeLimit").field.add(
        name="max_request_bytes",
        json_name="maxRequestBytes",
        number=1,
        label=uint32.LABEL_OPTIONAL,
        type=uint32.TYPE_MESSAGE,
        type_name=".google.protobuf.UInt32Value",
    )
    pool.Add(file)


def _message_types() -> dict[str, type[Message]]:
    _register_body_size_limit()
    # Importing these registers every typed_config type in the default pool, which
    # json_format needs to parse the `Any` fields.
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.endpoint.v3 import endpoint_pb2
    from envoy.config.listener.v3 import listener_pb2
    from envoy.config.route.v3 import route_pb2
    from envoy.config.trace.v3 import opentelemetry_pb2  # noqa: F401
    from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2  # noqa: F401
    from envoy.extensions.access_loggers.grpc.v3 import als_pb2  # noqa: F401
    from envoy.extensions.access_loggers.stream.v3 import stream_pb2  # noqa: F401
    from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2  # noqa: F401
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
    from envoy.extensions.filters.http.grpc_json_transcoder.v3 import transcoder_pb2  # noqa: F401
    from envoy.extensions.filters.http.header_mutation.v3 import (  # noqa: F401
        header_mutation_pb2 as _header_mutation_pb2,
    )
    from envoy.extensions.filters.http.health_check.v3 import (  # noqa: F401
        health_check_pb2,
    )
    from envoy.extensions.filters.http.json_to_metadata.v3 import (  # noqa: F401
        json_to_metadata_pb2,
    )
    from envoy.extensions.filters.http.lua.v3 import lua_pb2  # noqa: F401
    from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
    from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
        http_connection_manager_pb2,
    )
    from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (  # noqa: F401
        header_mutation_pb2,
    )
    from envoy.extensions.load_balancing_policies.override_host.v3 import (  # noqa: F401
        override_host_pb2,
    )
    from envoy.extensions.load_balancing_policies.round_robin.v3 import (  # noqa: F401
        round_robin_pb2,
    )
    from envoy.extensions.resource_monitors.downstream_connections.v3 import (  # noqa: F401
        downstream_connections_pb2,
    )
    from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
    from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401

    return {
        LISTENER_TYPE: listener_pb2.Listener,
        ROUTE_TYPE: route_pb2.RouteConfiguration,
        CLUSTER_TYPE: cluster_pb2.Cluster,
        ENDPOINT_TYPE: endpoint_pb2.ClusterLoadAssignment,
        BOOTSTRAP_TYPE: bootstrap_pb2.Bootstrap,
    }


def to_proto(resource: Mapping[str, Any], type_url: str) -> Message:
    """Parses a built resource into its xds-protos message (`type_url` is e.g. `LISTENER_TYPE`).

    Raises: json_format.ParseError on a field Envoy's protos do not have; KeyError for an
    unknown `type_url`.
    """
    message = _message_types()[type_url]()
    json_format.ParseDict(dict(resource), message)
    return message


def build_xds_resources(config: EdgeConfig) -> dict[str, list[Message]]:
    """What an ADS server pushes for this edge, by type URL, in ADS order (CDS, EDS, LDS, RDS).

    Clusters use EDS and the listener fetches its routes over RDS, so endpoint and route changes
    never touch the listener (no listener drain).
    """
    return {
        CLUSTER_TYPE: [to_proto(c, CLUSTER_TYPE) for c in build_clusters(config, eds=True)],
        ENDPOINT_TYPE: [to_proto(e, ENDPOINT_TYPE) for e in build_endpoints(config)],
        LISTENER_TYPE: [to_proto(build_listener(config, rds=True), LISTENER_TYPE)],
        ROUTE_TYPE: [to_proto(build_route_config(config), ROUTE_TYPE)],
    }

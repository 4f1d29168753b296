"""Envoy v3 resources for the edge, built as data from an `EdgeConfig`.

Every builder returns a plain dict in the proto3 JSON mapping (what a YAML bootstrap holds);
`to_proto` turns one into its xds-protos message for an xDS server. The static bootstrap and
the xDS resources come from the same builders, so the local stack and the orchestrator-pushed
edge cannot drift apart.

The filter chain and its settings follow the measured recipe in `notes/envoy_edge_probe.md`
("Recommended edge recipe"); each non-obvious setting cites the section it comes from.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import descriptor_pb2, json_format
from google.protobuf.message import Message

from inferplane.edge._config import EdgeConfig, Endpoint
from inferplane.edge._fields import known_request_fields, render_lua_tables

Resource = dict[str, Any]

ROUTER_CLUSTER = "inferplane_router"
AUTH_CLUSTER = "inferplane_auth"
#: The replica processes; the endpoint picker's list chooses the host (override_host).
REPLICAS_CLUSTER = "inferplane_replicas"
#: The web console (`EdgeConfig.console_endpoint`): HTTP/1.1, its own sign-in, at CONSOLE_PREFIX.
CONSOLE_CLUSTER = "inferplane_console"
CONSOLE_PREFIX = "/console/"
LISTENER_NAME = "inferplane_edge"
ROUTE_CONFIG_NAME = "inferplane_edge_routes"
#: Dynamic-metadata namespace json_to_metadata writes `stream` into (read by stream_router.lua).
METADATA_NAMESPACE = "inferplane.edge"

#: The endpoint-picker protocol of the Gateway API Inference Extension: the picker writes the
#: ordered `host:port` list under this key of the `envoy.lb` dynamic-metadata namespace
#: (`SERVED_KEY` is the protocol's key for the host that served, when a gateway writes it).
PICK_NAMESPACE = "envoy.lb"
PICK_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"

#: Request headers only Envoy may set: ext_authz adds them after a successful `Check`
#: (tenant, key id, scopes); a client sending its own copy must not reach the services.
TRUSTED_HEADER_PREFIX = "x-inferplane-"

_T = "type.googleapis.com/"
LISTENER_TYPE = _T + "envoy.config.listener.v3.Listener"
ROUTE_TYPE = _T + "envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE = _T + "envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = _T + "envoy.config.endpoint.v3.ClusterLoadAssignment"
BOOTSTRAP_TYPE = _T + "envoy.config.bootstrap.v3.Bootstrap"
_HCM = _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_LUA = _T + "envoy.extensions.filters.http.lua.v3.Lua"
_EXT_AUTHZ = _T + "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_JSON_TO_METADATA = _T + "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"
_TRANSCODER = _T + "envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder"
_ROUTER = _T + "envoy.extensions.filters.http.router.v3.Router"
_EXT_PROC = _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_LUA_PER_ROUTE = _T + "envoy.extensions.filters.http.lua.v3.LuaPerRoute"
_EXT_AUTHZ_PER_ROUTE = _T + "envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
_FILTER_CONFIG = _T + "envoy.config.route.v3.FilterConfig"
HEALTH_PATH = "/health"
#: The speech-to-text routes (`/v1/audio/transcriptions`, `/v1/audio/translations`): their
#: multipart bodies reach the replica unparsed (InferenceService.CreateTranscription takes
#: the body as a google.api.HttpBody) and have their own size limit.
AUDIO_PREFIX = "/v1/audio/"
HEALTH_BODY = '{"status":"ok"}\n'
_OVERRIDE_HOST = _T + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_ROUND_ROBIN = _T + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
_CEL_FILTER = _T + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
_HTTP_OPTIONS = _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_EARLY_MUTATION = (
    _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
_STDOUT_LOG = _T + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"
_DOWNSTREAM_TLS = _T + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
_UPSTREAM_TLS = _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_GRPC_LOG = _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
#: The request header auth's Check sets with the key's id (a trusted x-inferplane-* header).
KEY_ID_HEADER = "x-inferplane-key-id"
#: A client's own x-request-id comes back under this name; x-request-id is always Envoy's.
CLIENT_REQUEST_ID_HEADER = "x-client-request-id"
_DOWNSTREAM_CONNECTIONS = (
    _T + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)

#: Filter names in chain order (pinned by a test; order is behaviour here).
FILTER_ORDER: tuple[str, ...] = (
    "inferplane.error_shaper",
    "inferplane.auth_failure_guard",
    "envoy.filters.http.ext_authz",
    "envoy.filters.http.json_to_metadata",
    "inferplane.stream_router",
    "inferplane.field_guard",
    "envoy.filters.http.grpc_json_transcoder",
    "envoy.filters.http.ext_proc",
    "inferplane.picker_guard",
    "envoy.filters.http.router",
)

#: Filters that run only on generation routes (off for admin, models and the 404 route).
PICKER_FILTERS: tuple[str, ...] = ("envoy.filters.http.ext_proc", "inferplane.picker_guard")


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


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def lua_source(name: str) -> str:
    """The Lua filter source `name` (`error_shaper`, `auth_failure_guard`, `stream_router`,
    `field_guard` or `picker_guard`) shipped with the package, before any substitution."""
    return resources.files("inferplane.edge").joinpath("lua", f"{name}.lua").read_text("utf-8")


def _split_files(descriptor_set: bytes) -> list[tuple[bytes, bytes]]:
    """(entry, payload) raw bytes of each `file` (field 1, length-delimited) of a FileDescriptorSet.

    Kept raw rather than re-serialized: whether the `google.api.http` option parses as a known
    extension depends on what the process imported, which would change the byte order and so
    the rendered bootstrap and xDS versions.
    """
    files, pos = [], 0
    while pos < len(descriptor_set):
        start = pos
        if descriptor_set[pos] != 0x0A:  # field 1, wire type 2
            raise ValueError(f"not a FileDescriptorSet (byte {pos})")
        pos += 1
        length = shift = 0
        while True:
            byte = descriptor_set[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        files.append((descriptor_set[start : pos + length], descriptor_set[pos : pos + length]))
        pos += length
    return files


def prune_descriptor_set(descriptor_set: bytes, services: tuple[str, ...]) -> bytes:
    """Keeps only the files that define `services` and their transitive imports.

    The transcoder needs every type reachable from the exposed services (`--include_imports`,
    probe notes top), nothing more; a smaller set keeps listener pushes small. The kept files'
    bytes are copied unchanged, so the output is the same in every process.

    Raises: KeyError naming a service that no file in the set defines.
    """
    raw = _split_files(descriptor_set)
    files = [descriptor_pb2.FileDescriptorProto.FromString(payload) for _, payload in raw]
    by_name = {f.name: f for f in files}
    keep: set[str] = set()
    stack: list[str] = []
    for service in services:
        package, _, name = service.rpartition(".")
        owner = next(
            (
                f.name
                for f in files
                if f.package == package and any(s.name == name for s in f.service)
            ),
            None,
        )
        if owner is None:
            raise KeyError(f"service {service} is not in the descriptor set")
        stack.append(owner)
    while stack:
        name = stack.pop()
        if name not in keep:
            keep.add(name)
            stack.extend(by_name[name].dependency)
    return b"".join(entry for (entry, _), f in zip(raw, files, strict=True) if f.name in keep)


def _error_json(message: str, error_type: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def _status_filter(op: str, value: int) -> dict[str, Any]:
    return {
        "status_code_filter": {
            "comparison": {"op": op, "value": {"default_value": value, "runtime_key": "unused"}}
        }
    }


def _status_is(value: int) -> dict[str, Any]:
    return _status_filter("EQ", value)


_UAEX = {"response_flag_filter": {"flags": ["UAEX"]}}


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": _CEL_FILTER, "expression": expression},
        }
    }


def _mapper(filter_: dict[str, Any], body: dict[str, Any] | None) -> dict[str, Any]:
    mapper: dict[str, Any] = {"filter": filter_}
    if body is not None:
        mapper["body_format_override"] = {"json_format": body}
    return mapper


def _audio_path() -> dict[str, Any]:
    """Access-log filter: the request's path is an audio route (`AUDIO_PREFIX`)."""
    return {
        "header_filter": {"header": {"name": ":path", "string_match": {"prefix": AUDIO_PREFIX}}}
    }


def build_local_reply_config(config: EdgeConfig) -> Resource:
    """OpenAI-shaped bodies for Envoy's own replies (first matching mapper wins).

    Envoy's local replies (transcoder 400/404, 413 body too large, 503 no upstream or auth down,
    504, the stream router's 404 for `/internal/...`) are plain text by default; transcoded
    upstream errors are not local replies and are shaped by error_shaper.lua instead. The
    ext_authz denial (flag UAEX, status < 500) already carries the auth service's OpenAI body
    and passes untouched; without that first mapper it would be wrapped twice (probe notes §4;
    `not_filter` does not exist, hence the ordered mappers).
    """
    invalid = "invalid_request_error"
    mappers = [
        _mapper({"and_filter": {"filters": [_UAEX, _status_filter("LE", 499)]}}, None),
        # The endpoint picker's refusals (ext_proc immediate responses, details `picker_…`),
        # the picker guard's 503 and the field guard's 400 already carry OpenAI's body: pass
        # them through.
        _mapper(
            _cel(
                "response.code_details.startsWith('picker_') || "
                "(response.code_details == 'lua_response' && "
                "(response.code == 503 || response.code == 400))"
            ),
            None,
        ),
        # The picker failed on a request (ext_proc error, e.g. its message timeout): fail
        # closed with a shaped 503 (notes/envoy_ext_proc_probe.md, (iv)).
        _mapper(
            _cel("response.code_details.startsWith('ext_proc_error')"),
            _error_json(
                "The endpoint picker is unavailable; please retry.",
                "server_error",
                "picker_unavailable",
            ),
        ),
        _mapper(
            {"and_filter": {"filters": [_UAEX, _status_filter("GE", 500)]}},
            _error_json(
                "The authentication service is unavailable; please retry.",
                "server_error",
                "service_unavailable",
            ),
        ),
        # The transcoder's parse errors: "Unexpected end of string. ...", "messages: invalid
        # value ..." (probe notes §3).
        _mapper(
            _status_is(400),
            _error_json(
                "Could not parse the request body: %LOCAL_REPLY_BODY%",
                invalid,
                "invalid_request_body",
            ),
        ),
        _mapper(
            _status_is(404),
            _error_json("Invalid URL (%REQ(:METHOD)% %REQ(:PATH)%)", invalid, "unknown_url"),
        ),
        # Audio uploads have their own limit (error_shaper.lua's request guard, by path).
        _mapper(
            {"and_filter": {"filters": [_status_is(413), _audio_path()]}},
            _error_json(
                "The request body is too large; audio requests are limited to "
                f"{config.max_audio_request_bytes} bytes (files up to 25 MB).",
                invalid,
                "request_too_large",
            ),
        ),
        _mapper(
            _status_is(413),
            _error_json(
                f"The request body is too large; the limit is {config.max_request_bytes} bytes.",
                invalid,
                "request_too_large",
            ),
        ),
        _mapper(
            _status_is(503),
            _error_json(
                "The service is temporarily unavailable; please retry.",
                "server_error",
                "service_unavailable",
            ),
        ),
        _mapper(
            _status_is(504),
            _error_json("The request timed out; please retry.", "server_error", "timeout"),
        ),
        _mapper(
            _status_filter("GE", 500),
            _error_json(
                "The server had an error while processing your request.",
                "server_error",
                "internal_error",
            ),
        ),
        _mapper(
            _status_filter("GE", 400),
            _error_json("%LOCAL_REPLY_BODY%", invalid, "invalid_request"),
        ),
    ]
    return {"mappers": mappers}


def build_http_filters(config: EdgeConfig) -> list[Resource]:
    """The HCM's http_filters in `FILTER_ORDER`.

    Order matters: the error shaper is first so its response hook sees the transcoded response
    last (its request hook also turns away bodies over `max_request_bytes` before anything
    buffers them, see error_shaper.lua); the auth failure guard turns away an address that
    keeps failing authentication before auth is asked again; ext_authz rejects bad keys before
    json_to_metadata buffers the body; the stream router reads the metadata json_to_metadata
    wrote and rewrites `:path` before the transcoder picks the gRPC method (probe notes §1
    variant B, recipe 1); the field guard then turns away bodies with keys the transcoder would
    drop (400 naming the key, as OpenAI does; tables from `known_request_fields` over the same
    descriptor set), on the body json_to_metadata already buffered.
    """
    descriptor = prune_descriptor_set(config.descriptor_set, config.services)
    error_shaper = (
        lua_source("error_shaper")
        .replace("__MAX_REQUEST_BYTES__", str(config.max_request_bytes))
        .replace("__MAX_AUDIO_REQUEST_BYTES__", str(config.max_audio_request_bytes))
        .replace("__AUDIO_PREFIX__", AUDIO_PREFIX)
    )
    guard = (
        lua_source("auth_failure_guard")
        .replace("__AUTH_FAILURE_LIMIT__", str(config.auth_failure_limit))
        .replace("__AUTH_FAILURE_WINDOW__", str(config.auth_failure_window_s))
    )
    field_guard = lua_source("field_guard").replace(
        "__FIELD_TABLES__",
        render_lua_tables(known_request_fields(descriptor, config.services)),
    )
    metadata_target = {"metadata_namespace": METADATA_NAMESPACE, "key": "stream"}
    return [
        {
            "name": "inferplane.error_shaper",
            "typed_config": {
                "@type": _LUA,
                "default_source_code": {"inline_string": error_shaper},
            },
        },
        {
            "name": "inferplane.auth_failure_guard",
            "typed_config": {"@type": _LUA, "default_source_code": {"inline_string": guard}},
        },
        {
            "name": "envoy.filters.http.ext_authz",
            "typed_config": {
                "@type": _EXT_AUTHZ,
                "transport_api_version": "V3",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": AUTH_CLUSTER},
                    "timeout": _duration(config.authz_timeout_s),
                },
                # An auth outage must be a shaped, retryable 503 — never an open door and never
                # Envoy's default empty 403 (probe notes §5).
                "failure_mode_allow": False,
                "status_on_error": {"code": "ServiceUnavailable"},
                "include_peer_certificate": False,
            },
        },
        {
            "name": "envoy.filters.http.json_to_metadata",
            "typed_config": {
                "@type": _JSON_TO_METADATA,
                "request_rules": {
                    "rules": [
                        {
                            # Top-level key only: a nested "stream" (metadata, tool schemas)
                            # must not switch methods (probe notes §1).
                            "selectors": [{"key": "stream"}],
                            # Default type PROTOBUF_VALUE keeps a JSON bool a bool; with STRING
                            # a `true` is not stored as "true" (probe notes §1 pitfalls).
                            "on_present": metadata_target,
                            "on_missing": {**metadata_target, "value": {"bool_value": False}},
                            "on_error": {**metadata_target, "value": {"bool_value": False}},
                        }
                    ],
                    # curl -d sends form content-type; the transcoder parses JSON regardless,
                    # so routing must too.
                    "allow_content_types": [
                        "application/json",
                        "application/x-www-form-urlencoded",
                        "text/plain",
                    ],
                    "allow_empty_content_type": True,
                },
            },
        },
        {
            "name": "inferplane.stream_router",
            "typed_config": {
                "@type": _LUA,
                "default_source_code": {"inline_string": lua_source("stream_router")},
            },
        },
        {
            "name": "inferplane.field_guard",
            "typed_config": {
                "@type": _LUA,
                "default_source_code": {"inline_string": field_guard},
            },
        },
        {
            "name": "envoy.filters.http.grpc_json_transcoder",
            "typed_config": {
                "@type": _TRANSCODER,
                "proto_descriptor_bin": base64.b64encode(descriptor).decode("ascii"),
                "services": list(config.services),
                # Without these the openai client silently gets finish_reason/usage/tool_calls
                # as None (probe notes §3).
                "print_options": {
                    "preserve_proto_field_names": True,
                    "always_print_primitive_fields": True,
                },
                # Unmapped paths → 404 instead of raw JSON passed to a gRPC server (§1).
                "request_validation_options": {"reject_unknown_method": True},
                # error_shaper.lua builds OpenAI's body; google.rpc.Status JSON is not it (§4).
                "convert_grpc_status": False,
                # Routes match the REST path (after the stream router), not /pkg.Service/Method:
                # native gRPC requests to the edge then match no route.
                "match_incoming_request_route": True,
                # SDKs add query parameters (e.g. api-version); they must not fail requests.
                "ignore_unknown_query_parameters": True,
                # The audio routes' multipart bodies pass as one HttpBody (up to 26 MiB).
                "max_request_body_size": config.buffer_limit_bytes,
                "max_response_body_size": config.max_request_bytes,
            },
        },
        build_ext_proc_filter(config),
        {
            "name": "inferplane.picker_guard",
            "typed_config": {
                "@type": _LUA,
                "default_source_code": {"inline_string": lua_source("picker_guard")},
            },
        },
        {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
    ]


def build_ext_proc_filter(config: EdgeConfig) -> Resource:
    """The ext_proc filter that asks the endpoint picker (the router) once per request.

    Follows notes/envoy_ext_proc_probe.md: the picker sees the request headers and the whole
    body after the transcoder (the typed gRPC request: model, messages for prefix affinity),
    answers `envoy.lb` metadata with its ordered list, and sees the response headers and
    trailers only (usage, finish reason, served host), never the body. `failure_mode_allow`
    is true because with false a picker that dies resets every running stream ((v)); the
    picker guard right after fails new requests closed instead. Only `x-envoy-max-retries`
    (the picker's list length - 1) and the `x-inferplane-` summary trailers (which the picker
    removes before the client) may be mutated.
    """
    namespaces = {"untyped": [PICK_NAMESPACE]}
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": ROUTER_CLUSTER}},
            "failure_mode_allow": True,
            "message_timeout": _duration(config.picker_timeout_s),
            "max_message_timeout": _duration(config.picker_max_message_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": namespaces,
                "receiving_namespaces": namespaces,
            },
            "mutation_rules": {
                "allow_expression": {"regex": "^(x-envoy-max-retries|x-inferplane-.*)$"}
            },
        },
    }


def _route(prefix: str, cluster: str, timeout_s: float | None = None) -> Resource:
    # timeout 0s disables the route timeout: generations are bounded by the stream idle
    # timeout and by the services' own deadlines (recipe step 5).
    timeout = "0s" if timeout_s is None else _duration(timeout_s)
    return {"match": {"prefix": prefix}, "route": {"cluster": cluster, "timeout": timeout}}


def _without_picker(route: Resource) -> Resource:
    """`route` with ext_proc and the picker guard off (routes the picker does not decide)."""
    route["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": {"@type": _EXT_PROC_PER_ROUTE, "disabled": True},
        "inferplane.picker_guard": {"@type": _LUA_PER_ROUTE, "disabled": True},
    }
    return route


def _health_route() -> Resource:
    """`GET /health`: 200 `{"status":"ok"}` from Envoy itself while the edge serves, with no
    key (ext_authz off) and nothing about the fleet behind it (load balancers' and clients'
    liveness checks, e.g. GuideLLM's backend check)."""
    route = _without_picker(
        {
            "match": {"path": HEALTH_PATH, "headers": [_method_is("GET")]},
            "direct_response": {"status": 200, "body": {"inline_string": HEALTH_BODY}},
            "response_headers_to_add": [
                {
                    "header": {"key": "content-type", "value": "application/json"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        }
    )
    per_filter = route["typed_per_filter_config"]
    per_filter["envoy.filters.http.ext_authz"] = {"@type": _EXT_AUTHZ_PER_ROUTE, "disabled": True}
    # The transcoder answers 404 to any path no gRPC method maps (reject_unknown_method).
    per_filter["envoy.filters.http.grpc_json_transcoder"] = {
        "@type": _FILTER_CONFIG,
        "disabled": True,
    }
    return route


def _console_routes() -> list[Resource]:
    """`/console` → `/console/`, and `/console/...` → the console cluster with every filter
    of the OpenAI path off: no ext_authz (the console signs its users in and asks auth with
    their key), no transcoder, no stream router (a playground body's `"stream": true` must not
    move the path), no error shaper (its pages are HTML), no picker. Route timeout off: the
    playground streams (the stream idle timeout still bounds it)."""
    route = _without_picker(_route(CONSOLE_PREFIX, CONSOLE_CLUSTER))
    per_filter = route["typed_per_filter_config"]
    per_filter["envoy.filters.http.ext_authz"] = {"@type": _EXT_AUTHZ_PER_ROUTE, "disabled": True}
    per_filter["envoy.filters.http.grpc_json_transcoder"] = {
        "@type": _FILTER_CONFIG,
        "disabled": True,
    }
    for lua in (
        "inferplane.error_shaper",
        "inferplane.auth_failure_guard",
        "inferplane.stream_router",
        "inferplane.field_guard",
    ):
        per_filter[lua] = {"@type": _LUA_PER_ROUTE, "disabled": True}
    redirect = {
        "match": {"path": CONSOLE_PREFIX.rstrip("/")},
        "redirect": {"path_redirect": CONSOLE_PREFIX},
        "typed_per_filter_config": dict(per_filter),
    }
    return [redirect, route]


def _method_is(method: str) -> Resource:
    return {"name": ":method", "string_match": {"exact": method}}


def _generation_route(prefix: str, config: EdgeConfig) -> Resource:
    """A route to the replica the picker chose, retried down its list before the first
    response byte only (Envoy never retries once it forwarded response headers): a refused
    or reset connection, or an UNAVAILABLE answer (a draining replica, an engine that failed
    before its first token)."""
    route = _route(prefix, REPLICAS_CLUSTER)
    route["route"]["retry_policy"] = {
        "retry_on": "connect-failure,refused-stream,reset,unavailable",
        "num_retries": config.max_retries,
    }
    return route


def build_route_config(config: EdgeConfig) -> Resource:
    """The RouteConfiguration: `GET /health` → Envoy's own 200 (no key), admin API → auth,
    `/v1/models` → the router, every other OpenAI path → the replica the endpoint picker
    chose, anything else → 404.

    Matched on the REST path (`match_incoming_request_route`), after stream_router.lua may have
    moved a streaming request to `/internal/events/...` (clients cannot reach that prefix).
    """
    return {
        "name": ROUTE_CONFIG_NAME,
        "virtual_hosts": [
            {
                "name": "openai",
                "domains": ["*"],
                "response_headers_to_add": [
                    {
                        "header": {
                            "key": CLIENT_REQUEST_ID_HEADER,
                            "value": f"%REQ({CLIENT_REQUEST_ID_HEADER})%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
                "routes": [
                    _health_route(),
                    *(_console_routes() if config.console_endpoint is not None else []),
                    _without_picker(_route("/v1/admin/", AUTH_CLUSTER, config.admin_api_timeout_s)),
                    _without_picker(
                        _route("/v1/models", ROUTER_CLUSTER, config.admin_api_timeout_s)
                    ),
                    _generation_route("/v1/", config),
                    _generation_route("/internal/events/", config),
                    _without_picker({"match": {"prefix": "/"}, "direct_response": {"status": 404}}),
                ],
            }
        ],
    }


def _slot_log(config: EdgeConfig) -> Resource:
    """One entry per finished request that carried a key, to auth's AccessLogService (see
    `EdgeConfig.slot_log`): its request id and key id name the slot to release. Unbuffered:
    the slot is free as soon as Envoy finished the request."""
    grpc_service: Resource = {"envoy_grpc": {"cluster_name": AUTH_CLUSTER}}
    if config.auth_internal_token:
        grpc_service["initial_metadata"] = [
            {"key": "x-inferplane-internal-token", "value": config.auth_internal_token}
        ]
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"header_filter": {"header": {"name": KEY_ID_HEADER, "present_match": True}}},
        "typed_config": {
            "@type": _GRPC_LOG,
            "common_config": {
                "log_name": "inferplane-slots",
                "grpc_service": grpc_service,
                "transport_api_version": "V3",
                "buffer_size_bytes": 0,
            },
            "additional_request_headers_to_log": [KEY_ID_HEADER],
        },
    }


def _access_log() -> list[Resource]:
    fields = {
        "time": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
        "status": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "grpc_status": "%GRPC_STATUS%",
        "bytes_in": "%BYTES_RECEIVED%",
        "bytes_out": "%BYTES_SENT%",
        "duration_ms": "%DURATION%",
        "upstream": "%UPSTREAM_HOST%",
        "request_id": "%REQ(X-REQUEST-ID)%",
    }
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": {"@type": _STDOUT_LOG, "log_format": {"json_format": fields}},
        }
    ]


def build_http_connection_manager(config: EdgeConfig, *, rds: bool = False) -> Resource:
    """The HttpConnectionManager with the edge's filters; `rds` fetches routes over ADS."""
    hcm: Resource = {
        "@type": _HCM,
        "stat_prefix": "edge",
        "codec_type": "AUTO",
        "server_name": "inferplane",
        # The edge faces clients: trust no x-forwarded-for, sanitize x-envoy-* headers.
        "use_remote_address": True,
        # OpenAI answers with the request's id; ours is Envoy's (see the early mutations).
        "always_set_request_id_in_response": True,
        "normalize_path": True,
        "merge_slashes": True,
        # `/internal%2Fevents/...` must not slip past the stream router's prefix check.
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "stream_idle_timeout": _duration(config.stream_idle_timeout_s),
        "request_headers_timeout": _duration(config.request_headers_timeout_s),
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": _EARLY_MUTATION,
                    "mutations": [
                        # x-request-id names the key's concurrency slot and the usage report's
                        # de-duplication: always Envoy's own. A client's id is kept (and echoed
                        # back) as x-client-request-id.
                        {
                            "append": {
                                "header": {
                                    "key": CLIENT_REQUEST_ID_HEADER,
                                    "value": "%REQ(x-request-id)%",
                                },
                                "append_action": "ADD_IF_ABSENT",
                            }
                        },
                        {"remove": "x-request-id"},
                        {"remove_on_match": {"key_matcher": {"prefix": TRUSTED_HEADER_PREFIX}}},
                        # Only the picker chooses the replica (override_host reads metadata
                        # only; this is defence in depth, notes/envoy_ext_proc_probe.md (vi)).
                        {"remove_on_match": {"key_matcher": {"exact": PICK_KEY}}},
                    ],
                },
            }
        ],
        "local_reply_config": build_local_reply_config(config),
        "http_filters": build_http_filters(config),
    }
    if rds:
        hcm["rds"] = {
            "route_config_name": ROUTE_CONFIG_NAME,
            "config_source": {"ads": {}, "resource_api_version": "V3"},
        }
    else:
        hcm["route_config"] = build_route_config(config)
    logs = _access_log() if config.access_log else []
    if config.slot_log:
        logs.append(_slot_log(config))
    if logs:
        hcm["access_log"] = logs
    return hcm


def build_downstream_tls(config: EdgeConfig) -> Resource:
    """The listener's TLS transport socket: TLS 1.2+, ALPN h2 then http/1.1, the certificate
    and key read from `tls_cert_path` / `tls_key_path`.

    Static file paths are read when the listener is built (not watched: Envoy reloads files
    only for SDS-delivered secrets), so a renewed certificate needs an edge restart or a new
    listener push.
    """
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _DOWNSTREAM_TLS,
            "common_tls_context": {
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": config.tls_cert_path},
                        "private_key": {"filename": config.tls_key_path},
                    }
                ],
            },
        },
    }


def build_upstream_tls(tls_dir: str, identity: str = "edge", peer: str = "") -> Resource:
    """The edge's mutual TLS toward inferplane's services (issue 18): Envoy presents the
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


def build_listener(config: EdgeConfig, *, rds: bool = False) -> Resource:
    """The edge Listener (`LISTENER_TYPE`) on `listen_host:listen_port`, over TLS when
    `config.tls` (`build_downstream_tls`)."""
    chain: Resource = {
        "filters": [
            {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": build_http_connection_manager(config, rds=rds),
            }
        ]
    }
    if config.tls:
        chain["transport_socket"] = build_downstream_tls(config)
    return {
        "name": LISTENER_NAME,
        "address": {
            "socket_address": {"address": config.listen_host, "port_value": config.listen_port}
        },
        # Bodies up to max_request_bytes are buffered whole by json_to_metadata (probe §4), and
        # audio uploads up to max_audio_request_bytes by the transcoder (HttpBody).
        "per_connection_buffer_limit_bytes": config.buffer_limit_bytes,
        # SO_REUSEPORT would let a second edge bind the same port and silently split traffic.
        "enable_reuse_port": False,
        "filter_chains": [chain],
    }


def _lb_endpoints(endpoints: tuple[Endpoint, ...]) -> list[Resource]:
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
    return clusters


def _override_host_policy() -> Resource:
    """Envoy's override_host load balancing: the first host of the picker's list, retries
    down the list. A pick that names no host of the cluster (a replica not yet in EDS) falls
    back to round robin. The host that served is not written back (`selected_host_key` is
    missing from xds-protos 1.85's OverrideHost, so the orchestrator could not push it): the
    replica names itself in its summary trailers (`inferplane.wire.ResponseSummary`)."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _OVERRIDE_HOST,
                        "override_host_sources": [
                            {"metadata": {"key": PICK_NAMESPACE, "path": [{"key": PICK_KEY}]}}
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
        {"cluster_name": name, "endpoints": [{"lb_endpoints": _lb_endpoints(endpoints)}]}
        for name, endpoints in _cluster_endpoints(config).items()
    ]


def build_clusters(config: EdgeConfig, *, eds: bool = False) -> list[Resource]:
    """The router, auth and replicas Clusters (`CLUSTER_TYPE`), HTTP/2 (h2c) to gRPC services.

    With `eds` the endpoints come from `build_endpoints` over ADS; otherwise they are inline
    (STATIC for IP literals, STRICT_DNS for names).
    """
    clusters = []
    for name, endpoints in _cluster_endpoints(config).items():
        cluster: Resource = {
            "name": name,
            "connect_timeout": _duration(config.connect_timeout_s),
            "per_connection_buffer_limit_bytes": config.buffer_limit_bytes,
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": _HTTP_OPTIONS,
                    "explicit_http_config": {
                        "http2_protocol_options": {
                            "connection_keepalive": (
                                REPLICA_KEEPALIVE
                                if name == REPLICAS_CLUSTER
                                else UPSTREAM_KEEPALIVE
                            ),
                        }
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
            cluster["transport_socket"] = build_upstream_tls(config.upstream_tls_dir)
        if name == CONSOLE_CLUSTER:
            # The console is an HTTP/1.1 web server (aiohttp), not gRPC.
            options = cluster["typed_extension_protocol_options"]
            options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
                "explicit_http_config"
            ] = {"http_protocol_options": {}}
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
                "endpoints": [{"lb_endpoints": _lb_endpoints(endpoints)}],
            }
        clusters.append(cluster)
    return clusters


def build_bootstrap(config: EdgeConfig) -> Resource:
    """A static Bootstrap (`BOOTSTRAP_TYPE`) holding the listener and clusters."""
    return {
        "node": {"id": config.node_id, "cluster": config.node_cluster},
        "admin": {
            "address": {
                "socket_address": {"address": config.admin_host, "port_value": config.admin_port}
            }
        },
        "static_resources": {
            "listeners": [build_listener(config)],
            "clusters": build_clusters(config),
        },
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


class _Dumper(yaml.SafeDumper):
    """Readable YAML: no anchors for shared sub-dicts, Lua sources as `|` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def render_static_bootstrap(config: EdgeConfig, *, fmt: str = "yaml") -> str:
    """The static bootstrap as text for `envoy -c`: `fmt` is "yaml" or "json".

    Raises: ValueError for another `fmt`.
    """
    bootstrap = build_bootstrap(config)
    if fmt == "json":
        return json.dumps(bootstrap, indent=2) + "\n"
    if fmt == "yaml":
        header = "# Generated by inferplane.edge.render_static_bootstrap; do not edit.\n"
        return header + yaml.dump(
            bootstrap, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True
        )
    raise ValueError(f"unknown format {fmt!r}; expected 'yaml' or 'json'")


def _message_types() -> dict[str, type[Message]]:
    # Importing these registers every typed_config type in the default pool, which
    # json_format needs to parse the `Any` fields.
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.endpoint.v3 import endpoint_pb2
    from envoy.config.listener.v3 import listener_pb2
    from envoy.config.route.v3 import route_pb2
    from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2  # noqa: F401
    from envoy.extensions.access_loggers.grpc.v3 import als_pb2  # noqa: F401
    from envoy.extensions.access_loggers.stream.v3 import stream_pb2  # noqa: F401
    from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2  # noqa: F401
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
    from envoy.extensions.filters.http.grpc_json_transcoder.v3 import transcoder_pb2  # noqa: F401
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

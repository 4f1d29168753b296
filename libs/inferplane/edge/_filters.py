"""The edge's HTTP filter chain (`FILTER_ORDER`): the Lua filters, ext_authz (routes the
picker does not run on), ext_proc (the endpoint picker, which authenticates generation
requests), json_to_metadata, the gRPC-JSON transcoder with its pruned descriptor set and the
router.

Lua sources are templates (`lua/*.lua`): every header, metadata namespace and limit they use
is filled in here from its one definition (`inferplane.wire.headers`, the runtime's error
trailer keys, `EdgeConfig`), so the scripts spell none of them. Why each non-obvious setting
is there, with its public source: `docs/envoy.md`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping

from google.protobuf import descriptor_pb2

from inferplane.apis import anthropic
from inferplane.edge._base import (
    AUDIO_PREFIX,
    TYPE_URL_PREFIX,
    Resource,
    duration,
    lua_filter,
    render_lua,
)
from inferplane.edge._clusters import AUTH_CLUSTER, ROUTER_CLUSTER
from inferplane.edge._config import EdgeConfig
from inferplane.edge._fields import known_request_fields, render_lua_tables
from inferplane.edge._region import region_filters
from inferplane.runtime import OPENAI_ERROR_CODE_KEY, OPENAI_ERROR_PARAM_KEY, OPENAI_ERROR_TYPE_KEY
from inferplane.wire import apis, ratelimit
from inferplane.wire.headers import (
    CLIENT_KEY_HEADERS,
    DESTINATION_ENDPOINT,
    ENVOY_MAX_RETRIES,
    PICK_NAMESPACE,
    PICKER_AUTHENTICATED,
    PICKER_NAMESPACE,
    REVISION,
    TRUSTED_PREFIX,
)

#: Dynamic-metadata namespace json_to_metadata writes `stream` into (read by stream_router.lua).
METADATA_NAMESPACE = "inferplane.edge"
#: The key under `METADATA_NAMESPACE` that error_shaper.lua sets (true) on a request to an
#: Anthropic path (`inferplane.wire.apis.ANTHROPIC_PATH_PREFIX`); the filters after the
#: transcoder, which see the gRPC method's path, answer in Anthropic's shape by it.
ANTHROPIC_MARK = "anthropic"

_EXT_AUTHZ = TYPE_URL_PREFIX + "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_JSON_TO_METADATA = (
    TYPE_URL_PREFIX + "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"
)
_TRANSCODER = (
    TYPE_URL_PREFIX + "envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder"
)
_ROUTER = TYPE_URL_PREFIX + "envoy.extensions.filters.http.router.v3.Router"
_EXT_PROC = TYPE_URL_PREFIX + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_BODY_SIZE_LIMIT = (
    TYPE_URL_PREFIX + "envoy.extensions.filters.http.body_size_limit.v3.BodySizeLimit"
)
#: The filter counting a request body as it streams in (`body_size_limit_filter`).
BODY_LIMIT_FILTER = "envoy.filters.http.body_size_limit"

#: Filter names in chain order (pinned by a test; order is behaviour here).
FILTER_ORDER: tuple[str, ...] = (
    "inferplane.error_shaper",
    "envoy.filters.http.body_size_limit",
    "inferplane.auth_failure_guard",
    "envoy.filters.http.ext_authz",
    "envoy.filters.http.ext_proc",
    "inferplane.picker_guard",
    "envoy.filters.http.json_to_metadata",
    "inferplane.stream_router",
    "inferplane.field_guard",
    "envoy.filters.http.grpc_json_transcoder",
    "envoy.filters.http.router",
)

#: Filters that run only on generation routes (off for admin, models and the 404 route);
#: ext_proc is also disabled in the chain (`_off_by_default`) and turned on by those routes
#: (`_routes.with_picker`). The picker guard has no response hook, so it stays on by default
#: (Lua has no empty per-route config that enables a filter).
PICKER_FILTERS: tuple[str, ...] = ("envoy.filters.http.ext_proc", "inferplane.picker_guard")
#: The one authenticator of the routes the picker does not run on; off where it runs (the
#: picker authenticates there, in its first exchange).
AUTHZ_FILTER = "envoy.filters.http.ext_authz"


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

    The transcoder needs every type reachable from the exposed services (protoc's
    `--include_imports`), nothing more; a smaller set keeps listener pushes small. The kept
    files' bytes are copied unchanged, so the output is the same in every process.

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


def _lua_table(values: Mapping[int, object]) -> str:
    """`{[k] = v, ...}` as Lua source (string values quoted as JSON strings, which Lua reads
    alike for the plain ASCII names used here)."""
    items = ", ".join(f"[{k}] = {json.dumps(v)}" for k, v in sorted(values.items()))
    return "{" + items + "}"


def _error_shaper(config: EdgeConfig) -> str:
    statuses = {s: anthropic.error_status(s) for s in anthropic.ERROR_TYPES}
    return render_lua(
        "error_shaper",
        MAX_REQUEST_BYTES=config.max_request_bytes,
        MAX_AUDIO_REQUEST_BYTES=config.max_audio_request_bytes,
        AUDIO_PREFIX=AUDIO_PREFIX,
        ERROR_TYPE_KEY=OPENAI_ERROR_TYPE_KEY,
        ERROR_CODE_KEY=OPENAI_ERROR_CODE_KEY,
        ERROR_PARAM_KEY=OPENAI_ERROR_PARAM_KEY,
        ANTHROPIC_PREFIX=apis.ANTHROPIC_PATH_PREFIX,
        METADATA_NAMESPACE=METADATA_NAMESPACE,
        ANTHROPIC_MARK=ANTHROPIC_MARK,
        ANTHROPIC_TYPES=_lua_table(anthropic.ERROR_TYPES),
        ANTHROPIC_STATUS=_lua_table({s: t for s, t in statuses.items() if s != t}),
    )


def _json_to_metadata() -> Resource:
    target = {"metadata_namespace": METADATA_NAMESPACE, "key": "stream"}
    return {
        "name": "envoy.filters.http.json_to_metadata",
        "typed_config": {
            "@type": _JSON_TO_METADATA,
            "request_rules": {
                "rules": [
                    {
                        # Top-level key only: a nested "stream" (metadata, tool schemas)
                        # must not switch methods.
                        "selectors": [{"key": "stream"}],
                        # Default type PROTOBUF_VALUE keeps a JSON bool a bool; with STRING
                        # a `true` is not stored as "true" (measured on Envoy 1.40).
                        "on_present": target,
                        "on_missing": {**target, "value": {"bool_value": False}},
                        "on_error": {**target, "value": {"bool_value": False}},
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
    }


def _transcoder(config: EdgeConfig, descriptor: bytes) -> Resource:
    return {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            "@type": _TRANSCODER,
            "proto_descriptor_bin": base64.b64encode(descriptor).decode("ascii"),
            "services": list(config.services),
            # Without these the openai client silently gets finish_reason/usage/tool_calls
            # as None: Envoy's default prints camelCase names and omits zero values.
            "print_options": {
                "preserve_proto_field_names": True,
                "always_print_primitive_fields": True,
            },
            # Unmapped paths → 404 instead of raw JSON passed to a gRPC server (which resets
            # the stream: a 503 "upstream connect error").
            "request_validation_options": {"reject_unknown_method": True},
            # error_shaper.lua builds OpenAI's body; a google.rpc.Status JSON
            # (`{"code":16,"message":...}`) is not it.
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
    }


def body_limit_filter(config: EdgeConfig) -> Resource:
    """Envoy's body size limit at `max_request_bytes`: it counts the body as it streams in and
    answers 413 (`_replies.py` shapes it) the moment the count passes the limit, before
    anything buffers the rest. error_shaper.lua refuses a declared Content-Length over the
    limit from the headers; this filter is what stops a body without one (chunked HTTP/1.1,
    HTTP/2 without content-length): a Lua filter cannot answer once it has let the headers
    through, so the script's own chunk counter never could (measured on Envoy 1.40: a 10 MiB
    chunked chat body reached the replica). Off on the audio route (`_routes.py`), whose
    uploads Envoy's buffer limit (`buffer_limit_bytes`, the audio limit) bounds instead."""
    return {
        "name": BODY_LIMIT_FILTER,
        "typed_config": {"@type": _BODY_SIZE_LIMIT, "max_request_bytes": config.max_request_bytes},
    }


def _off_by_default(http_filter: Resource) -> Resource:
    """`http_filter` (ext_proc) disabled unless a route turns it on (`_routes.with_picker`:
    the generation routes only). Off on a request no route matches and on Envoy's reply to a
    request its codec refused (a NUL in a header, an unknown method): ext_proc would
    otherwise open a picker stream for that reply's headers, and the codec closes the
    connection before the picker answers, so the client got no bytes at all (measured on
    Envoy 1.40; `libs/tests/edge/test_edge_hostile.py`)."""
    return {**http_filter, "disabled": True}


def build_http_filters(config: EdgeConfig) -> list[Resource]:
    """The HCM's http_filters in `FILTER_ORDER`, after `_region.REGION_FILTERS` when
    `config.region` is set (the served-region header and the region's ready route).

    Order matters: the error shaper is first so its response hook sees the transcoded response
    last (its request hook also turns away bodies over `max_request_bytes` before anything
    buffers them, see error_shaper.lua); the auth failure guard turns away an address that
    keeps failing authentication before a key is checked again (its response hook sees both
    authenticators' 401s); ext_authz (routes without the picker) and ext_proc (the picker,
    generation routes: it authenticates on the request headers, before the body is buffered,
    then reads the client's body as it came and picks) refuse bad keys before anything reads
    the body; the picker guard right after fails closed when the picker did not answer or
    did not authenticate; json_to_metadata then reads `stream`; the stream router reads the
    metadata json_to_metadata wrote and rewrites `:path` before the transcoder picks the gRPC
    method (the transcoder picks it from verb and path when the headers arrive, before the
    body; a route's `prefix_rewrite` would come after that choice); the field guard then turns
    away bodies with keys the transcoder would drop (400 naming the key, as OpenAI does;
    tables from `known_request_fields` over the same descriptor set), on the body
    json_to_metadata
    already buffered.
    """
    descriptor = prune_descriptor_set(config.descriptor_set, config.services)
    guard = render_lua(
        "auth_failure_guard",
        AUTH_FAILURE_LIMIT=config.auth_failure_limit,
        AUTH_FAILURE_WINDOW=config.auth_failure_window_s,
    )
    field_guard = render_lua(
        "field_guard",
        FIELD_TABLES=render_lua_tables(known_request_fields(descriptor, config.services)),
        METADATA_NAMESPACE=METADATA_NAMESPACE,
        ANTHROPIC_MARK=ANTHROPIC_MARK,
    )
    region = region_filters(config.region, ROUTER_CLUSTER) if config.region else []
    return [
        *region,
        lua_filter("inferplane.error_shaper", _error_shaper(config)),
        body_limit_filter(config),
        lua_filter("inferplane.auth_failure_guard", guard),
        {
            "name": "envoy.filters.http.ext_authz",
            "typed_config": {
                "@type": _EXT_AUTHZ,
                "transport_api_version": "V3",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": AUTH_CLUSTER},
                    "timeout": duration(config.authz_timeout_s),
                },
                # An auth outage must be a shaped, retryable 503 — never an open door and never
                # Envoy's default for an authorizer error or timeout, an empty 403.
                "failure_mode_allow": False,
                "status_on_error": {"code": "ServiceUnavailable"},
                "include_peer_certificate": False,
            },
        },
        _off_by_default(build_ext_proc_filter(config)),
        lua_filter(
            "inferplane.picker_guard",
            render_lua(
                "picker_guard",
                PICK_NAMESPACE=PICK_NAMESPACE,
                PICK_KEY=DESTINATION_ENDPOINT,
                PICKER_NAMESPACE=PICKER_NAMESPACE,
                PICKER_AUTHENTICATED=PICKER_AUTHENTICATED,
                METADATA_NAMESPACE=METADATA_NAMESPACE,
                ANTHROPIC_MARK=ANTHROPIC_MARK,
                ANTHROPIC_OVERLOADED=anthropic.OVERLOADED_STATUS,
            ),
        ),
        _json_to_metadata(),
        lua_filter(
            "inferplane.stream_router",
            render_lua("stream_router", METADATA_NAMESPACE=METADATA_NAMESPACE),
        ),
        lua_filter("inferplane.field_guard", field_guard),
        _transcoder(config, descriptor),
        {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
    ]


def build_ext_proc_filter(config: EdgeConfig) -> Resource:
    """The ext_proc filter that asks the endpoint picker (the router) once per request.

    The picker sees the client's request as it came: the headers (REST `:path`, the key),
    which it authenticates before any body is read (auth's verdict headers set, the key
    removed, `PICKER_NAMESPACE`/`PICKER_AUTHENTICATED` set), then the whole body (JSON, or an
    audio upload's multipart bytes) it decides on; it answers `envoy.lb` metadata with its
    ordered list (`receiving_namespaces` must name it, or Envoy drops the answer silently and
    balances round robin) and the routed model under `PICKER_NAMESPACE`, and sees the
    response headers and trailers only (usage, finish reason, served host), never the body.
    `failure_mode_allow` is true because with false a picker that dies resets every stream in
    flight (measured on Envoy 1.40: streams reset mid-way with gRPC INTERNAL); the picker
    guard right after fails new requests closed instead (no pick, or no authenticated mark).
    Only `x-envoy-max-retries` (the picker's list length - 1), the trusted `x-inferplane-`
    headers (auth's verdict on the request; the summary trailers, which the picker removes
    before the client), the client's key headers and an operator's revision pin (`REVISION`;
    removed), and the per-key limits' response headers (`x-ratelimit-*` on an allowed response,
    `retry-after`: `inferplane.wire.ratelimit`) may be mutated.
    """
    namespaces = {"untyped": [PICK_NAMESPACE, PICKER_NAMESPACE]}
    # Sorted: RE2 factors the common prefixes of adjacent alternatives (`x-`), which keeps
    # the program under Envoy's size limit (100).
    mutable = "|".join(
        sorted(
            (
                ENVOY_MAX_RETRIES,
                f"{TRUSTED_PREFIX}.*",
                *CLIENT_KEY_HEADERS,
                REVISION,
                f"{ratelimit.PREFIX}.*",
                ratelimit.RETRY_AFTER,
            )
        )
    )
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": ROUTER_CLUSTER}},
            "failure_mode_allow": True,
            "message_timeout": duration(config.picker_timeout_s),
            "max_message_timeout": duration(config.picker_max_message_timeout_s),
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
            "mutation_rules": {"allow_expression": {"regex": f"^({mutable})$"}},
        },
    }

"""The edge's Listener and its HttpConnectionManager (early header mutations, access logs,
local replies, filters, routes), the listener's TLS, and the listener pieces the node-local
Envoy shares with it: the HCM's path and timeout hardening (`hcm_limits`) and the listener
itself with its buffer limit (`listener`).
"""

from __future__ import annotations

from inferplane.edge._base import HCM_TYPE, TYPE_URL_PREFIX, Resource, duration
from inferplane.edge._clusters import TELEMETRY_CLUSTER
from inferplane.edge._config import EdgeConfig
from inferplane.edge._filters import build_http_filters
from inferplane.edge._replies import build_local_reply_config
from inferplane.edge._routes import ROUTE_CONFIG_NAME, build_route_config
from inferplane.edge._tracing import build_tracing
from inferplane.wire.headers import (
    CLIENT_REQUEST_ID,
    DESTINATION_ENDPOINT,
    INTERNAL_TOKEN,
    PICKER_MODEL,
    PICKER_NAMESPACE,
    REQUEST_ID,
    TRUSTED_PREFIX,
)

LISTENER_NAME = "inferplane_edge"

_EARLY_MUTATION = (
    TYPE_URL_PREFIX
    + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
_STDOUT_LOG = TYPE_URL_PREFIX + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"
_DOWNSTREAM_TLS = TYPE_URL_PREFIX + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
_GRPC_LOG = TYPE_URL_PREFIX + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"


def hcm_limits(config: EdgeConfig) -> Resource:
    """The HttpConnectionManager fields the edge and the node Envoy share: normalized paths
    with merged slashes, escaped slashes refused (`/internal%2Fevents/...` must not slip past
    the stream router's prefix check), `config.stream_idle_timeout_s` (bounds a generation
    that stopped sending) and `config.request_headers_timeout_s`."""
    return {
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "stream_idle_timeout": duration(config.stream_idle_timeout_s),
        "request_headers_timeout": duration(config.request_headers_timeout_s),
    }


def listener(
    name: str, config: EdgeConfig, hcm: Resource, transport_socket: Resource | None = None
) -> Resource:
    """A Listener `name` on `config.listen_host:listen_port` with one filter chain running
    `hcm` (over `transport_socket` when given), shared by the edge and the node Envoy.

    Its per-connection buffer limit is `config.buffer_limit_bytes`: bodies up to
    `max_request_bytes` are buffered whole by json_to_metadata and audio uploads up to
    `max_audio_request_bytes` by the transcoder (HttpBody); Envoy's 1 MiB default would
    answer 413 to a larger body. SO_REUSEPORT stays off: it would let a second Envoy bind the
    same port and silently split the traffic.
    """
    chain: Resource = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]
    }
    if transport_socket is not None:
        chain["transport_socket"] = transport_socket
    return {
        "name": name,
        "address": {
            "socket_address": {"address": config.listen_host, "port_value": config.listen_port}
        },
        "per_connection_buffer_limit_bytes": config.buffer_limit_bytes,
        "enable_reuse_port": False,
        "filter_chains": [chain],
    }


def _overhead_log(config: EdgeConfig) -> Resource:
    """One entry per request the picker routed as a model (its dynamic metadata names it:
    `PICKER_NAMESPACE` / `PICKER_MODEL`), to telemetry's AccessLogService (see
    `EdgeConfig.telemetry_endpoint`), which observes the edge's overhead from the entry's
    timings. Buffered (up to 16 KiB or 1 s): a metric, not a decision, waits on it."""
    grpc_service: Resource = {"envoy_grpc": {"cluster_name": TELEMETRY_CLUSTER}}
    if config.telemetry_internal_token:
        grpc_service["initial_metadata"] = [
            {"key": INTERNAL_TOKEN, "value": config.telemetry_internal_token}
        ]
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {
            "metadata_filter": {
                "matcher": {
                    "filter": PICKER_NAMESPACE,
                    "path": [{"key": PICKER_MODEL}],
                    "value": {"present_match": True},
                },
                "match_if_key_not_found": False,
            }
        },
        "typed_config": {
            "@type": _GRPC_LOG,
            "common_config": {
                "log_name": "inferplane-edge-overhead",
                "grpc_service": grpc_service,
                "transport_api_version": "V3",
                "buffer_size_bytes": 16 * 1024,
                "buffer_flush_interval": duration(1.0),
            },
        },
    }


def access_log() -> list[Resource]:
    """One JSON line per request on stdout (time, method, path, status, response flags and
    details, gRPC status, bytes, duration in ms, upstream host, request id)."""
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
        "request_id": f"%REQ({REQUEST_ID.upper()})%",
    }
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": {"@type": _STDOUT_LOG, "log_format": {"json_format": fields}},
        }
    ]


def _early_header_mutation() -> Resource:
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": _EARLY_MUTATION,
            "mutations": [
                # The request id names the key's concurrency slot and the usage report's
                # de-duplication: always Envoy's own. A client's id is kept (and echoed back)
                # under CLIENT_REQUEST_ID.
                {
                    "append": {
                        "header": {"key": CLIENT_REQUEST_ID, "value": f"%REQ({REQUEST_ID})%"},
                        "append_action": "ADD_IF_ABSENT",
                    }
                },
                {"remove": REQUEST_ID},
                {"remove_on_match": {"key_matcher": {"prefix": TRUSTED_PREFIX}}},
                # Only the picker chooses the replica: override_host reads the pick from
                # metadata only, so this is defence in depth. It must run before ext_proc (a
                # route's request_headers_to_remove runs after it, and would also remove a
                # header the picker set).
                {"remove_on_match": {"key_matcher": {"exact": DESTINATION_ENDPOINT}}},
            ],
        },
    }


def build_http_connection_manager(config: EdgeConfig, *, rds: bool = False) -> Resource:
    """The HttpConnectionManager with the edge's filters; `rds` fetches routes over ADS."""
    hcm: Resource = {
        "@type": HCM_TYPE,
        "stat_prefix": "edge",
        "codec_type": "AUTO",
        "server_name": "inferplane",
        # The edge faces clients: trust no x-forwarded-for, sanitize x-envoy-* headers.
        "use_remote_address": True,
        # OpenAI answers with the request's id; ours is Envoy's (see the early mutations).
        "always_set_request_id_in_response": True,
        **hcm_limits(config),
        "early_header_mutation_extensions": [_early_header_mutation()],
        "local_reply_config": build_local_reply_config(config),
        "http_filters": build_http_filters(config),
    }
    if config.region:
        # A region's edge sits behind the global tier, which appends the client's address to
        # x-forwarded-for: that entry is the client (the auth failure guard counts by it),
        # not the tier's address shared by every client. Reach it through the tier only.
        hcm["xff_num_trusted_hops"] = 1
    if rds:
        hcm["rds"] = {
            "route_config_name": ROUTE_CONFIG_NAME,
            "config_source": {"ads": {}, "resource_api_version": "V3"},
        }
    else:
        hcm["route_config"] = build_route_config(config)
    logs = access_log() if config.access_log else []
    if config.telemetry_endpoint is not None:
        logs.append(_overhead_log(config))
    if logs:
        hcm["access_log"] = logs
    tracing = build_tracing(config)
    if tracing is not None:
        hcm["tracing"] = tracing
    return hcm


def build_downstream_tls(config: EdgeConfig) -> Resource:
    """The listener's TLS transport socket: TLS 1.2+, ALPN h2 then http/1.1, the certificate
    and key read from `tls_cert_path` / `tls_key_path`.

    Static file paths are read when the listener is built (not watched: Envoy reloads files
    only for SDS-delivered secrets), so a renewed certificate needs an edge restart or a new
    listener push.
    """
    return downstream_tls(config.tls_cert_path, config.tls_key_path)


def downstream_tls(cert_path: str, key_path: str) -> Resource:
    """A client-facing listener's TLS transport socket (the edge's, the global tier's): TLS
    1.2+, ALPN h2 then http/1.1, the PEM certificate chain `cert_path` and key `key_path`."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _DOWNSTREAM_TLS,
            "common_tls_context": {
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": cert_path},
                        "private_key": {"filename": key_path},
                    }
                ],
            },
        },
    }


def build_listener(config: EdgeConfig, *, rds: bool = False) -> Resource:
    """The edge Listener (`LISTENER_TYPE`) on `listen_host:listen_port`, over TLS when
    `config.tls` (`build_downstream_tls`)."""
    tls = build_downstream_tls(config) if config.tls else None
    return listener(
        LISTENER_NAME, config, build_http_connection_manager(config, rds=rds), transport_socket=tls
    )

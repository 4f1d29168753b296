"""The global tier (issue 31, docs/regions.md): one Envoy in front of the regions' edges that
sends each request to its key's home region, then down the region's fallback order, and
never out of the region of a pinned key.

`GlobalTierConfig` holds the regions (name → its edges), the fallback orders, the default
region and the listener; `build_global_bootstrap` / `render_global_bootstrap` turn it into a
static Envoy bootstrap (`EnvoyProcess.from_global_config` runs it).

How a request is routed (`inferplane.regions` names the prefixes):

- the key is read from `authorization: Bearer <secret>` or `x-api-key: <secret>`
  (`wire.headers.CLIENT_KEY_HEADERS`); the tier does not authenticate (the region's picker
  does) and forwards every header, body and stream unchanged;
- a secret starting `ip-<r>.` goes to cluster `global_home_<r>`: r's edges at priority 0,
  then each fallback region's at priority 1, 2, ...; one starting `ip-<r>~` (pinned) to
  `global_pinned_<r>`, r's edges only; any other to the default region's home cluster;
- every edge is health-checked on `REGION_READY_PATH` and watched by outlier detection, and
  no cluster ever routes to an unhealthy edge (`healthy_panic_threshold` 0): a region whose
  edges are all unhealthy hands its share to the next priority;
- a request is retried before its response starts (connect failure, refused stream, reset
  before the response headers, a 503 or Anthropic's 529 answer) on the next priority;
  once the region's response headers have been forwarded, Envoy never retries, so a stream
  cut by a region's loss ends with a transport error in the client, never a replay;
- a pinned key whose region has no healthy edge (or whose connect failed) gets Envoy's 503,
  rewritten here to `region_unavailable` in the API's error shape (OpenAI's; Anthropic's 529
  on `/v1/messages*`), naming the region.

Request ids: the tier neither generates nor replaces `x-request-id`: a client's own passes to
the region's edge as if the client had connected there (the edge keeps it as
`CLIENT_REQUEST_ID` and issues its own), and the access log records the region's id from the
response.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, cast

from inferplane.apis import anthropic
from inferplane.edge._base import (
    HTTP_OPTIONS_KEY,
    HTTP_OPTIONS_TYPE,
    Resource,
    duration,
    render_bootstrap,
)
from inferplane.edge._base import TYPE_URL_PREFIX as _T
from inferplane.edge._bootstrap import connection_cap, node_and_admin
from inferplane.edge._clusters import lb_endpoints
from inferplane.edge._config import EdgeConfig, Endpoint
from inferplane.edge._errors import EdgeConfigError
from inferplane.edge._global_replies import build_global_local_replies, pinned_route_prefix
from inferplane.edge._listener import access_log, downstream_tls
from inferplane.edge._routes import method_not_allowed_routes
from inferplane.regions import REGION_READY_PATH, secret_prefix
from inferplane.regions import validate_region as _validate_region
from inferplane.wire.headers import API_KEY, AUTHORIZATION, REQUEST_ID

GLOBAL_LISTENER = "inferplane_global"
GLOBAL_ROUTES = "inferplane_global_routes"
UPSTREAM_PROTOCOLS: tuple[str, ...] = ("http1", "h2c")


def home_cluster(region: str) -> str:
    """The cluster of keys homed in `region`: its edges, then its fallbacks' by priority."""
    return f"global_home_{region}"


def pinned_cluster(region: str) -> str:
    """The cluster of keys pinned to `region`: its edges only."""
    return f"global_pinned_{region}"


def _edge_default(name: str) -> Any:
    """The regional edge's default for `name` (one definition: `EdgeConfig`)."""
    return EdgeConfig.__dataclass_fields__[name].default


def _check_region(name: str) -> str:
    try:
        return _validate_region(name)
    except ValueError as exc:
        raise EdgeConfigError(str(exc)) from exc


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GlobalTierConfig:
    """Everything the global tier's Envoy is built from. Ports are TCP ports, durations
    seconds, sizes bytes.

    Attributes:
        regions: region name → its edges (`host:port` strings or `Endpoint`s), in the order
            that is also every region's default fallback order. At least one region, each
            with at least one edge.
        fallbacks: region name → the regions its keys fail over to, in order (each a listed
            region, not itself, no repeats). A region missing here falls back to every other
            region in `regions` order; an empty tuple means no fallback.
        default_region: the home of keys whose secret names no region (bootstrap keys,
            secrets from before regions); "" = the first listed region.
        listen_host / listen_port: where clients connect (HTTP/1.1 or h2c).
        tls_cert_path / tls_key_path: PEM certificate chain and key of the listener: both set,
            clients connect over TLS only (1.2+, ALPN h2 and http/1.1, as the edge's
            listener); both empty: plain text (a load balancer in front terminates TLS).
        admin_host / admin_port: Envoy's admin API (keep it on loopback).
        upstream_protocol: how the tier speaks to the regions' edges: "h2c" (the default: its
            pings find a silently cut region's connections, `REGION_KEEPALIVE`) or "http1"
            (both served by the edge's listener, `codec_type: AUTO`); the health checks use
            the same.
        node_id / node_cluster: the Envoy node identity.
        health_check_interval_s / health_check_timeout_s: each edge's ready route is asked
            this often (also without traffic), each check failing after the timeout.
        unhealthy_threshold / healthy_threshold: failed checks that turn an edge unhealthy,
            passed checks that turn it healthy again.
        consecutive_local_failures: connect failures, resets or timeouts in a row that eject
            an edge at once (outlier detection), before its health check notices.
        consecutive_5xx: 5xx answers in a row from one edge that eject it (a region whose
            every request fails); kept high because a region's own 503s (one model
            overloaded) are normal answers, which the retry on 503 already handles.
        ejection_s: an ejected edge's first ejection time (a passing health check returns it
            sooner).
        connect_timeout_s, stream_idle_timeout_s, request_headers_timeout_s: as the regional
            edge's (`EdgeConfig`); there is no route timeout (a stream lasts as long as it
            sends).
        max_request_bytes: the largest body kept for a retry (larger ones are forwarded but
            not retried); the edge's largest limit by default (audio uploads).
        max_concurrent_requests / max_connections: circuit breakers per cluster, and the cap
            on client connections.
        access_log: one JSON line per request on stdout.
    """

    regions: Mapping[str, Sequence[Endpoint | str]]
    fallbacks: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    default_region: str = ""
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    tls_cert_path: str = ""
    tls_key_path: str = ""
    admin_host: str = "127.0.0.1"
    admin_port: int = 9901
    upstream_protocol: str = "h2c"
    node_id: str = "inferplane-global"
    node_cluster: str = "inferplane-global"
    health_check_interval_s: float = 1.0
    health_check_timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    consecutive_local_failures: int = 2
    consecutive_5xx: int = 20
    ejection_s: float = 30.0
    connect_timeout_s: float = _edge_default("connect_timeout_s")
    stream_idle_timeout_s: float = _edge_default("stream_idle_timeout_s")
    request_headers_timeout_s: float = _edge_default("request_headers_timeout_s")
    max_request_bytes: int = _edge_default("max_audio_request_bytes")
    max_concurrent_requests: int = _edge_default("max_concurrent_requests")
    max_connections: int = _edge_default("max_connections")
    access_log: bool = True

    def __post_init__(self) -> None:
        regions: dict[str, tuple[Endpoint, ...]] = {}
        for name, edges in self.regions.items():
            _check_region(name)
            parsed = tuple(e if isinstance(e, Endpoint) else Endpoint.parse(e) for e in edges)
            if not parsed:
                raise EdgeConfigError(f"region {name!r} lists no edge")
            regions[name] = parsed
        if not regions:
            raise EdgeConfigError("regions is empty: the global tier needs at least one")
        object.__setattr__(self, "regions", MappingProxyType(regions))
        fallbacks: dict[str, tuple[str, ...]] = {}
        for name in regions:
            order = tuple(self.fallbacks.get(name, [r for r in regions if r != name]))
            for other in order:
                if other not in regions or other == name:
                    raise EdgeConfigError(
                        f"fallback {other!r} of region {name!r} is not another listed region"
                    )
            if len(set(order)) != len(order):
                raise EdgeConfigError(f"region {name!r} lists a fallback twice: {order}")
            fallbacks[name] = order
        unknown = set(self.fallbacks) - set(regions)
        if unknown:
            raise EdgeConfigError(f"fallbacks name unlisted regions {sorted(unknown)}")
        object.__setattr__(self, "fallbacks", MappingProxyType(fallbacks))
        if not self.default_region:
            object.__setattr__(self, "default_region", next(iter(regions)))
        elif self.default_region not in regions:
            raise EdgeConfigError(f"default_region {self.default_region!r} is not listed")
        if self.upstream_protocol not in UPSTREAM_PROTOCOLS:
            raise EdgeConfigError(
                f"upstream_protocol {self.upstream_protocol!r}: expected one of "
                f"{UPSTREAM_PROTOCOLS}"
            )
        for port_name in ("listen_port", "admin_port"):
            port = getattr(self, port_name)
            if not 0 < port < 65536:
                raise EdgeConfigError(f"{port_name}={port} is outside 1..65535")
        if bool(self.tls_cert_path) != bool(self.tls_key_path):
            raise EdgeConfigError("tls_cert_path and tls_key_path must be set together")
        if self.listen_port == self.admin_port and self.listen_host == self.admin_host:
            raise EdgeConfigError(f"listen_port and admin_port are both {self.listen_port}")
        for positive in (
            "health_check_interval_s",
            "health_check_timeout_s",
            "ejection_s",
            "connect_timeout_s",
            "stream_idle_timeout_s",
            "request_headers_timeout_s",
        ):
            if getattr(self, positive) <= 0:
                raise EdgeConfigError(f"{positive} must be positive")
        for count in (
            "unhealthy_threshold",
            "healthy_threshold",
            "consecutive_local_failures",
            "consecutive_5xx",
        ):
            if getattr(self, count) < 1:
                raise EdgeConfigError(f"{count} must be >= 1")

    def edges(self, region: str) -> tuple[Endpoint, ...]:
        """The edges of `region`. Raises KeyError for an unlisted region."""
        # `__post_init__` parsed every edge.
        return tuple(cast(Sequence[Endpoint], self.regions[region]))

    def priorities(self, region: str) -> tuple[str, ...]:
        """The regions a key homed in `region` is served by, priority 0 first."""
        return (region, *self.fallbacks[region])


# --- clusters ------------------------------------------------------------------------------------

_PREVIOUS_PRIORITIES = _T + (
    "envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig"
)
_PREVIOUS_HOSTS = _T + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
_ROUTER = _T + "envoy.extensions.filters.http.router.v3.Router"
_HCM = _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
#: TCP keepalive on the HTTP/1.1 connections to the edges: a silently cut region's streams end
#: after ~10 + 3 × 2 s without an answer (HTTP/2 uses its own pings, `REGION_KEEPALIVE`).
#: TCP keepalive never probes a connection with unacknowledged data, so an HTTP/1.1 request
#: written to a region just cut waits for its edge's health check to fail (the connections
#: close then, `close_connections_on_host_health_failure`) at best, or for TCP to give up.
_TCP_KEEPALIVE = {"keepalive_time": 10, "keepalive_interval": 2, "keepalive_probes": 3}
#: HTTP/2 pings on each h2c connection to an edge: a connection whose region went silent is
#: closed within interval + timeout (~6 s), its requests that had no response yet retried in
#: the next region (`reset`), its started streams ended with a transport error. Measured
#: with the regions test and bench (docs/regions.md); the recommended upstream protocol.
REGION_KEEPALIVE = {"interval": "4s", "timeout": "2s"}


def _protocol_options(config: GlobalTierConfig) -> Resource:
    http: Resource = (
        {"http2_protocol_options": {"connection_keepalive": REGION_KEEPALIVE}}
        if config.upstream_protocol == "h2c"
        else {"http_protocol_options": {}}
    )
    return {HTTP_OPTIONS_KEY: {"@type": HTTP_OPTIONS_TYPE, "explicit_http_config": http}}


def _health_check(config: GlobalTierConfig) -> Resource:
    """Each edge's `REGION_READY_PATH` (200: the region's picker is up), also without
    traffic at the same interval (Envoy's default there is 60 s)."""
    interval = duration(config.health_check_interval_s)
    check: Resource = {"path": REGION_READY_PATH}
    if config.upstream_protocol == "h2c":
        check["codec_client_type"] = "HTTP2"
    return {
        "timeout": duration(config.health_check_timeout_s),
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_threshold": config.unhealthy_threshold,
        "healthy_threshold": config.healthy_threshold,
        "http_health_check": check,
    }


def _outlier_detection(config: GlobalTierConfig) -> Resource:
    """Connect failures, resets and timeouts (local origin) counted apart from the region's
    answers: `consecutive_local_failures` of them eject an edge at once, as do
    `consecutive_5xx` 5xx answers in a row; every edge of a region may be ejected."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": config.consecutive_local_failures,
        "enforcing_consecutive_local_origin_failure": 100,
        "consecutive_5xx": config.consecutive_5xx,
        "enforcing_consecutive_5xx": 100,
        "consecutive_gateway_failure": config.consecutive_5xx,
        "enforcing_consecutive_gateway_failure": 0,
        "interval": duration(config.health_check_interval_s),
        "base_ejection_time": duration(config.ejection_s),
        "max_ejection_percent": 100,
    }


def _cluster(config: GlobalTierConfig, name: str, regions: Sequence[str]) -> Resource:
    """A cluster of `regions`' edges, the first region at priority 0, the next at 1, ..."""
    endpoints = [region_edges for region in regions for region_edges in config.edges(region)]
    static = all(e.is_ip for e in endpoints)
    cluster: Resource = {
        "name": name,
        "type": "STATIC" if static else "STRICT_DNS",
        "connect_timeout": duration(config.connect_timeout_s),
        "per_connection_buffer_limit_bytes": config.max_request_bytes,
        "lb_policy": "LEAST_REQUEST",
        # Never an unhealthy edge: a region without a healthy edge gives its share to the
        # next priority, and a pinned key's cluster answers 503 (`region_unavailable`).
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "typed_extension_protocol_options": _protocol_options(config),
        "upstream_connection_options": {"tcp_keepalive": _TCP_KEEPALIVE},
        "health_checks": [_health_check(config)],
        # A region cut off mid-request answers nothing on the connections already open to it
        # (TCP keepalive never probes a connection with a request outstanding): when its edge
        # fails its health check, those connections close, so a request still without a
        # response is retried in the next region (`reset`) and a stream already answering
        # ends with a transport error, both within the health check's detection time.
        "close_connections_on_host_health_failure": True,
        "outlier_detection": _outlier_detection(config),
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": config.max_concurrent_requests,
                    "max_pending_requests": config.max_concurrent_requests,
                    "max_requests": config.max_concurrent_requests,
                    "max_retries": config.max_concurrent_requests,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"priority": priority, "lb_endpoints": lb_endpoints(config.edges(region))}
                for priority, region in enumerate(regions)
            ],
        },
    }
    if not static:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    return cluster


def build_global_clusters(config: GlobalTierConfig) -> list[Resource]:
    """`home_cluster(r)` (r then its fallbacks by priority) and `pinned_cluster(r)` (r only)
    for every region r."""
    clusters = []
    for region in config.regions:
        clusters.append(_cluster(config, home_cluster(region), config.priorities(region)))
        clusters.append(_cluster(config, pinned_cluster(region), (region,)))
    return clusters


# --- routes --------------------------------------------------------------------------------------

#: Retried before the response starts: no connection, HTTP/2 REFUSED_STREAM, a reset or
#: disconnect before the response headers, or the region's own "unavailable" answer (503;
#: 529 is its Anthropic spelling on `/v1/messages*`).
RETRY_ON = "connect-failure,refused-stream,reset,retriable-status-codes"
RETRIABLE_STATUS_CODES: tuple[int, ...] = (503, anthropic.OVERLOADED_STATUS)


def _key_matchers(region: str, *, pinned: bool) -> list[tuple[str, Resource]]:
    """(header name, matcher) for a secret with `region`'s prefix in either key header."""
    prefix = secret_prefix(region, pinned=pinned)
    bearer = {"safe_regex": {"regex": f"^(?i:bearer) +{re.escape(prefix)}.*"}}
    return [
        (AUTHORIZATION, {"name": AUTHORIZATION, "string_match": bearer}),
        (API_KEY, {"name": API_KEY, "string_match": {"prefix": prefix}}),
    ]


def _retry_policy(retries: int, *, across_priorities: bool) -> Resource:
    policy: Resource = {
        "retry_on": RETRY_ON,
        "retriable_status_codes": list(RETRIABLE_STATUS_CODES),
        "num_retries": retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS},
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }
    if across_priorities:
        policy["retry_priority"] = {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {"@type": _PREVIOUS_PRIORITIES, "update_frequency": 1},
        }
    return policy


def _route(name: str, header: Resource | None, cluster: str, retry: Resource) -> Resource:
    match: Resource = {"prefix": "/"}
    if header is not None:
        match["headers"] = [header]
    return {
        "name": name,
        "match": match,
        # No route timeout: a stream lasts as long as it sends (stream_idle_timeout).
        "route": {"cluster": cluster, "timeout": "0s", "retry_policy": retry},
    }


def build_global_routes(config: GlobalTierConfig) -> Resource:
    """The RouteConfiguration: methods no region serves → 405 (as the edge answers them),
    then per region its pinned keys' routes, its homed keys' routes, and last every other
    request → the default region's home cluster."""
    routes: list[Resource] = [*method_not_allowed_routes(())]
    for region in config.regions:
        pinned_retry = _retry_policy(len(config.edges(region)) - 1, across_priorities=False)
        for header, matcher in _key_matchers(region, pinned=True):
            routes.append(
                _route(
                    pinned_route_prefix(region) + header,
                    matcher,
                    pinned_cluster(region),
                    pinned_retry,
                )
            )
        home_retry = _retry_policy(len(config.fallbacks[region]), across_priorities=True)
        for header, matcher in _key_matchers(region, pinned=False):
            routes.append(
                _route(f"home-{region}-{header}", matcher, home_cluster(region), home_retry)
            )
    default = config.default_region
    routes.append(
        _route(
            "default",
            None,
            home_cluster(default),
            _retry_policy(len(config.fallbacks[default]), across_priorities=True),
        )
    )
    return {
        "name": GLOBAL_ROUTES,
        # Added by `use_remote_address`; the region's edge is the one that judges the client.
        "request_headers_to_remove": ["x-envoy-external-address"],
        "virtual_hosts": [{"name": "regions", "domains": ["*"], "routes": routes}],
    }


# --- listener and bootstrap ----------------------------------------------------------------------


def _global_access_log() -> list[Resource]:
    """The edge's JSON line, plus the route and the region's own request id (the tier has
    none of its own)."""
    logs = access_log()
    fields = logs[0]["typed_config"]["log_format"]["json_format"]
    fields["route"] = "%ROUTE_NAME%"
    fields["cluster"] = "%UPSTREAM_CLUSTER%"
    fields["attempts"] = "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"
    fields["request_id"] = f"%RESP({REQUEST_ID.upper()})%"
    return logs


def build_global_listener(config: GlobalTierConfig) -> Resource:
    """The client-facing Listener: an HCM (HTTP/1.1 or h2, over TLS with `tls_cert_path`)
    with the router only."""
    hcm: Resource = {
        "@type": _HCM,
        "stat_prefix": "global",
        "codec_type": "AUTO",
        "use_remote_address": True,
        # Pass the client's request id through untouched and make none (see the module doc).
        "generate_request_id": False,
        "preserve_external_request_id": True,
        "server_header_transformation": "PASS_THROUGH",
        "stream_idle_timeout": duration(config.stream_idle_timeout_s),
        "request_headers_timeout": duration(config.request_headers_timeout_s),
        "local_reply_config": build_global_local_replies(config.regions),
        "route_config": build_global_routes(config),
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                # No x-envoy-* headers of its own on the request or the response.
                "typed_config": {"@type": _ROUTER, "suppress_envoy_headers": True},
            }
        ],
    }
    if config.access_log:
        hcm["access_log"] = _global_access_log()
    chain: Resource = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]
    }
    if config.tls_cert_path:
        chain["transport_socket"] = downstream_tls(config.tls_cert_path, config.tls_key_path)
    return {
        "name": GLOBAL_LISTENER,
        "address": {
            "socket_address": {"address": config.listen_host, "port_value": config.listen_port}
        },
        "per_connection_buffer_limit_bytes": config.max_request_bytes,
        "enable_reuse_port": False,
        "filter_chains": [chain],
    }


def build_global_bootstrap(config: GlobalTierConfig) -> Resource:
    """The static Bootstrap: node identity, admin API, the listener, the clusters and the
    downstream connection cap."""
    return {
        **node_and_admin(config.node_id, config.node_cluster, config.admin_host, config.admin_port),
        "static_resources": {
            "listeners": [build_global_listener(config)],
            "clusters": build_global_clusters(config),
        },
        "overload_manager": connection_cap(config.max_connections),
    }


def render_global_bootstrap(config: GlobalTierConfig, *, fmt: str = "yaml") -> str:
    """The global tier's bootstrap as text for `envoy -c` (`fmt` "yaml" or "json").

    Raises: ValueError for another `fmt`.
    """
    return render_bootstrap(
        build_global_bootstrap(config), fmt, generated_by="inferplane.edge.render_global_bootstrap"
    )

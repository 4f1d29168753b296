"""The edge's RouteConfiguration: `GET /health`, the console, the admin API and models list,
the generation routes to the picked replica (with their retry policy), and the 404 for
everything else; plus the per-route filter switches (`without_picker`) and the route pieces
the node-local Envoy reuses (`health_route`, `route_to`, `method_is`).
"""

from __future__ import annotations

from inferplane.edge._base import (
    AUDIO_PREFIX,
    FILTER_CONFIG_TYPE,
    HEALTH_BODY,
    HEALTH_PATH,
    LUA_PER_ROUTE_TYPE,
    TYPE_URL_PREFIX,
    Resource,
    duration,
)
from inferplane.edge._clusters import (
    AUTH_CLUSTER,
    CONSOLE_CLUSTER,
    REPLICAS_CLUSTER,
    ROUTER_CLUSTER,
)
from inferplane.edge._config import EdgeConfig
from inferplane.edge._filters import AUTHZ_FILTER, BODY_LIMIT_FILTER
from inferplane.wire.headers import CLIENT_REQUEST_ID

ROUTE_CONFIG_NAME = "inferplane_edge_routes"
#: The web console's path prefix (`EdgeConfig.console_endpoint`); `/console` redirects here.
CONSOLE_PREFIX = "/console/"

_EXT_PROC_PER_ROUTE = TYPE_URL_PREFIX + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_EXT_AUTHZ_PER_ROUTE = (
    TYPE_URL_PREFIX + "envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
)


def route_to(prefix: str, cluster: str, timeout_s: float | None = None) -> Resource:
    """A route sending paths under `prefix` to `cluster` with a `timeout_s` route timeout;
    None: no route timeout (`0s`), for generations, which the stream idle timeout and the
    services' own deadlines bound instead."""
    timeout = "0s" if timeout_s is None else duration(timeout_s)
    return {"match": {"prefix": prefix}, "route": {"cluster": cluster, "timeout": timeout}}


def disabled(filter_name: str) -> Resource:
    """The `typed_per_filter_config` value that turns `filter_name` off on one route: the
    filter's own per-route type where it has one (ext_proc, ext_authz, Lua), else the generic
    `FilterConfig` (the transcoder has no per-route `disabled`)."""
    if filter_name == "envoy.filters.http.ext_proc":
        return {"@type": _EXT_PROC_PER_ROUTE, "disabled": True}
    if filter_name == "envoy.filters.http.ext_authz":
        return {"@type": _EXT_AUTHZ_PER_ROUTE, "disabled": True}
    if filter_name.startswith("inferplane."):
        return {"@type": LUA_PER_ROUTE_TYPE, "disabled": True}
    return {"@type": FILTER_CONFIG_TYPE, "disabled": True}


def without_picker(route: Resource) -> Resource:
    """`route` with ext_proc and the picker guard off (routes the picker does not decide)."""
    route["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": disabled("envoy.filters.http.ext_proc"),
        "inferplane.picker_guard": disabled("inferplane.picker_guard"),
    }
    return route


def with_picker(route: Resource) -> Resource:
    """`route` with ext_proc (disabled in the chain, `_filters._off_by_default`) turned on: a
    per-route config of its own type enables a filter the HCM lists disabled (an empty generic
    `FilterConfig` is refused by Envoy)."""
    per_filter = route.setdefault("typed_per_filter_config", {})
    per_filter["envoy.filters.http.ext_proc"] = {"@type": _EXT_PROC_PER_ROUTE, "overrides": {}}
    return route


#: The methods a route may answer; `CONNECT` and any other known one (`TRACE`) get 405
#: (`method_not_allowed_routes`); unknown tokens (`FOO`, `PRI` over HTTP/1.1) are refused by
#: the HTTP/1 codec (400 `invalid_http_request`, `_replies.py`).
ALLOWED_METHODS: tuple[str, ...] = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def method_not_allowed_routes(off: tuple[str, ...]) -> list[Resource]:
    """Two routes answering 405 (with `Allow`), first in the table; `off`: the filters turned
    off on them (nothing is authenticated or transcoded).

    - `CONNECT` (`connect_matcher`: an HTTP/1.1 `CONNECT host:port` has no path, so no path
      route matches it). Matching a route is what makes Envoy refuse it at once (no upgrade
      config allows CONNECT: 403 `upgrade_failed`, which `_replies.py` turns into this 405);
      matching none, it ran the chain's default filters instead (the picker guard's 503, or
      a wait for a body a tunnel never ends). Nothing is tunnelled: the route only answers.
    - any other method outside `ALLOWED_METHODS` (`TRACE`).
    """
    allowed = "|".join(ALLOWED_METHODS)
    other = {
        "name": ":method",
        "string_match": {"safe_regex": {"regex": f"^({allowed})$"}},
        "invert_match": True,
    }
    answer: Resource = {
        "direct_response": {"status": 405},
        "response_headers_to_add": [allow_header()],
        "typed_per_filter_config": {name: disabled(name) for name in off},
    }
    return [
        {"match": {"connect_matcher": {}}, **answer},
        {"match": {"prefix": "/", "headers": [other]}, **answer},
    ]


def allow_header() -> Resource:
    """The `Allow` response header a 405 must carry (RFC 9110 §15.5.6): `ALLOWED_METHODS`."""
    return {
        "header": {"key": "allow", "value": ", ".join(ALLOWED_METHODS)},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }


def method_is(method: str) -> Resource:
    """A route header matcher: the request's `:method` is `method`."""
    return {"name": ":method", "string_match": {"exact": method}}


def health_route(off: tuple[str, ...]) -> Resource:
    """`GET /health`: 200 `{"status":"ok"}` from Envoy itself with the filters `off` turned
    off on it (the edge: the picker, ext_authz and the transcoder; the node Envoy: its node
    guard and the transcoder). The transcoder must be off: it answers 404 to any path no gRPC
    method maps (`reject_unknown_method`)."""
    return {
        "match": {"path": HEALTH_PATH, "headers": [method_is("GET")]},
        "direct_response": {"status": 200, "body": {"inline_string": HEALTH_BODY}},
        "response_headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
        "typed_per_filter_config": {name: disabled(name) for name in off},
    }


#: The filters off on the edge's own answers (`/health`, the 405): no key is asked for and
#: nothing is transcoded (the transcoder answers 404 to a path no gRPC method maps).
_OWN_ANSWER_OFF: tuple[str, ...] = (
    "envoy.filters.http.ext_proc",
    "inferplane.picker_guard",
    "envoy.filters.http.ext_authz",
    "envoy.filters.http.grpc_json_transcoder",
)


def _health_route() -> Resource:
    """The edge's `GET /health`, with no key (ext_authz off) and nothing about the fleet
    behind it (load balancers' and clients' liveness checks, e.g. GuideLLM's backend check)."""
    return health_route(_OWN_ANSWER_OFF)


def _console_routes() -> list[Resource]:
    """`/console` → `/console/`, and `/console/...` → the console cluster with every filter
    of the OpenAI path off: no ext_authz (the console signs its users in and asks auth with
    their key), no transcoder, no stream router (a playground body's `"stream": true` must not
    move the path), no error shaper (its pages are HTML), no picker. Route timeout off: the
    playground streams (the stream idle timeout still bounds it)."""
    route = without_picker(route_to(CONSOLE_PREFIX, CONSOLE_CLUSTER))
    per_filter = route["typed_per_filter_config"]
    for name in (
        "envoy.filters.http.ext_authz",
        "envoy.filters.http.grpc_json_transcoder",
        "inferplane.error_shaper",
        "inferplane.auth_failure_guard",
        "inferplane.stream_router",
        "inferplane.field_guard",
    ):
        per_filter[name] = disabled(name)
    redirect = {
        "match": {"path": CONSOLE_PREFIX.rstrip("/")},
        "redirect": {"path_redirect": CONSOLE_PREFIX},
        "typed_per_filter_config": dict(per_filter),
    }
    return [redirect, route]


def _generation_route(prefix: str, config: EdgeConfig) -> Resource:
    """A route to the replica the picker chose, retried down its list before the first
    response byte only (Envoy never retries once it forwarded response headers): a refused
    or reset connection, or an UNAVAILABLE answer (a draining replica, an engine that failed
    before its first token). ext_authz is off: the picker authenticates these requests in its
    first exchange (and the picker guard refuses one it did not), so each keeps exactly one
    authenticator."""
    route = with_picker(route_to(prefix, REPLICAS_CLUSTER))
    route["typed_per_filter_config"][AUTHZ_FILTER] = disabled(AUTHZ_FILTER)
    route["route"]["retry_policy"] = {
        "retry_on": "connect-failure,refused-stream,reset,unavailable",
        "num_retries": config.max_retries,
    }
    return route


def _audio_route(config: EdgeConfig) -> Resource:
    """`AUDIO_PREFIX`: a generation route without the body size limit filter (whose limit is
    the chat body's, `max_request_bytes`): an upload's declared length is checked against
    `max_audio_request_bytes` by error_shaper.lua, and one without a length is bounded by
    Envoy's buffer limit (`EdgeConfig.buffer_limit_bytes`, at least the audio limit), since
    the picker and the transcoder buffer it whole."""
    route = _generation_route(AUDIO_PREFIX, config)
    route["typed_per_filter_config"][BODY_LIMIT_FILTER] = disabled(BODY_LIMIT_FILTER)
    return route


def build_route_config(config: EdgeConfig) -> Resource:
    """The RouteConfiguration: methods outside `ALLOWED_METHODS` → 405,
    `GET /health` → Envoy's own 200 (no key), admin API → auth,
    `/v1/models` → the router, stored responses (`/v1/responses/…`) → auth (these three, and
    the 404, with ext_authz and without the picker), audio uploads (`_audio_route`) and every
    other OpenAI path → the replica the endpoint picker chose (the picker authenticates;
    ext_authz off), anything else → 404.

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
                            "key": CLIENT_REQUEST_ID,
                            "value": f"%REQ({CLIENT_REQUEST_ID})%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
                "routes": [
                    *method_not_allowed_routes(_OWN_ANSWER_OFF),
                    _health_route(),
                    *(_console_routes() if config.console_endpoint is not None else []),
                    without_picker(
                        route_to("/v1/admin/", AUTH_CLUSTER, config.admin_api_timeout_s)
                    ),
                    without_picker(
                        route_to("/v1/models", ROUTER_CLUSTER, config.admin_api_timeout_s)
                    ),
                    # Stored responses (`GET`/`DELETE /v1/responses/{id}`, `.../input_items`):
                    # auth owns the store. `POST /v1/responses` (no trailing slash) generates.
                    without_picker(
                        route_to("/v1/responses/", AUTH_CLUSTER, config.admin_api_timeout_s)
                    ),
                    _audio_route(config),
                    _generation_route("/v1/", config),
                    _generation_route("/internal/events/", config),
                    without_picker({"match": {"prefix": "/"}, "direct_response": {"status": 404}}),
                ],
            }
        ],
    }

"""Envoy's own replies in OpenAI's error shape (Anthropic's on `/v1/messages*`): the HCM's
`local_reply_config`.

Envoy's local replies (the transcoder's 400/404, 413 body too large, 503 no upstream or auth
down, 504, the stream router's 404 for `/internal/...`) are plain text by default; OpenAI's
clients expect `{"error": {"message", "type", "param", "code"}}`
(https://platform.openai.com/docs/guides/error-codes). Transcoded upstream errors are not
local replies: `lua/error_shaper.lua` shapes those. Local-reply mappers are tried in order and
the first match wins; a mapper without a body override passes the reply through unchanged
(https://www.envoyproxy.io/docs/envoy/latest/configuration/http/http_conn_man/local_reply).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from inferplane.apis import anthropic
from inferplane.edge._base import AUDIO_PREFIX, CEL_FILTER_TYPE, Resource
from inferplane.edge._config import EdgeConfig
from inferplane.edge._routes import ALLOWED_METHODS, allow_header
from inferplane.wire import apis


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


#: Response flag UAEX: ext_authz denied the request (or failed, with a status >= 500).
_UAEX = {"response_flag_filter": {"flags": ["UAEX"]}}


def cel(expression: str) -> dict[str, Any]:
    """An access-log filter (what a mapper matches on) true when CEL `expression` is."""
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": CEL_FILTER_TYPE, "expression": expression},
        }
    }


def mapper(filter_: dict[str, Any], body: dict[str, Any] | None) -> dict[str, Any]:
    """A local-reply mapper: replies matching `filter_` get `body` as JSON (None: unchanged)."""
    result: dict[str, Any] = {"filter": filter_}
    if body is not None:
        result["body_format_override"] = {"json_format": body}
    return result


def _audio_path() -> dict[str, Any]:
    """Access-log filter: the request's path is an audio route (`AUDIO_PREFIX`)."""
    return {
        "header_filter": {"header": {"name": ":path", "string_match": {"prefix": AUDIO_PREFIX}}}
    }


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """One of Envoy's own replies: which replies (`filter_`), and the error they become:
    `message` (Envoy formatters allowed), OpenAI's `type` and `code`, and `status`, the HTTP
    status they have (None: several; Anthropic's type then follows `anthropic_status`)."""

    filter_: dict[str, Any]
    message: str
    openai_type: str
    code: str
    status: int
    #: Set `status` on the reply (Envoy's own status differs: CONNECT's 403) and add these
    #: response headers.
    rewrite: bool = False
    headers: tuple[dict[str, Any], ...] = ()


def _shaped(reply: _Reply, filter_: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The mapper giving replies matching `filter_` `body`, and `reply`'s status and headers
    when it rewrites them."""
    result = mapper(filter_, body)
    if reply.rewrite:
        result["status_code"] = reply.status
    if reply.headers:
        result["headers_to_add"] = list(reply.headers)
    return result


def _anthropic_path() -> dict[str, Any]:
    """Access-log filter: the request's path is Anthropic's (`/v1/messages` or below), as the
    client sent it: `:path`, or `x-envoy-original-path` once the transcoder has rewritten
    `:path` to the gRPC method (its body parse errors come after that)."""
    prefix = re.escape(apis.ANTHROPIC_PATH_PREFIX)
    match = {"safe_regex": {"regex": f"^{prefix}(/[^?#]*)?([?#].*)?$"}}
    return {
        "or_filter": {
            "filters": [
                {"header_filter": {"header": {"name": name, "string_match": match}}}
                for name in (":path", "x-envoy-original-path")
            ]
        }
    }


def _and(*filters: dict[str, Any]) -> dict[str, Any]:
    return {"and_filter": {"filters": list(filters)}}


def _anthropic_mapper(reply: _Reply) -> dict[str, Any]:
    """`reply` on an Anthropic path: Anthropic's body, and 529 where OpenAI's status is 503."""
    result = _shaped(
        reply,
        _and(_anthropic_path(), reply.filter_),
        anthropic.error_body(reply.status, reply.message),
    )
    status = anthropic.error_status(reply.status)
    if status != reply.status:
        result["status_code"] = status
    return result


def build_local_reply_config(config: EdgeConfig) -> Resource:
    """OpenAI-shaped bodies for Envoy's own replies (first matching mapper wins), Anthropic's
    on Anthropic's paths (`/v1/messages*`).

    The ext_authz denial (flag UAEX, status < 500) already carries the auth service's body
    (OpenAI's, or Anthropic's on its paths) and passes untouched; without that first mapper
    it would be wrapped twice, its JSON escaped into the new body's message (measured on
    Envoy 1.40). The picker's refusals and the Lua filters' replies carry their body in the
    path's shape too and pass. Envoy's access-log filters have no `not_filter` (a config
    using one is rejected: `no such field`), hence ordered mappers rather than one negated
    filter.
    """
    invalid = "invalid_request_error"
    not_allowed = (
        "Method %REQ(:METHOD)% is not allowed; the API's methods are "
        + ", ".join(ALLOWED_METHODS)
        + "."
    )
    passed = [
        _and(_UAEX, _status_filter("LE", 499)),
        # The endpoint picker's refusals (ext_proc immediate responses, details `picker_…`),
        # the picker guard's 503, the field guard's 400 and the auth failure guard's 429
        # already carry their body.
        cel(
            "response.code_details.startsWith('picker_') || "
            "(response.code_details == 'lua_response' && "
            "(response.code == 503 || response.code == 400 || response.code == 429))"
        ),
    ]
    replies = [
        # The picker failed on a request (ext_proc error, e.g. its message timeout: details
        # `ext_proc_error_per-message_timeout_exceeded`; picker unreachable:
        # `ext_proc_error_gRPC_error_14{…}`): fail closed with a shaped 503.
        _Reply(
            cel("response.code_details.startsWith('ext_proc_error')"),
            "The endpoint picker is unavailable; please retry.",
            "server_error",
            "picker_unavailable",
            503,
        ),
        _Reply(
            _and(_UAEX, _status_filter("GE", 500)),
            "The authentication service is unavailable; please retry.",
            "server_error",
            "service_unavailable",
            503,
        ),
        # The HTTP codec refused the request (details `http1.…` / `http2.…`: an unknown
        # method, a NUL or a malformed line in a header, a bad chunk): before the generic 400.
        _Reply(
            cel(
                "response.code_details.startsWith('http1.') || "
                "response.code_details.startsWith('http2.')"
            ),
            "The request is not valid HTTP (%RESPONSE_CODE_DETAILS%).",
            invalid,
            "invalid_http_request",
            400,
        ),
        # The transcoder's parse errors, e.g. "Unexpected end of string. Expected an object
        # key or }." or "messages: invalid value "oops" for type ...".
        _Reply(
            _status_is(400),
            "Could not parse the request body: %LOCAL_REPLY_BODY%",
            invalid,
            "invalid_request_body",
            400,
        ),
        _Reply(
            _status_is(404),
            "Invalid URL (%REQ(:METHOD)% %REQ(:PATH)%)",
            invalid,
            "unknown_url",
            404,
        ),
        # `CONNECT`: no upgrade config allows it, so Envoy refuses it at once with 403
        # `upgrade_failed` and an empty body (the route table never sees it); it is a method
        # no route serves, like the route table's own 405 below.
        _Reply(
            cel("response.code_details == 'upgrade_failed'"),
            not_allowed,
            invalid,
            "method_not_allowed",
            405,
            rewrite=True,
            headers=(allow_header(),),
        ),
        # Methods outside `ALLOWED_METHODS` (`_routes.method_not_allowed_routes`).
        _Reply(_status_is(405), not_allowed, invalid, "method_not_allowed", 405),
        # Audio uploads have their own limit (error_shaper.lua's request guard, by path).
        _Reply(
            _and(_status_is(413), _audio_path()),
            "The request body is too large; audio requests are limited to "
            f"{config.max_audio_request_bytes} bytes (files up to 25 MB).",
            invalid,
            "request_too_large",
            413,
        ),
        _Reply(
            _status_is(413),
            f"The request body is too large; the limit is {config.max_request_bytes} bytes.",
            invalid,
            "request_too_large",
            413,
        ),
        _Reply(
            _status_is(503),
            "The service is temporarily unavailable; please retry.",
            "server_error",
            "service_unavailable",
            503,
        ),
        _Reply(
            _status_is(504), "The request timed out; please retry.", "server_error", "timeout", 504
        ),
        _Reply(
            _status_filter("GE", 500),
            "The server had an error while processing your request.",
            "server_error",
            "internal_error",
            500,
        ),
        _Reply(_status_filter("GE", 400), "%LOCAL_REPLY_BODY%", invalid, "invalid_request", 400),
    ]
    # Anthropic's paths first: their Lua replies (the field guard's 400, the picker guard's
    # 529, the 413 of error_shaper.lua) carry Anthropic's body already and pass.
    anthropic_passed = [
        mapper(_and(_anthropic_path(), f), None)
        for f in (*passed, cel("response.code_details == 'lua_response'"))
    ]
    mappers = [
        *anthropic_passed,
        *(_anthropic_mapper(r) for r in replies),
        *(mapper(f, None) for f in passed),
        *(_shaped(r, r.filter_, _error_json(r.message, r.openai_type, r.code)) for r in replies),
    ]
    return {"mappers": mappers}

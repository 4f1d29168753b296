"""Envoy's own replies in OpenAI's error shape: the HCM's `local_reply_config`.

Envoy's local replies (the transcoder's 400/404, 413 body too large, 503 no upstream or auth
down, 504, the stream router's 404 for `/internal/...`) are plain text by default; OpenAI's
clients expect `{"error": {"message", "type", "param", "code"}}`
(https://platform.openai.com/docs/guides/error-codes). Transcoded upstream errors are not
local replies: `lua/error_shaper.lua` shapes those. Local-reply mappers are tried in order and
the first match wins; a mapper without a body override passes the reply through unchanged
(https://www.envoyproxy.io/docs/envoy/latest/configuration/http/http_conn_man/local_reply).
"""

from __future__ import annotations

from typing import Any

from inferplane.edge._base import AUDIO_PREFIX, CEL_FILTER_TYPE, Resource
from inferplane.edge._config import EdgeConfig


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


def build_local_reply_config(config: EdgeConfig) -> Resource:
    """OpenAI-shaped bodies for Envoy's own replies (first matching mapper wins).

    The ext_authz denial (flag UAEX, status < 500) already carries the auth service's OpenAI
    body and passes untouched; without that first mapper it would be wrapped twice, its JSON
    escaped into the new body's message (measured on Envoy 1.40). Envoy's access-log filters
    have no `not_filter` (a config using one is rejected: `no such field`), hence ordered
    mappers rather than one negated filter.
    """
    invalid = "invalid_request_error"
    mappers = [
        mapper({"and_filter": {"filters": [_UAEX, _status_filter("LE", 499)]}}, None),
        # The endpoint picker's refusals (ext_proc immediate responses, details `picker_…`),
        # the picker guard's 503 and the field guard's 400 already carry OpenAI's body: pass
        # them through.
        mapper(
            cel(
                "response.code_details.startsWith('picker_') || "
                "(response.code_details == 'lua_response' && "
                "(response.code == 503 || response.code == 400))"
            ),
            None,
        ),
        # The picker failed on a request (ext_proc error, e.g. its message timeout: details
        # `ext_proc_error_per-message_timeout_exceeded`; picker unreachable:
        # `ext_proc_error_gRPC_error_14{…}`): fail closed with a shaped 503.
        mapper(
            cel("response.code_details.startsWith('ext_proc_error')"),
            _error_json(
                "The endpoint picker is unavailable; please retry.",
                "server_error",
                "picker_unavailable",
            ),
        ),
        mapper(
            {"and_filter": {"filters": [_UAEX, _status_filter("GE", 500)]}},
            _error_json(
                "The authentication service is unavailable; please retry.",
                "server_error",
                "service_unavailable",
            ),
        ),
        # The transcoder's parse errors, e.g. "Unexpected end of string. Expected an object
        # key or }." or "messages: invalid value "oops" for type ...".
        mapper(
            _status_is(400),
            _error_json(
                "Could not parse the request body: %LOCAL_REPLY_BODY%",
                invalid,
                "invalid_request_body",
            ),
        ),
        mapper(
            _status_is(404),
            _error_json("Invalid URL (%REQ(:METHOD)% %REQ(:PATH)%)", invalid, "unknown_url"),
        ),
        # Audio uploads have their own limit (error_shaper.lua's request guard, by path).
        mapper(
            {"and_filter": {"filters": [_status_is(413), _audio_path()]}},
            _error_json(
                "The request body is too large; audio requests are limited to "
                f"{config.max_audio_request_bytes} bytes (files up to 25 MB).",
                invalid,
                "request_too_large",
            ),
        ),
        mapper(
            _status_is(413),
            _error_json(
                f"The request body is too large; the limit is {config.max_request_bytes} bytes.",
                invalid,
                "request_too_large",
            ),
        ),
        mapper(
            _status_is(503),
            _error_json(
                "The service is temporarily unavailable; please retry.",
                "server_error",
                "service_unavailable",
            ),
        ),
        mapper(
            _status_is(504),
            _error_json("The request timed out; please retry.", "server_error", "timeout"),
        ),
        mapper(
            _status_filter("GE", 500),
            _error_json(
                "The server had an error while processing your request.",
                "server_error",
                "internal_error",
            ),
        ),
        mapper(
            _status_filter("GE", 400),
            _error_json("%LOCAL_REPLY_BODY%", invalid, "invalid_request"),
        ),
    ]
    return {"mappers": mappers}

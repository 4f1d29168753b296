"""The global tier's own replies (`_global.py`) in the API's error shape: OpenAI's, and
Anthropic's on `/v1/messages*` (503 → 529), built from the regional edge's reply pieces
(`_replies.py`). Only Envoy's own replies are rewritten; a region's answers pass unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from inferplane.edge._base import Resource
from inferplane.edge._replies import (
    _anthropic_mapper,
    _error_json,
    _Reply,
    _shaped,
    _status_filter,
    _status_is,
    cel,
)
from inferplane.edge._routes import allow_header
from inferplane.regions import REGION_UNAVAILABLE


def pinned_route_prefix(region: str) -> str:
    """The name prefix of the routes of keys pinned to `region` (the 503 mappers match it)."""
    return f"pinned-{region}-"


def build_global_local_replies(regions: Iterable[str]) -> Resource:
    """The tier's own replies in the API's error shape (OpenAI's; Anthropic's on
    `/v1/messages*`, 503 → 529): a 503 on a route of a key pinned to one of `regions` →
    `region_unavailable` naming the region; any other 503 (no region has a healthy edge) →
    `service_unavailable`; codec refusals → 400 `invalid_http_request`; CONNECT → 405. The
    regions' own answers are not local replies and pass unchanged."""
    invalid = "invalid_request_error"
    replies = [
        *(
            _Reply(
                _and_filter(
                    cel(f"xds.route_name.startsWith('{pinned_route_prefix(region)}')"),
                    _status_is(503),
                ),
                f"Region {region} is unavailable and this key is pinned to it (data "
                f"residency), so no other region serves it ({REGION_UNAVAILABLE}); please "
                "retry later.",
                "server_error",
                REGION_UNAVAILABLE,
                503,
            )
            for region in regions
        ),
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
        _Reply(
            cel("response.code_details == 'upgrade_failed'"),
            "Method %REQ(:METHOD)% is not allowed.",
            invalid,
            "method_not_allowed",
            405,
            rewrite=True,
            headers=(allow_header(),),
        ),
        _Reply(
            _status_is(405),
            "Method %REQ(:METHOD)% is not allowed.",
            invalid,
            "method_not_allowed",
            405,
        ),
        _Reply(
            _status_is(503),
            "No region can serve the request now; please retry.",
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
    return {
        "mappers": [
            *(_anthropic_mapper(r) for r in replies),
            *(
                _shaped(r, r.filter_, _error_json(r.message, r.openai_type, r.code))
                for r in replies
            ),
        ]
    }


def _and_filter(*filters: dict[str, Any]) -> dict[str, Any]:
    return {"and_filter": {"filters": list(filters)}}

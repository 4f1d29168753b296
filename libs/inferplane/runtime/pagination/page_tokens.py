"""Opaque page tokens (AIP-158) for the list APIs: where the next page starts, and the filters
the first page was asked with.

A token is URL-safe base64 (no padding) of JSON `{"c": cursor, "f": filters}`. It is not a
secret nor signed: a client that forges one only pages its own query differently. What it
guarantees is that a token is used with the filters it was issued for, as AIP-158 asks: a
token from another query is refused instead of silently paging the wrong result set.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from inferplane.runtime.service._errors import InvalidArgumentError


def encode_page_token(cursor: Mapping[str, Any], filters: Mapping[str, Any] | None = None) -> str:
    """The token of `cursor` (JSON values) for a query with `filters` (JSON values)."""
    payload = {"c": dict(cursor), "f": dict(filters or {})}
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str, filters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The cursor of `token`, checked against the query's `filters`.

    Raises:
        InvalidArgumentError (param `page_token`): not a token of `encode_page_token`, or one
            issued for other filters (the message names them).
    """
    try:
        payload = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        cursor, issued = payload["c"], payload["f"]
        if not isinstance(cursor, dict) or not isinstance(issued, dict):
            raise TypeError("not objects")
    except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgumentError("page_token is not valid", param="page_token") from exc
    expected = json.loads(json.dumps(dict(filters or {})))
    if issued != expected:
        names = ", ".join(sorted(expected)) or "none"
        raise InvalidArgumentError(
            f"page_token was issued for other filters ({names}); repeat the request with the "
            "same filters",
            param="page_token",
        )
    return cursor

"""Envoy's ext_authz `Check` (`envoy.service.auth.v3.Authorization`), on every request at the edge.

A request with a valid key holding the scope its path needs is allowed: auth's verdict
(`inferplane.wire.headers.AUTH_VERDICT`: tenant, key id, scopes, allowed models, tier) is set on
the upstream request, overwriting any client copy, and the key's headers (`authorization`,
`x-api-key`: `inferplane.wire.headers.CLIENT_KEY_HEADERS`) and every other client header under
`TRUSTED_PREFIX` are removed. The key comes as `Authorization: Bearer KEY` (OpenAI's
convention) or `x-api-key: KEY` (Anthropic's, `client_key`). Otherwise Envoy sends the client
the denial as is: 401 `invalid_api_key`, 403 `insufficient_scope`, 429 with OpenAI's body and
`x-ratelimit-*`.

Envoy's side, as measured against Envoy (and re-checked by `tests/test_envoy.py`): Check reads
`attributes.request.http.headers` (lower-case names; `header_map` instead when Envoy's
`encode_raw_headers` is on); an `OkHttpResponse` header with `OVERWRITE_IF_EXISTS_OR_ADD` replaces a
client's copy and `headers_to_remove` drops a header before the upstream sees it; a
`DeniedHttpResponse` (status, `content-type: application/json`, OpenAI's error JSON) reaches
the client verbatim, so OpenAI's SDK raises e.g. `AuthenticationError` with
`code='invalid_api_key'`. A failed or timed-out Check is, by Envoy's default, a 403 with an
empty body; the edge sets `status_on_error: 503` (retryable) and `failure_mode_allow: false`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from inferplane.apis import anthropic
from inferplane.auth.domain import SCOPE_ADMIN, SCOPE_INFERENCE, Principal
from inferplane.auth.limits import ALLOWED_UNLIMITED, RateLimitDecision, RateLimiter
from inferplane.auth.verifier import KeyVerifier
from inferplane.runtime import UnauthenticatedError
from inferplane.runtime.security.api_keys import (
    client_key,
    required_scope,
)
from inferplane.wire.headers import (
    ALLOWED_MODELS,
    AUTH_VERDICT,
    CLIENT_KEY_HEADERS,
    KEY_ID,
    REQUEST_ID,
    SCOPES,
    TENANT,
    TIER,
    TRUSTED_PREFIX,
)

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        # An empty allow-list means "all models": the header must still replace a forged one.
        keep_empty_value=True,
    )


_SET_HEADERS = frozenset(AUTH_VERDICT)
_JSON_HEADER = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", value="application/json"),
    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
)


def openai_error_body(message: str, code: str) -> str:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    )


def denied(http_status: int, message: str, code: str) -> external_auth_pb2.CheckResponse:
    """A denial Envoy sends to the client as is (status, JSON content type, OpenAI body)."""
    rpc_code = code_pb2.UNAUTHENTICATED if http_status == 401 else code_pb2.PERMISSION_DENIED
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=rpc_code, message=message),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=http_status),  # type: ignore[arg-type]
            headers=[_JSON_HEADER],
            body=openai_error_body(message, code),
        ),
    )


def in_anthropic_shape(response: external_auth_pb2.CheckResponse) -> None:
    """Rewrites a denial's body into Anthropic's error shape (a request under
    `/v1/messages`: `{"type": "error", "error": {"type", "message"}}`, e.g.
    `authentication_error`), keeping its status, message and headers."""
    denial = response.denied_response
    body = anthropic.error_body(denial.status.code, response.status.message)
    denial.body = json.dumps(body)


def rate_limited(decision: RateLimitDecision) -> external_auth_pb2.CheckResponse:
    """A 429 Envoy sends as is: OpenAI's body, `retry-after` and the x-ratelimit-* headers.
    A spent monthly budget is OpenAI's `insufficient_quota` (type and code), any other limit
    `rate_limit_exceeded`."""
    if decision.refused == "quota":
        kind = code = "insufficient_quota"
    else:
        kind = "tokens" if decision.refused == "tokens" else "requests"
        code = "rate_limit_exceeded"
    body = {"error": {"message": decision.message, "type": kind, "param": None, "code": code}}
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=decision.message),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=429),  # type: ignore[arg-type]
            headers=[
                _JSON_HEADER,
                _header("retry-after", str(decision.retry_after_seconds)),
                *(_header(k, v) for k, v in decision.headers),
            ],
            body=json.dumps(body),
        ),
    )


def allowed(
    principal: Principal,
    request_headers: Iterable[str],
    response_headers: Iterable[tuple[str, str]] = (),
) -> external_auth_pb2.CheckResponse:
    """OK: the principal as `x-inferplane-*` headers; the key and forged headers removed."""
    # Our five headers overwrite client copies; any other client `x-inferplane-*` is removed.
    # Never list a header we set in headers_to_remove: Envoy's order of the two is not ours.
    forged = [h for h in request_headers if h.startswith(TRUSTED_PREFIX) and h not in _SET_HEADERS]
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[
                _header(TENANT, principal.tenant),
                _header(KEY_ID, principal.key_id),
                _header(SCOPES, ",".join(principal.scopes)),
                _header(ALLOWED_MODELS, ",".join(principal.allowed_models)),
                _header(TIER, principal.tier),
            ],
            headers_to_remove=[*CLIENT_KEY_HEADERS, *forged],
            response_headers_to_add=[_header(k, v) for k, v in response_headers],
        ),
    )


class Authorization(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    """envoy.service.auth.v3.Authorization: API key → allow with identity headers, or deny.

    Missing, malformed, unknown, revoked or expired key → 401 `invalid_api_key`; a key without
    the scope the path needs (admin under /v1/admin/, inference elsewhere) → 403
    `insufficient_scope`; a key over one of its limits → 429 `rate_limit_exceeded` with
    `retry-after` and OpenAI's x-ratelimit-* headers (also added to allowed responses).
    A store outage raises UNAVAILABLE so the edge's `status_on_error`
    answers 503: never an open door.
    """

    def __init__(self, verifier: KeyVerifier, limiter: RateLimiter | None = None) -> None:
        self._verifier = verifier
        self._limiter = limiter

    async def Check(
        self, request: external_auth_pb2.CheckRequest, context: Context | None
    ) -> external_auth_pb2.CheckResponse:
        response = await self._check(request.attributes.request.http)
        if response.HasField("denied_response") and anthropic.is_anthropic_path(
            request.attributes.request.http.path
        ):
            in_anthropic_shape(response)
        return response

    async def _check(
        self, http: attribute_context_pb2.AttributeContext.HttpRequest
    ) -> external_auth_pb2.CheckResponse:
        headers: Mapping[str, str] = http.headers
        if not headers and http.header_map.headers:
            # Envoy sends `header_map` instead when `encode_raw_headers` is on.
            headers = {
                h.key.lower(): h.raw_value.decode(errors="replace") or h.value
                for h in http.header_map.headers
            }
        try:
            principal = await self._verifier.verify(client_key(headers))
        except UnauthenticatedError as exc:
            # A denial is Check's normal answer, not an RPC failure.
            return denied(401, exc.message, exc.code)
        scope = required_scope(http.path or "/")
        if scope not in principal.scopes:
            where = "/v1/admin/ endpoints" if scope == SCOPE_ADMIN else "this endpoint"
            return denied(
                403,
                f"This API key lacks the '{scope}' scope required for {where}.",
                "insufficient_scope",
            )
        decision = ALLOWED_UNLIMITED
        if self._limiter is not None and scope == SCOPE_INFERENCE:
            # Check runs only where the endpoint picker does not (models, stored responses):
            # it counts requests and tokens there, and takes no concurrency slot (a key's
            # concurrency is the picker's, released once at the stream's end).
            request_id = headers.get(REQUEST_ID) or uuid.uuid4().hex
            limits = dataclasses.replace(principal.limits, max_concurrent_requests=0)
            decision = await self._limiter.admit(principal.key_id, request_id, limits)
            if decision.refused is not None:
                return rate_limited(decision)
        return allowed(principal, headers.keys(), decision.headers)

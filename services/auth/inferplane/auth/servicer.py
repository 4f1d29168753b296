"""gRPC servicers of the auth service (proto ⇄ domain; errors are mapped by the runtime).

- `ApiKeyService` (`inferplane.auth.v1`): the admin API, for callers with the admin scope.
- `Authorization` (`envoy.service.auth.v3`): Envoy's ext_authz `Check`, on every request at the
  edge. Shapes as measured in notes/envoy_edge_probe.md §5.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import timestamp_pb2
from google.rpc import code_pb2, status_pb2

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.auth.domain import (
    SCOPE_ADMIN,
    SCOPE_CONSOLE,
    SCOPE_INFERENCE,
    UPDATABLE_FIELDS,
    ApiKey,
    KeySpec,
    KeyState,
    Limits,
    Principal,
)
from inferplane.auth.keys import ApiKeyManager
from inferplane.auth.limits import ALLOWED_UNLIMITED, RateLimitDecision, RateLimiter
from inferplane.auth.verifier import KeyVerifier
from inferplane.runtime import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from inferplane.runtime.clock import Clock
from inferplane.runtime.identity import EDGE, peer_identity

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any

# Headers the edge forwards upstream after a successful Check.
HEADER_TENANT = "x-inferplane-tenant"
HEADER_KEY_ID = "x-inferplane-key-id"
HEADER_SCOPES = "x-inferplane-scopes"
HEADER_ALLOWED_MODELS = "x-inferplane-allowed-models"
HEADER_TIER = "x-inferplane-tier"
EDGE_HEADER_PREFIX = "x-inferplane-"
ADMIN_PATH_PREFIX = "/v1/admin/"

_NAME_RE = re.compile(r"api-keys/([a-z0-9][a-z0-9-]{0,62})")
_STATE = {
    KeyState.ACTIVE: auth_pb2.ApiKey.STATE_ACTIVE,
    KeyState.REVOKED: auth_pb2.ApiKey.STATE_REVOKED,
    KeyState.EXPIRED: auth_pb2.ApiKey.STATE_EXPIRED,
}
_OUTPUT_ONLY = frozenset(
    {"name", "key_prefix", "state", "create_time", "update_time", "last_used_time", "revoke_time"}
)
_LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "monthly_token_budget",
)
MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


def parse_bearer(value: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive).

    Raises:
        UnauthenticatedError: missing value, another scheme, or no token.
    """
    if not value or not value.strip():
        raise UnauthenticatedError(MISSING_KEY_MESSAGE, code="invalid_api_key")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise UnauthenticatedError(
            "Malformed Authorization header: expected 'Authorization: Bearer YOUR_KEY'.",
            code="invalid_api_key",
        )
    return token


def required_scope(path: str) -> str:
    """The scope a request path needs: admin under `/v1/admin/`, inference anywhere else.

    The path is percent-decoded and dot segments and repeated slashes are collapsed first, so
    `/v1//admin/...` or `/v1/x/../admin/...` cannot dodge the admin rule.
    """
    clean = unquote(path.split("?", 1)[0])
    clean = posixpath.normpath("/" + clean.lstrip("/"))
    if clean == ADMIN_PATH_PREFIX.rstrip("/") or clean.startswith(ADMIN_PATH_PREFIX):
        return SCOPE_ADMIN
    return SCOPE_INFERENCE


def _ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value.astimezone(UTC))
    return ts


def _dt(ts: timestamp_pb2.Timestamp) -> datetime:
    return ts.ToDatetime(tzinfo=UTC)


def key_to_proto(key: ApiKey, now: datetime) -> auth_pb2.ApiKey:
    """The proto of a key (never its secret or hashes)."""
    msg = auth_pb2.ApiKey(
        name=key.name,
        display_name=key.display_name,
        tenant=key.tenant,
        scopes=list(key.scopes),
        allowed_models=list(key.allowed_models),
        limits=auth_pb2.Limits(
            requests_per_minute=key.limits.requests_per_minute,
            tokens_per_minute=key.limits.tokens_per_minute,
            max_concurrent_requests=key.limits.max_concurrent_requests,
            monthly_token_budget=key.limits.monthly_token_budget,
        ),
        key_prefix=key.key_prefix,
        state=_STATE[key.state(now)],
        tier=key.tier,
    )
    for field, value in (
        ("expire_time", key.expire_time),
        ("create_time", key.create_time),
        ("update_time", key.update_time),
        ("last_used_time", key.last_used_time),
        ("revoke_time", key.revoke_time),
    ):
        ts = _ts(value)
        if ts is not None:
            getattr(msg, field).CopyFrom(ts)
    return msg


def spec_from_proto(msg: auth_pb2.ApiKey) -> KeySpec:
    """The settable fields of a proto key (output-only fields are ignored)."""
    return KeySpec(
        display_name=msg.display_name,
        tenant=msg.tenant,
        scopes=tuple(msg.scopes),
        allowed_models=tuple(msg.allowed_models),
        expire_time=_dt(msg.expire_time) if msg.HasField("expire_time") else None,
        limits=Limits(
            msg.limits.requests_per_minute,
            msg.limits.tokens_per_minute,
            msg.limits.max_concurrent_requests,
            msg.limits.monthly_token_budget,
        ),
        tier=msg.tier,
    )


def fields_from_mask(paths: Iterable[str], msg: auth_pb2.ApiKey) -> frozenset[str]:
    """The fields an update sets, from its update_mask (AIP-134).

    `*` means every updatable field; an empty mask means the updatable fields set to a
    non-default value in `msg`. `limits.<field>` updates one limit and keeps the others.

    Raises:
        InvalidArgumentError: naming every bad path (unknown, output-only, immutable).
    """
    paths = [p.strip() for p in paths if p.strip()]
    if not paths:
        implied = {f for f in UPDATABLE_FIELDS if f != "limits" and _is_set(msg, f)}
        if msg.HasField("limits") and msg.limits.ByteSize():
            implied.add("limits")
        if not implied:
            raise InvalidArgumentError(
                "nothing to update: set update_mask or some updatable field",
                param="update_mask",
            )
        return frozenset(implied)
    if "*" in paths:
        if len(paths) > 1:
            raise InvalidArgumentError(
                "update_mask '*' cannot be combined with other paths", param="update_mask"
            )
        return UPDATABLE_FIELDS
    limit_paths = {f"limits.{f}" for f in _LIMIT_FIELDS}
    problems: list[str] = []
    for p in paths:
        if p in UPDATABLE_FIELDS or p in limit_paths:
            continue
        if p in _OUTPUT_ONLY:
            problems.append(f"{p!r} is output only")
        elif p == "tenant":
            problems.append("'tenant' cannot be changed (create a key for the other tenant)")
        else:
            problems.append(f"{p!r} is not a field of ApiKey")
    if problems:
        raise InvalidArgumentError(
            f"invalid update_mask: {'; '.join(problems)}. Updatable: "
            f"{', '.join(sorted(UPDATABLE_FIELDS | limit_paths))}",
            param="update_mask",
        )
    return frozenset(paths)


def _is_set(msg: auth_pb2.ApiKey, field: str) -> bool:
    if field == "expire_time":
        return msg.HasField("expire_time")
    value = getattr(msg, field)
    return bool(len(value)) if not isinstance(value, str) else bool(value)


def _key_id(name: str, param: str = "name") -> str:
    match = _NAME_RE.fullmatch(name)
    if match is None:
        raise InvalidArgumentError(
            f"{param} must look like 'api-keys/{{key_id}}', got {name!r}", param=param
        )
    return match.group(1)


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who calls the key and usage admin APIs: `key_id` (the audit log's actor) and the one
    tenant it may see, or None for an admin (every tenant).

    A key with the `admin` scope is an admin. A key with only the `console` scope (the web
    console's tenant users, issue 21) is bound to its own tenant: it sees and manages only that
    tenant's keys and usage, and never creates, grants, rotates, revokes or deletes a key with
    the admin scope (that would hand it an admin secret).
    """

    key_id: str
    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def tenant_filter(self, requested: str) -> str:
        """The tenant a list or usage query may cover: `requested` for an admin ("" = all);
        the caller's own tenant for a console key.

        Raises:
            PermissionDeniedError: a console key asking for another tenant.
        """
        if self.tenant is None:
            return requested
        if requested and requested != self.tenant:
            raise PermissionDeniedError(
                f"This console key belongs to tenant {self.tenant!r} and cannot read tenant "
                f"{requested!r}.",
                code="insufficient_scope",
                param="tenant",
            )
        return self.tenant

    def check_key(self, key: ApiKey, *, changing: bool) -> None:
        """Refuses a key outside the caller's tenant as not found (its existence is not
        revealed), and a change to a key holding the admin scope by a console key.

        Raises:
            NotFoundError: another tenant's key.
            PermissionDeniedError: a console key changing an admin key.
        """
        if self.tenant is None:
            return
        if key.tenant != self.tenant:
            raise NotFoundError(f"{key.name} not found", reason="API_KEY_NOT_FOUND")
        if changing and SCOPE_ADMIN in key.scopes:
            raise PermissionDeniedError(
                "A console key cannot change a key with the 'admin' scope.",
                code="insufficient_scope",
            )

    def check_scopes(self, scopes: Iterable[str]) -> None:
        """Refuses the admin scope in a key a console key creates or updates.

        Raises:
            PermissionDeniedError: `scopes` holds `admin` and the caller is no admin.
        """
        if self.tenant is not None and SCOPE_ADMIN in scopes:
            raise PermissionDeniedError(
                "A console key cannot grant the 'admin' scope.",
                code="insufficient_scope",
                param="api_key.scopes",
            )


def caller_of(key_id: str, tenant: str, scopes: Iterable[str], what: str) -> Caller:
    """The `Caller` of a verified key: an admin, a console key bound to `tenant`, or refused.

    Raises:
        PermissionDeniedError: neither the admin nor the console scope.
    """
    held = {s.strip() for s in scopes}
    if SCOPE_ADMIN in held:
        return Caller(key_id, None)
    if SCOPE_CONSOLE in held and tenant:
        return Caller(key_id, tenant)
    raise PermissionDeniedError(
        f"This API key lacks the 'admin' (or 'console') scope needed to {what}.",
        code="insufficient_scope",
    )


class ApiKeyService(auth_pb2_grpc.ApiKeyServiceServicer):  # type: ignore[misc]
    """inferplane.auth.v1.ApiKeyService: CRUD over API keys for admins and console keys.

    Callers: the edge (forwards `x-inferplane-scopes` from its Check; trusted when
    `trust_edge_headers` and, under mutual TLS, only from the `edge` identity) or a direct
    gRPC client with `authorization: Bearer <key>` (an operator's CLI, the web console acting
    for its signed-in key). An admin key sees every tenant; a console key only its own
    (`Caller`): another tenant's key is NOT_FOUND to it.
    No credentials → UNAUTHENTICATED; credentials without the admin or console scope →
    PERMISSION_DENIED.
    """

    def __init__(
        self,
        manager: ApiKeyManager,
        verifier: KeyVerifier,
        clock: Clock,
        *,
        trust_edge_headers: bool = True,
    ) -> None:
        self._manager = manager
        self._verifier = verifier
        self._clock = clock
        self._trust_edge_headers = trust_edge_headers

    async def caller(self, context: Context, what: str = "manage API keys") -> Caller:
        """Who makes the call (the edge's forwarded scopes and tenant, or a direct caller's
        bearer key) and which tenant it may see; `what` names the operation in the refusal.

        Raises:
            UnauthenticatedError: a direct caller without a valid key.
            PermissionDeniedError: a key with neither the admin nor the console scope.
        """
        metadata: Mapping[str, str | bytes] = dict(context.invocation_metadata() or ())
        if (
            self._trust_edge_headers
            and HEADER_SCOPES in metadata
            # Plaintext (development) has no identities; under mTLS only Envoy's headers count.
            and peer_identity(context) in (None, EDGE)
        ):
            return caller_of(
                str(metadata.get(HEADER_KEY_ID, "")),
                str(metadata.get(HEADER_TENANT, "")),
                str(metadata[HEADER_SCOPES]).split(","),
                what,
            )
        raw = metadata.get("authorization")
        principal = await self._verifier.verify(parse_bearer(str(raw) if raw else None))
        return caller_of(principal.key_id, principal.tenant, principal.scopes, what)

    async def CreateApiKey(
        self, request: auth_pb2.CreateApiKeyRequest, context: Context
    ) -> auth_pb2.CreateApiKeyResponse:
        caller = await self.caller(context)
        if not request.HasField("api_key"):
            raise InvalidArgumentError("api_key is required", param="api_key")
        spec = spec_from_proto(request.api_key)
        if caller.tenant is not None:
            if spec.tenant and spec.tenant != caller.tenant:
                raise PermissionDeniedError(
                    f"This console key can create keys only for tenant {caller.tenant!r}.",
                    code="insufficient_scope",
                    param="api_key.tenant",
                )
            spec = dataclasses.replace(spec, tenant=caller.tenant)
        caller.check_scopes(spec.scopes)
        key, secret = await self._manager.create(spec, caller.key_id)
        return auth_pb2.CreateApiKeyResponse(
            api_key=key_to_proto(key, self._clock.now()), secret=secret
        )

    async def GetApiKey(
        self, request: auth_pb2.GetApiKeyRequest, context: Context
    ) -> auth_pb2.GetApiKeyResponse:
        caller = await self.caller(context)
        key = await self._manager.get(_key_id(request.name))
        caller.check_key(key, changing=False)
        return auth_pb2.GetApiKeyResponse(api_key=key_to_proto(key, self._clock.now()))

    async def ListApiKeys(
        self, request: auth_pb2.ListApiKeysRequest, context: Context
    ) -> auth_pb2.ListApiKeysResponse:
        caller = await self.caller(context)
        page = await self._manager.list_keys(
            page_size=request.page_size,
            page_token=request.page_token,
            tenant=caller.tenant_filter(request.tenant),
            show_inactive=request.show_inactive,
        )
        now = self._clock.now()
        return auth_pb2.ListApiKeysResponse(
            api_keys=[key_to_proto(k, now) for k in page.keys],
            next_page_token=page.next_page_token,
        )

    async def UpdateApiKey(
        self, request: auth_pb2.UpdateApiKeyRequest, context: Context
    ) -> auth_pb2.UpdateApiKeyResponse:
        caller = await self.caller(context)
        if not request.HasField("api_key"):
            raise InvalidArgumentError("api_key is required", param="api_key")
        key_id = _key_id(request.api_key.name, "api_key.name")
        fields = fields_from_mask(request.update_mask.paths, request.api_key)
        spec = spec_from_proto(request.api_key)
        await self._own(caller, key_id)
        if "scopes" in fields:
            caller.check_scopes(spec.scopes)
        key = await self._manager.update(key_id, spec, fields, caller.key_id)
        return auth_pb2.UpdateApiKeyResponse(api_key=key_to_proto(key, self._clock.now()))

    async def RevokeApiKey(
        self, request: auth_pb2.RevokeApiKeyRequest, context: Context
    ) -> auth_pb2.RevokeApiKeyResponse:
        caller = await self.caller(context)
        key_id = await self._own(caller, _key_id(request.name))
        key = await self._manager.revoke(key_id, caller.key_id)
        return auth_pb2.RevokeApiKeyResponse(api_key=key_to_proto(key, self._clock.now()))

    async def DeleteApiKey(
        self, request: auth_pb2.DeleteApiKeyRequest, context: Context
    ) -> auth_pb2.DeleteApiKeyResponse:
        caller = await self.caller(context)
        key_id = await self._own(caller, _key_id(request.name))
        await self._manager.delete(key_id, caller.key_id)
        return auth_pb2.DeleteApiKeyResponse()

    async def RotateApiKey(
        self, request: auth_pb2.RotateApiKeyRequest, context: Context
    ) -> auth_pb2.RotateApiKeyResponse:
        caller = await self.caller(context)
        key_id = await self._own(caller, _key_id(request.name))
        key, secret = await self._manager.rotate(
            key_id, timedelta(seconds=request.grace_period_seconds), caller.key_id
        )
        return auth_pb2.RotateApiKeyResponse(
            api_key=key_to_proto(key, self._clock.now()), secret=secret
        )

    async def _own(self, caller: Caller, key_id: str) -> str:
        """`key_id` once a console caller may change it (`Caller.check_key`); an admin's
        call skips the read (the manager's own NOT_FOUND stays the answer)."""
        if not caller.is_admin:
            caller.check_key(await self._manager.get(key_id), changing=True)
        return key_id


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        # An empty allow-list means "all models": the header must still replace a forged one.
        keep_empty_value=True,
    )


_SET_HEADERS = frozenset(
    {HEADER_TENANT, HEADER_KEY_ID, HEADER_SCOPES, HEADER_ALLOWED_MODELS, HEADER_TIER}
)
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
    forged = [
        h for h in request_headers if h.startswith(EDGE_HEADER_PREFIX) and h not in _SET_HEADERS
    ]
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[
                _header(HEADER_TENANT, principal.tenant),
                _header(HEADER_KEY_ID, principal.key_id),
                _header(HEADER_SCOPES, ",".join(principal.scopes)),
                _header(HEADER_ALLOWED_MODELS, ",".join(principal.allowed_models)),
                _header(HEADER_TIER, principal.tier),
            ],
            headers_to_remove=["authorization", *forged],
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
        http = request.attributes.request.http
        headers: Mapping[str, str] = http.headers
        if not headers and http.header_map.headers:
            # Envoy sends `header_map` instead when `encode_raw_headers` is on.
            headers = {
                h.key.lower(): h.raw_value.decode(errors="replace") or h.value
                for h in http.header_map.headers
            }
        try:
            principal = await self._verifier.verify(parse_bearer(headers.get("authorization")))
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
            # Envoy generates x-request-id for every request (the edge drops a client's own,
            # echoing it as x-client-request-id); it names the concurrency lease, which the
            # edge's access log (`slots.py`) and the router's usage report release. Only
            # generation requests (POST) take a slot: nothing releases one for a GET.
            request_id = headers.get("x-request-id") or uuid.uuid4().hex
            limits = principal.limits
            if http.method != "POST" and limits.max_concurrent_requests:
                limits = dataclasses.replace(limits, max_concurrent_requests=0)
            decision = await self._limiter.admit(principal.key_id, request_id, limits)
            if decision.refused is not None:
                return rate_limited(decision)
        return allowed(principal, headers.keys(), decision.headers)

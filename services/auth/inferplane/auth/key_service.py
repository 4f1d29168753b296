"""`inferplane.auth.v1.ApiKeyService`: the key admin API, and who may call it (`Caller`).

An admin key (scope `admin`) manages every tenant's keys; a console key (scope `console`) only
its own tenant's, and never an admin key. The caller is the edge's forwarded verdict headers
(`inferplane.wire.headers`: `SCOPES`, `KEY_ID`, `TENANT`) or a direct caller's bearer key.
Errors are the runtime's (`inferplane.runtime`), mapped to gRPC status by its interceptor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import grpc

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.auth.convert import (
    fields_from_mask,
    key_id_from_name,
    key_to_proto,
    spec_from_proto,
)
from inferplane.auth.domain import SCOPE_ADMIN, SCOPE_CONSOLE, ApiKey
from inferplane.auth.keys import ApiKeyManager
from inferplane.auth.verifier import KeyVerifier
from inferplane.runtime import InvalidArgumentError, NotFoundError, PermissionDeniedError
from inferplane.runtime.security.api_keys import parse_bearer
from inferplane.runtime.security.identity import EDGE, peer_identity
from inferplane.runtime.time.clock import Clock
from inferplane.wire.headers import KEY_ID, SCOPES, TENANT

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any


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
            and SCOPES in metadata
            # Plaintext (development) has no identities; under mTLS only Envoy's headers count.
            and peer_identity(context) in (None, EDGE)
        ):
            return caller_of(
                str(metadata.get(KEY_ID, "")),
                str(metadata.get(TENANT, "")),
                str(metadata[SCOPES]).split(","),
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
        key = await self._manager.get(key_id_from_name(request.name))
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
        key_id = key_id_from_name(request.api_key.name, "api_key.name")
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
        key_id = await self._own(caller, key_id_from_name(request.name))
        key = await self._manager.revoke(key_id, caller.key_id)
        return auth_pb2.RevokeApiKeyResponse(api_key=key_to_proto(key, self._clock.now()))

    async def DeleteApiKey(
        self, request: auth_pb2.DeleteApiKeyRequest, context: Context
    ) -> auth_pb2.DeleteApiKeyResponse:
        caller = await self.caller(context)
        key_id = await self._own(caller, key_id_from_name(request.name))
        await self._manager.delete(key_id, caller.key_id)
        return auth_pb2.DeleteApiKeyResponse()

    async def RotateApiKey(
        self, request: auth_pb2.RotateApiKeyRequest, context: Context
    ) -> auth_pb2.RotateApiKeyResponse:
        caller = await self.caller(context)
        key_id = await self._own(caller, key_id_from_name(request.name))
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

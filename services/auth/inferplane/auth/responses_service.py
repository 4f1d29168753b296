"""The stored responses' two gRPC services (responses.proto), on `SqlResponseStore`.

- `ResponsesService` (public, transcoded by the edge): `GET` / `DELETE /v1/responses/{id}`,
  `GET /v1/responses/{id}/input_items`. The tenant is the calling key's: the edge's
  `x-inferplane-tenant` (trusted as `ApiKeyService` trusts it: plaintext, or the `edge`
  identity under mTLS), else a direct caller's bearer key. Any key may read its own tenant's
  responses (no scope needed: a response belongs to the tenant that created it).
- `ResponseStoreService` (internal): replicas save finished responses and load the one a turn
  continues. The peer policy admits the replicas' identity only (`app.py`).

An unknown, expired, deleted or other tenant's id is NOT_FOUND (code `not_found`), worded as
OpenAI words it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from google.api import httpbody_pb2

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.api.inference.v1 import responses_pb2_grpc
from inferplane.auth.responses_store import StoredResponse
from inferplane.auth.verifier import KeyVerifier
from inferplane.runtime import InvalidArgumentError, NotFoundError
from inferplane.runtime.security.api_keys import parse_bearer
from inferplane.runtime.security.identity import EDGE, peer_identity
from inferplane.runtime.time.clock import Clock
from inferplane.wire.headers import TENANT

Context = Any  # grpc.aio.ServicerContext
DEFAULT_ITEMS_LIMIT = 20  # OpenAI's default page of input_items
MAX_ITEMS_LIMIT = 100
MAX_TOKEN_ID = 2**32 - 1


def not_found(response_id: str, param: str = "response_id") -> NotFoundError:
    """OpenAI's answer to an unknown response id."""
    return NotFoundError(
        f"Response with id '{response_id}' not found.", param=param, code="not_found"
    )


def _json(value: Any) -> httpbody_pb2.HttpBody:
    data = json.dumps(value, separators=(",", ":")).encode()
    return httpbody_pb2.HttpBody(content_type="application/json", data=data)


class ResponsesService(responses_pb2_grpc.ResponsesServiceServicer):  # type: ignore[misc]
    """`inferplane.inference.v1.ResponsesService`: the public reads and deletes.

    Args:
        store: the response store (blocking; run in a thread).
        verifier: checks a direct caller's bearer key.
        clock: what "expired" is measured against.
        trust_edge_headers: read the tenant from the edge's headers (see the module doc).
    """

    def __init__(
        self, store: Any, verifier: KeyVerifier, clock: Clock, *, trust_edge_headers: bool = True
    ) -> None:
        self._store = store
        self._verifier = verifier
        self._clock = clock
        self._trust = trust_edge_headers

    async def _tenant(self, context: Context) -> str:
        metadata: Mapping[str, Any] = dict(context.invocation_metadata() or ())
        if self._trust and TENANT in metadata and peer_identity(context) in (None, EDGE):
            return str(metadata[TENANT])
        raw = metadata.get("authorization")
        principal = await self._verifier.verify(parse_bearer(str(raw) if raw else None))
        return str(principal.tenant)

    async def _get(self, context: Context, response_id: str) -> StoredResponse:
        tenant = await self._tenant(context)
        row = await asyncio.to_thread(self._store.get, tenant, response_id, self._clock.now())
        if row is None:
            raise not_found(response_id)
        return row  # type: ignore[no-any-return]

    async def GetResponse(
        self, request: rpb.GetResponseRequest, context: Context
    ) -> httpbody_pb2.HttpBody:
        if request.stream:
            raise InvalidArgumentError(
                "streaming a stored response again is not supported",
                param="stream",
                code="unsupported_parameter",
            )
        row = await self._get(context, request.response_id)
        return httpbody_pb2.HttpBody(
            content_type="application/json", data=row.response_json.encode()
        )

    async def DeleteResponse(
        self, request: rpb.DeleteResponseRequest, context: Context
    ) -> httpbody_pb2.HttpBody:
        tenant = await self._tenant(context)
        deleted = await asyncio.to_thread(self._store.delete, tenant, request.response_id)
        if not deleted:
            raise not_found(request.response_id)
        return _json({"id": request.response_id, "object": "response.deleted", "deleted": True})

    async def ListInputItems(
        self, request: rpb.ListInputItemsRequest, context: Context
    ) -> httpbody_pb2.HttpBody:
        """One page of the response's input items (`order` desc by default, as OpenAI's)."""
        limit = request.limit if request.HasField("limit") else DEFAULT_ITEMS_LIMIT
        if not 1 <= limit <= MAX_ITEMS_LIMIT:
            raise InvalidArgumentError(
                f"'limit' must be from 1 to {MAX_ITEMS_LIMIT}", param="limit"
            )
        order = request.order or "desc"
        if order not in ("asc", "desc"):
            raise InvalidArgumentError("'order' must be 'asc' or 'desc'", param="order")
        row = await self._get(context, request.response_id)
        items = json.loads(row.input_items_json)
        if order == "desc":
            items.reverse()
        if request.after:
            ids = [item.get("id") for item in items]
            if request.after not in ids:
                raise InvalidArgumentError(
                    f"no input item with id '{request.after}' in this response", param="after"
                )
            items = items[ids.index(request.after) + 1 :]
        page = items[:limit]
        return _json(
            {
                "object": "list",
                "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(items) > limit,
            }
        )


class ResponseStoreService(responses_pb2_grpc.ResponseStoreServiceServicer):  # type: ignore[misc]
    """`inferplane.inference.v1.ResponseStoreService`: the replicas' saves and loads.

    Args:
        store: the response store (blocking; run in a thread).
        clock: creation and expiry times.
        retention: how long a saved response is kept (default 30 days).
    """

    def __init__(self, store: Any, clock: Clock, retention: timedelta) -> None:
        self._store = store
        self._clock = clock
        self._retention = retention

    async def SaveResponse(
        self, request: rpb.SaveResponseRequest, context: Context
    ) -> rpb.SaveResponseResponse:
        if not request.tenant or not request.response_id.startswith("resp_"):
            raise InvalidArgumentError(
                "a saved response needs its tenant and a resp_ id", param="response_id"
            )
        try:
            json.loads(request.response_json)
            items = json.loads(request.input_items_json)
        except ValueError as exc:
            raise InvalidArgumentError(f"not JSON: {exc}", param="response_json") from exc
        if not isinstance(items, list):
            raise InvalidArgumentError("input items must be a JSON array", param="input_items_json")
        created = (
            datetime.fromtimestamp(request.created_at, UTC)
            if request.created_at
            else self._clock.now()
        )
        expires = created + self._retention
        row = StoredResponse(
            response_id=request.response_id,
            tenant=request.tenant,
            model=request.model,
            previous_response_id=request.previous_response_id,
            response_json=request.response_json.decode(),
            input_items_json=request.input_items_json.decode(),
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            render_key=request.render_key,
            created_at=created,
            expires_at=expires,
        )
        await asyncio.to_thread(self._store.save, row)
        return rpb.SaveResponseResponse(expires_at=int(expires.timestamp()))

    async def LoadResponse(
        self, request: rpb.LoadResponseRequest, context: Context
    ) -> rpb.LoadResponseResponse:
        row = await asyncio.to_thread(
            self._store.get, request.tenant, request.response_id, self._clock.now()
        )
        if row is None:
            raise not_found(request.response_id, "previous_response_id")
        return rpb.LoadResponseResponse(
            response_json=row.response_json.encode(),
            input_items_json=row.input_items_json.encode(),
            prompt_token_ids=row.prompt_token_ids,
            output_token_ids=row.output_token_ids,
            render_key=row.render_key,
            model=row.model,
        )

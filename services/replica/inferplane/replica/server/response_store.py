"""The replica's client of the stored responses (`inferplane.inference.v1.ResponseStoreService`,
served by auth, which owns the platform's tenant-scoped database): load the conversation
behind a `previous_response_id`, save a finished response.

The address is the replica's `--response-store-address` flag (the node-agent passes its own
setting, `inferplane.replica_contract.ReplicaFlags`); the call is made with the replica's
identity (the node-agent's certificate under mTLS) and checks auth's.

Errors come back as the platform's: an unknown id is auth's NOT_FOUND (404, param
`previous_response_id`); a store that cannot be reached is UnavailableError, code
`response_store_unavailable` (a 503: never a turn served without its history or a response
reported stored that was not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import grpc

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.api.inference.v1 import responses_pb2_grpc
from inferplane.runtime import InferplaneError, NotFoundError, UnavailableError, error_from_call

#: How long one call to the store may take, seconds (a save of a long prompt's ids included).
CALL_TIMEOUT_SECONDS = 10.0


class ResponseStore(Protocol):
    """What the Responses body needs of the store (`ResponseStoreClient`; fakes in tests)."""

    async def load(self, tenant: str, response_id: str) -> rpb.LoadResponseResponse:
        """The stored response; NotFoundError when unknown to `tenant`."""
        ...

    async def save(self, request: rpb.SaveResponseRequest) -> None:
        """Stores a finished response."""
        ...


class ResponseStoreClient:
    """`ResponseStore` over gRPC.

    Args:
        connect: makes the grpc.aio channel to auth (`PeerSecurity.aio_channel` with auth's
            identity checked), called on the first call, inside the event loop.
        timeout_seconds: per call.
    """

    def __init__(
        self, connect: Callable[[], Any], *, timeout_seconds: float = CALL_TIMEOUT_SECONDS
    ) -> None:
        self._connect = connect
        self._channel: Any = None
        self._stub_: Any = None
        self._timeout = timeout_seconds

    @property
    def _stub(self) -> Any:
        if self._stub_ is None:
            self._channel = self._connect()
            self._stub_ = responses_pb2_grpc.ResponseStoreServiceStub(self._channel)
        return self._stub_

    async def load(self, tenant: str, response_id: str) -> rpb.LoadResponseResponse:
        """Raises: NotFoundError (unknown to the tenant), UnavailableError (store away)."""
        request = rpb.LoadResponseRequest(tenant=tenant, response_id=response_id)
        try:
            return await self._stub.LoadResponse(request, timeout=self._timeout)  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, "load the previous response") from exc

    async def save(self, request: rpb.SaveResponseRequest) -> None:
        """Raises: UnavailableError (the store failed or cannot be reached)."""
        try:
            await self._stub.SaveResponse(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, "store the response") from exc

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def _error(exc: grpc.aio.AioRpcError, what: str) -> InferplaneError:
    trailers: dict[str, Any] = dict(exc.trailing_metadata() or ())  # type: ignore[arg-type]
    error = error_from_call(exc.code(), exc.details() or "", trailers)
    if isinstance(error, NotFoundError):
        return error
    return UnavailableError(
        f"the response store could not {what}: {exc.details() or exc.code().name}",
        code="response_store_unavailable",
    )

"""The one place where exceptions become gRPC status, plus per-method server metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram

from inferplane.runtime.service._errors import (
    ERROR_DOMAIN,
    InferplaneError,
    ResourceExhaustedError,
    UnavailableError,
)

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]

log = structlog.get_logger("inferplane.runtime")

# Trailing-metadata keys the edge's error shaper reads to build OpenAI's error body.
OPENAI_ERROR_TYPE_KEY = "x-openai-error-type"
OPENAI_ERROR_CODE_KEY = "x-openai-error-code"
OPENAI_ERROR_PARAM_KEY = "x-openai-error-param"
RETRY_AFTER_KEY = "retry-after"


def error_trailers(error: InferplaneError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata for `error`: rich status (ErrorInfo) and OpenAI's type/code/param."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=error.status.value[0], message=error.message, details=[detail])
    trailers: list[tuple[str, str | bytes]] = [
        ("grpc-status-details-bin", status.SerializeToString()),
        (OPENAI_ERROR_TYPE_KEY, error.openai_type),
        (OPENAI_ERROR_CODE_KEY, error.code),
    ]
    if error.param:
        trailers.append((OPENAI_ERROR_PARAM_KEY, error.param))
    retry_after = (
        error.retry_after_seconds
        if isinstance(error, (ResourceExhaustedError, UnavailableError))
        else None
    )
    if retry_after is not None:
        trailers.append((RETRY_AFTER_KEY, str(max(1, round(retry_after)))))
    return tuple(trailers)


class ServerMetrics:
    """gRPC server metrics in the registry of the composition root."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter(
            "inferplane_grpc_server_handled_total",
            "RPCs completed, by method and status code.",
            ["grpc_service", "grpc_method", "grpc_code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "inferplane_grpc_server_handling_seconds",
            "RPC duration until the last message.",
            ["grpc_service", "grpc_method"],
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Maps exceptions raised by servicers to gRPC status, in one place.

    - `InferplaneError` → its status code, message, `ErrorInfo` and OpenAI trailers;
    - `NotImplementedError` → UNIMPLEMENTED naming the method;
    - anything else → INTERNAL with a generic message (the traceback goes to the log).

    `authorize(context, "/pkg.Service/Method")` runs before the servicer and may raise.
    """

    def __init__(
        self,
        component: str,
        metrics: ServerMetrics | None = None,
        *,
        authorize: Callable[[Context, str], None] | None = None,
    ) -> None:
        self._component = component
        self._metrics = metrics
        # Runs first in every call (the per-RPC identity policy, identity.PeerPolicy.check);
        # what it raises is mapped like any servicer error.
        self._authorize = authorize

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        service, _, name = method.lstrip("/").rpartition("/")
        if handler.unary_unary is not None:
            return handler._replace(  # type: ignore[attr-defined,no-any-return]
                unary_unary=self._wrap_unary(handler.unary_unary, service, name)
            )
        if handler.unary_stream is not None:
            return handler._replace(  # type: ignore[attr-defined,no-any-return]
                unary_stream=self._wrap_stream(handler.unary_stream, service, name)
            )
        if handler.stream_unary is not None:
            return handler._replace(  # type: ignore[attr-defined,no-any-return]
                stream_unary=self._wrap_unary(handler.stream_unary, service, name)
            )
        if handler.stream_stream is not None:
            return handler._replace(  # type: ignore[attr-defined,no-any-return]
                stream_stream=self._wrap_stream(handler.stream_stream, service, name)
            )
        return handler

    def _observe(self, service: str, method: str, code: grpc.StatusCode, start: float) -> None:
        if self._metrics is None:
            return
        self._metrics.handled.labels(service, method, code.name).inc()
        self._metrics.seconds.labels(service, method).observe(time.perf_counter() - start)

    async def _abort(
        self, context: Context, exc: BaseException, service: str, method: str
    ) -> grpc.StatusCode:
        if isinstance(exc, InferplaneError):
            code, message, trailers = exc.status, exc.message, error_trailers(exc)
            log.info(
                "rpc_error",
                method=f"{service}/{method}",
                code=code.name,
                reason=exc.reason,
                message=exc.message,
            )
        elif isinstance(exc, NotImplementedError):
            code = grpc.StatusCode.UNIMPLEMENTED
            message = f"{service}/{method} is not implemented yet by inferplane.{self._component}"
            trailers = (
                (OPENAI_ERROR_TYPE_KEY, "invalid_request_error"),
                (OPENAI_ERROR_CODE_KEY, "unimplemented"),
            )
        else:
            code = grpc.StatusCode.INTERNAL
            message = "internal error; the request was not completed"
            trailers = (
                (OPENAI_ERROR_TYPE_KEY, "server_error"),
                (OPENAI_ERROR_CODE_KEY, "internal_error"),
            )
            log.exception("rpc_unexpected_error", method=f"{service}/{method}", exc_info=exc)
        # Trailers the handler set before failing (a replica's response summary) are kept:
        # abort's own would otherwise replace them.
        kept = tuple(context.trailing_metadata() or ())
        await context.abort(code, message, trailing_metadata=(*kept, *trailers))
        return code  # pragma: no cover - abort raises

    def _wrap_unary(self, behavior: Any, service: str, method: str) -> Any:
        authorize = self._authorize
        full = f"/{service}/{method}"

        async def wrapper(request: Any, context: Context) -> Any:
            start = time.perf_counter()
            try:
                if authorize is not None:
                    authorize(context, full)
                response = await behavior(request, context)
            except grpc.aio.AbortError:
                self._observe(service, method, context.code() or grpc.StatusCode.UNKNOWN, start)
                raise
            except Exception as exc:
                self._observe(service, method, _code_of(exc), start)
                await self._abort(context, exc, service, method)
                raise
            self._observe(service, method, context.code() or grpc.StatusCode.OK, start)
            return response

        return wrapper

    def _wrap_stream(self, behavior: Any, service: str, method: str) -> Any:
        authorize = self._authorize
        full = f"/{service}/{method}"

        async def wrapper(request: Any, context: Context) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                if authorize is not None:
                    authorize(context, full)
                async for item in behavior(request, context):
                    yield item
            except grpc.aio.AbortError:
                self._observe(service, method, context.code() or grpc.StatusCode.UNKNOWN, start)
                raise
            except Exception as exc:
                self._observe(service, method, _code_of(exc), start)
                await self._abort(context, exc, service, method)
                raise
            self._observe(service, method, context.code() or grpc.StatusCode.OK, start)

        return wrapper


def _code_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InferplaneError):
        return exc.status
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL

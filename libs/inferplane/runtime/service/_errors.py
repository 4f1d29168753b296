"""The error root of inferplane and its mapping to gRPC status and OpenAI's error shape.

Every domain error carries what three audiences need: a gRPC status code (internal callers),
an `ErrorInfo.reason` (machines; domain `inferplane.dev`), and OpenAI's `type` / `code` /
`param` (HTTP clients; https://platform.openai.com/docs/guides/error-codes). The mapping to
the wire happens in one place: `inferplane.runtime.ErrorInterceptor`; the way back, from a
status a client received to the same error, is `error_from_status` (a proxying service) and
`error_from_call` (a client: `inferplane.sdk`). `HTTP_STATUS` and `DEFAULT_OPENAI_CODE` are what
the edge makes of each gRPC code for HTTP clients.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Final

import grpc
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "inferplane.dev"

_C = grpc.StatusCode
HTTP_STATUS: Final[Mapping[grpc.StatusCode, int]] = MappingProxyType(
    {
        _C.OK: 200,
        _C.CANCELLED: 499,
        _C.UNKNOWN: 500,
        _C.INVALID_ARGUMENT: 400,
        _C.DEADLINE_EXCEEDED: 504,
        _C.NOT_FOUND: 404,
        _C.ALREADY_EXISTS: 409,
        _C.PERMISSION_DENIED: 403,
        _C.RESOURCE_EXHAUSTED: 429,
        _C.FAILED_PRECONDITION: 400,
        _C.ABORTED: 409,
        _C.OUT_OF_RANGE: 400,
        _C.UNIMPLEMENTED: 501,
        _C.INTERNAL: 500,
        _C.UNAVAILABLE: 503,
        _C.DATA_LOSS: 500,
        _C.UNAUTHENTICATED: 401,
    }
)
"""The HTTP status an HTTP client gets for each gRPC code: Envoy's
`Grpc::Utility::grpcToHttpStatus`, which the edge's transcoder applies. The edge's
`error_shaper.lua` holds the same table (`HTTP_STATUS`); libs/tests/sdk/test_errors.py pins
the two equal."""

DEFAULT_OPENAI_CODE: Final[Mapping[grpc.StatusCode, str]] = MappingProxyType(
    {
        _C.CANCELLED: "cancelled",
        _C.UNKNOWN: "internal_error",
        _C.INVALID_ARGUMENT: "invalid_request",
        _C.DEADLINE_EXCEEDED: "timeout",
        _C.NOT_FOUND: "not_found",
        _C.ALREADY_EXISTS: "already_exists",
        _C.PERMISSION_DENIED: "permission_denied",
        _C.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
        _C.FAILED_PRECONDITION: "failed_precondition",
        _C.ABORTED: "aborted",
        _C.OUT_OF_RANGE: "out_of_range",
        _C.UNIMPLEMENTED: "unimplemented",
        _C.INTERNAL: "internal_error",
        _C.UNAVAILABLE: "service_unavailable",
        _C.DATA_LOSS: "internal_error",
        _C.UNAUTHENTICATED: "invalid_api_key",
    }
)
"""OpenAI's error `code` for a status whose sender named none (not an inferplane servicer:
gRPC's own UNAVAILABLE or DEADLINE_EXCEEDED, Envoy): the edge's `DEFAULT_CODE`, pinned equal
by the same test."""


class InferplaneError(Exception):
    """Root of every error inferplane raises on purpose.

    Attributes:
        message: a sentence for the client (no internals).
        reason: UPPER_SNAKE reason for `google.rpc.ErrorInfo`.
        param: the request field at fault, when there is one.
        code: OpenAI's error `code` (e.g. "model_not_found"); defaults to `reason.lower()`.
        grpc_code: the gRPC status code; the class's `status` unless the error was rebuilt
            from a status that has no class of its own (`error_from_call`: CANCELLED,
            ABORTED, OUT_OF_RANGE on the root class, UNKNOWN and DATA_LOSS as InternalError).
        http_status: the HTTP status the edge answers with for `grpc_code` (`HTTP_STATUS`).
    """

    status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    openai_type: ClassVar[str] = "server_error"
    default_reason: ClassVar[str] = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        param: str | None = None,
        code: str | None = None,
        metadata: dict[str, str] | None = None,
        grpc_code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or (code.upper() if code else self.default_reason)
        self.param = param
        self.code = code or self.reason.lower()
        self.metadata = dict(metadata or {})
        self.grpc_code = grpc_code or self.status

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.grpc_code, 500)


class InvalidArgumentError(InferplaneError):
    """The request is malformed or asks for something unsupported (HTTP 400)."""

    status = grpc.StatusCode.INVALID_ARGUMENT
    openai_type = "invalid_request_error"
    default_reason = "INVALID_ARGUMENT"


class NotFoundError(InferplaneError):
    """The named resource (model, key, replica...) does not exist (HTTP 404)."""

    status = grpc.StatusCode.NOT_FOUND
    openai_type = "invalid_request_error"
    default_reason = "NOT_FOUND"


class AlreadyExistsError(InferplaneError):
    """A resource with that name exists already (HTTP 409)."""

    status = grpc.StatusCode.ALREADY_EXISTS
    openai_type = "invalid_request_error"
    default_reason = "ALREADY_EXISTS"


class FailedPreconditionError(InferplaneError):
    """The system is not in a state that allows the operation (HTTP 400)."""

    status = grpc.StatusCode.FAILED_PRECONDITION
    openai_type = "invalid_request_error"
    default_reason = "FAILED_PRECONDITION"


class UnauthenticatedError(InferplaneError):
    """Missing, unknown, revoked or expired credentials (HTTP 401)."""

    status = grpc.StatusCode.UNAUTHENTICATED
    openai_type = "invalid_request_error"
    default_reason = "INVALID_API_KEY"


class PermissionDeniedError(InferplaneError):
    """Valid credentials without the scope or model the request needs (HTTP 403)."""

    status = grpc.StatusCode.PERMISSION_DENIED
    openai_type = "invalid_request_error"
    default_reason = "PERMISSION_DENIED"


class ResourceExhaustedError(InferplaneError):
    """A rate, token or queue limit was hit (HTTP 429); `retry_after_seconds` says when to retry;
    `headers` are response headers an HTTP refusal carries besides `retry-after` (OpenAI's
    `x-ratelimit-*`: `inferplane.wire.ratelimit`)."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    openai_type = "rate_limit_error"
    default_reason = "RATE_LIMIT_EXCEEDED"

    def __init__(
        self,
        message: str,
        *,
        retry_after_seconds: float | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after_seconds = retry_after_seconds
        self.headers = headers


class UnavailableError(InferplaneError):
    """No replica or dependency can serve the request now; retrying may succeed (HTTP 503);
    `retry_after_seconds`, when set, says when (a `retry-after` header, e.g. while a
    deployment at zero starts a replica)."""

    status = grpc.StatusCode.UNAVAILABLE
    openai_type = "server_error"
    default_reason = "UNAVAILABLE"

    def __init__(
        self, message: str, *, retry_after_seconds: float | None = None, **kwargs: object
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after_seconds = retry_after_seconds


class DeadlineExceededError(InferplaneError):
    """The request ran past its deadline (HTTP 504)."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED
    openai_type = "server_error"
    default_reason = "DEADLINE_EXCEEDED"


class InternalError(InferplaneError):
    """A bug or an engine failure (HTTP 500); the message stays generic."""


class UnimplementedError(InferplaneError):
    """The server has no such method: this address serves another service, or a newer
    contract than the server's (HTTP 501). The interceptor sends a servicer's
    `NotImplementedError` with the same type and code."""

    status = grpc.StatusCode.UNIMPLEMENTED
    openai_type = "invalid_request_error"
    default_reason = "UNIMPLEMENTED"


class ConfigError(InferplaneError):
    """Settings are missing or wrong; raised at start-up, never on a request."""

    status = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "BAD_CONFIG"


_BY_STATUS: dict[grpc.StatusCode, type[InferplaneError]] = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        UnauthenticatedError,
        PermissionDeniedError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        InternalError,
    )
}


def error_from_status(
    code: grpc.StatusCode, message: str, trailers: dict[str, str]
) -> InferplaneError:
    """Rebuilds the InferplaneError an upstream inferplane service raised, from its status and
    trailing metadata (`x-openai-error-code`/`-param`, `retry-after`), so a proxying service
    (the router) re-raises it unchanged. Unknown codes become InternalError."""
    cls = _BY_STATUS.get(code, InternalError)
    kwargs: dict[str, object] = {}
    openai_code = trailers.get("x-openai-error-code")
    if openai_code:
        kwargs["code"] = openai_code
        kwargs["reason"] = openai_code.upper()
    if trailers.get("x-openai-error-param"):
        kwargs["param"] = trailers["x-openai-error-param"]
    if cls in (ResourceExhaustedError, UnavailableError) and trailers.get("retry-after"):
        kwargs["retry_after_seconds"] = float(trailers["retry-after"])
    if cls is InternalError:
        message = "internal error; the request was not completed"
    return cls(message, **kwargs)  # type: ignore[arg-type]


_CALL_CLASSES: Mapping[grpc.StatusCode, type[InferplaneError]] = {
    **_BY_STATUS,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def error_from_call(
    code: grpc.StatusCode, message: str, trailers: Mapping[str, str | bytes]
) -> InferplaneError:
    """The error a client sees for a call that ended with `code`, `message` (the status
    details) and `trailers` (trailing metadata): the class of `code` (the root class for
    CANCELLED, ABORTED and OUT_OF_RANGE), OpenAI's `code` and `param` as the servicer sent
    them (`x-openai-error-code` / `-param`; `DEFAULT_OPENAI_CODE` otherwise, as the edge
    does), `reason` and `metadata` from the status's `ErrorInfo` (`grpc-status-details-bin`),
    `retry_after_seconds` from `retry-after`. Unlike `error_from_status` (a proxy, which
    must not pass internals on), the message is kept: it is the caller's own call.
    """
    cls = _CALL_CLASSES.get(code, InferplaneError)
    text = {k: v for k, v in trailers.items() if isinstance(v, str)}  # `-bin` keys are bytes
    openai_code = text.get("x-openai-error-code") or DEFAULT_OPENAI_CODE.get(code, "unknown")
    kwargs: dict[str, object] = {
        "code": openai_code,
        "reason": openai_code.upper(),
        "param": text.get("x-openai-error-param") or None,
        "grpc_code": code,
    }
    info = _error_info(trailers.get("grpc-status-details-bin"))
    if info is not None:
        kwargs["reason"] = info.reason or kwargs["reason"]
        kwargs["metadata"] = dict(info.metadata)
    if cls in (ResourceExhaustedError, UnavailableError) and text.get("retry-after"):
        kwargs["retry_after_seconds"] = float(text["retry-after"])
    return cls(message, **kwargs)  # type: ignore[arg-type]


def _error_info(raw: str | bytes | None) -> error_details_pb2.ErrorInfo | None:
    """The first `ErrorInfo` of inferplane's domain in a serialized `google.rpc.Status`."""
    if not isinstance(raw, bytes):
        return None
    try:
        status = status_pb2.Status.FromString(raw)
    except Exception:  # a foreign or corrupt detail must not hide the error itself
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return info
    return None

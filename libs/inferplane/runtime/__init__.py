"""The service base every inferplane service starts from.

Settings (`ServiceSettings`, `load_settings`), the error root (`InferplaneError` and its
subclasses, mapped to gRPC status and OpenAI's error shape by `ErrorInterceptor`), and the
server runner (`App`, `ServicerBinding`, `serve`, `run`) with health, reflection, Prometheus
/metrics, structured logs and graceful shutdown.
"""

from inferplane.runtime.service._errors import (
    DEFAULT_OPENAI_CODE,
    ERROR_DOMAIN,
    HTTP_STATUS,
    AlreadyExistsError,
    ConfigError,
    DeadlineExceededError,
    FailedPreconditionError,
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    error_from_call,
    error_from_status,
)
from inferplane.runtime.service._gc import GcPauses, freeze_heap
from inferplane.runtime.service._interceptor import (
    OPENAI_ERROR_CODE_KEY,
    OPENAI_ERROR_PARAM_KEY,
    OPENAI_ERROR_TYPE_KEY,
    RETRY_AFTER_KEY,
    ErrorInterceptor,
    ServerMetrics,
    error_trailers,
)
from inferplane.runtime.service._server import (
    App,
    RunningServer,
    ServicerBinding,
    configure_logging,
    grpc_options,
    loop_factory,
    run,
    serve,
)
from inferplane.runtime.service._settings import ServiceSettings, load_settings

__all__ = [
    "DEFAULT_OPENAI_CODE",
    "ERROR_DOMAIN",
    "HTTP_STATUS",
    "OPENAI_ERROR_CODE_KEY",
    "OPENAI_ERROR_PARAM_KEY",
    "OPENAI_ERROR_TYPE_KEY",
    "RETRY_AFTER_KEY",
    "AlreadyExistsError",
    "App",
    "ConfigError",
    "DeadlineExceededError",
    "ErrorInterceptor",
    "FailedPreconditionError",
    "GcPauses",
    "InferplaneError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RunningServer",
    "ServerMetrics",
    "ServiceSettings",
    "ServicerBinding",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "configure_logging",
    "error_from_call",
    "error_from_status",
    "error_trailers",
    "freeze_heap",
    "grpc_options",
    "load_settings",
    "loop_factory",
    "run",
    "serve",
]

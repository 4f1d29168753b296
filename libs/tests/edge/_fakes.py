"""Small in-process gRPC fakes the edge tests put behind a real Envoy.

- `FakeInference`: `inference.v1.InferenceService` with canned answers chosen by `model`
  (errors raised through the runtime's real trailer contract, `error_trailers`).
- `FakeAuthz`: Envoy ext_authz `Check` (accepts `Bearer good`) plus `ApiKeyService.ListApiKeys`,
  with a `mode` switch: "ok", "slow" (past the edge's authz timeout), "error" (UNAVAILABLE).
- `FakePicker`: Envoy ext_proc `Process` as the router's endpoint picker speaks it: picks
  `targets` (host:port list) on the request body, or refuses; records what it saw.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from envoy.type.v3 import http_status_pb2 as status_codes
from google.api import httpbody_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.edge import PICK_KEY, PICK_NAMESPACE, MiB
from inferplane.runtime import (
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    error_trailers,
)
from inferplane.wire import SUMMARY_KEYS, ResponseSummary

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * MiB),
    ("grpc.max_send_message_length", 64 * MiB),
]
CREATED = 1_767_225_600
NULL = struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)
STREAM_PIECES = ("Hel", "lo", " wor", "ld")
SLOW_STREAM_GAP_S = 0.4

#: Errors the fake raises, by `model`.
ERRORS: dict[str, InferplaneError] = {
    "missing": NotFoundError(
        'The model `missing` does not exist (you asked for "missing", é).',
        reason="MODEL_NOT_FOUND",
        param="model",
    ),
    "bad-param": InvalidArgumentError(
        "temperature must be between 0 and 2", param="temperature", code="invalid_value"
    ),
    "busy": ResourceExhaustedError(
        "Rate limit reached for requests", retry_after_seconds=7, code="rate_limit_exceeded"
    ),
    "internal": InternalError("internal error; the request was not completed"),
}
#: Raised as a bare Python exception: grpc turns it into UNKNOWN with this text in the message.
CRASH_SECRET = "KeyError('tenant') in /srv/inferplane/router/servicer.py line 42"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Call:
    """One RPC the fake served: method name, request model, metadata, request size in bytes."""

    method: str
    model: str
    metadata: dict[str, str]
    request_bytes: int


def _sse(obj: dict[str, Any] | str) -> httpbody_pb2.HttpBody:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return httpbody_pb2.HttpBody(
        content_type="text/event-stream", data=f"data: {data}\n\n".encode()
    )


class FakeInference(pb_grpc.InferenceServiceServicer):
    """Canned InferenceService; `model` picks the behaviour (see ERRORS, "crash", "slow-stream",
    "die-mid-stream"); anything else succeeds."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext) -> str:
        model = request.request.model if request.HasField("request") else ""
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        with self._lock:
            self.calls.append(Call(method, model, metadata, request.ByteSize()))
        if model == "crash":
            raise RuntimeError(CRASH_SECRET)
        error = ERRORS.get(model)
        if error is not None:
            context.set_trailing_metadata(error_trailers(error))
            context.abort(error.status, error.message)
        return model

    def CreateChatCompletion(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._enter("CreateChatCompletion", request, context)
        context.set_trailing_metadata(SUMMARY.to_metadata())
        prompt_chars = sum(len(m.content.string_value) for m in request.request.messages)
        message = pb.ChatCompletionMessage(role="assistant", content=NULL)
        if request.request.tools:
            message.tool_calls.append(
                pb.ToolCall(
                    id="functions.get_weather:0",
                    type="function",
                    function=pb.FunctionCall(name="get_weather", arguments='{"city": "Tokyo"}'),
                )
            )
            finish = "tool_calls"
        else:
            message.content.string_value = "unary chat"
            finish = "stop"
        return pb.CreateChatCompletionResponse(
            id="chatcmpl-fake",
            object="chat.completion",
            created=CREATED,
            model=model,
            choices=[
                pb.ChatCompletionChoice(
                    index=0, message=message, finish_reason=finish, logprobs=NULL
                )
            ],
            usage=pb.Usage(
                prompt_tokens=prompt_chars, completion_tokens=7, total_tokens=prompt_chars + 7
            ),
        )

    def StreamChatCompletionEvents(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[httpbody_pb2.HttpBody]:
        model = self._enter("StreamChatCompletionEvents", request, context)
        context.set_trailing_metadata(SUMMARY.to_metadata())
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
        }
        for i, piece in enumerate(STREAM_PIECES):
            if model == "die-mid-stream" and i == 2:
                yield _sse(
                    {
                        "error": {
                            "message": "replica died mid-stream",
                            "type": "server_error",
                            "param": None,
                            "code": "replica_failed",
                        }
                    }
                )
                return
            delta: dict[str, Any] = {"content": piece}
            if i == 0:
                delta["role"] = "assistant"
            yield _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            if model == "slow-stream":
                time.sleep(SLOW_STREAM_GAP_S)
        yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if request.request.stream_options.include_usage:
            usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            yield _sse({**base, "choices": [], "usage": usage})
        yield _sse("[DONE]")

    def CreateCompletion(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._enter("CreateCompletion", request, context)
        return pb.CreateCompletionResponse(
            id="cmpl-fake",
            object="text_completion",
            created=CREATED,
            model=model,
            choices=[
                pb.CompletionChoice(
                    index=0,
                    text="unary completion",
                    finish_reason=struct_pb2.Value(string_value="length"),
                    logprobs=NULL,
                )
            ],
            usage=pb.Usage(prompt_tokens=2, completion_tokens=2, total_tokens=4),
        )

    def StreamCompletionEvents(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[httpbody_pb2.HttpBody]:
        model = self._enter("StreamCompletionEvents", request, context)
        base = {"id": "cmpl-fake", "object": "text_completion", "created": CREATED, "model": model}
        for i, piece in enumerate(STREAM_PIECES):
            finish = "stop" if i == len(STREAM_PIECES) - 1 else None
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            yield _sse({**base, "choices": [choice]})
        yield _sse("[DONE]")

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append(Call("ListModels", "", {}, 0))
        return pb.ListModelsResponse(
            object="list",
            data=[pb.Model(id="kimi-tiny", object="model", created=CREATED, owned_by="inferplane")],
        )


#: What the fake replica says about every successful request in its trailers.
SUMMARY = ResponseSummary(
    replica_id="fake-replica", prompt_tokens=3, completion_tokens=4, finish_reason="stop"
)


def _header_value(header: core_pb2.HeaderValue) -> str:
    return header.raw_value.decode() if header.raw_value else header.value


@dataclasses.dataclass
class Pick:
    """One request as the fake picker saw it: gRPC path, body bytes, request headers, response
    status and the summary trailers it read."""

    path: str = ""
    body_bytes: int = 0
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    grpc_status: str = ""
    summary: ResponseSummary | None = None
    removed: tuple[str, ...] = ()


class FakePicker(ep_grpc.ExternalProcessorServicer):
    """ext_proc `Process` answering like the router's endpoint picker.

    `targets` is the host:port list it picks (primary first); `refuse` set to an
    `InferplaneError` answers every request with that error as an immediate response.
    """

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.refuse: InferplaneError | None = None
        self.hang_s = 0.0  # > the edge's picker timeout: the picker never answers in time
        self.picks: list[Pick] = []
        self._lock = threading.Lock()

    def Process(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        pick = Pick()
        with self._lock:
            self.picks.append(pick)
        for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                pick.headers = {
                    h.key: _header_value(h) for h in message.request_headers.headers.headers
                }
                pick.path = pick.headers.get(":path", "")
                yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            elif kind == "request_body":
                pick.body_bytes = len(message.request_body.body)
                if self.hang_s:
                    time.sleep(self.hang_s)
                    return
                if self.refuse is not None:
                    yield refusal(self.refuse)
                    continue
                metadata = struct_pb2.Struct()
                metadata.update({PICK_NAMESPACE: {PICK_KEY: ",".join(self.targets)}})
                retries = str(max(0, len(self.targets) - 1))
                yield ep.ProcessingResponse(
                    request_body=ep.BodyResponse(
                        response=ep.CommonResponse(
                            header_mutation=ep.HeaderMutation(
                                set_headers=[_raw_header("x-envoy-max-retries", retries)]
                            )
                        )
                    ),
                    dynamic_metadata=metadata,
                )
            elif kind == "response_headers":
                headers = message.response_headers.headers.headers
                yield ep.ProcessingResponse(
                    response_headers=ep.HeadersResponse(response=self._read(pick, headers))
                )
            elif kind == "response_trailers":
                trailers = message.response_trailers.trailers.headers
                yield ep.ProcessingResponse(
                    response_trailers=ep.TrailersResponse(
                        header_mutation=self._read(pick, trailers).header_mutation
                    )
                )

    @staticmethod
    def _read(pick: Pick, headers: Any) -> ep.CommonResponse:
        seen = {h.key: _header_value(h) for h in headers}
        if "grpc-status" in seen:
            pick.grpc_status = seen["grpc-status"]
        found = tuple(k for k in seen if k in SUMMARY_KEYS)
        if found:
            pick.summary = ResponseSummary.from_metadata(seen)
            pick.removed += found
        return ep.CommonResponse(header_mutation=ep.HeaderMutation(remove_headers=list(found)))


def _raw_header(key: str, value: str) -> core_pb2.HeaderValueOption:
    return core_pb2.HeaderValueOption(
        header=core_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


#: gRPC code → HTTP status, as Envoy maps them (Grpc::Utility::grpcToHttpStatus).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def refusal(error: InferplaneError) -> ep.ProcessingResponse:
    """An immediate response the way the picker refuses: OpenAI's JSON body with the HTTP
    status, Retry-After for a 429, details `picker_<code>` (the edge passes it through)."""
    body = {
        "error": {
            "message": error.message,
            "type": "rate_limit_error"
            if error.status == grpc.StatusCode.RESOURCE_EXHAUSTED
            else error.openai_type,
            "param": error.param,
            "code": error.code,
        }
    }
    headers = [_raw_header("content-type", "application/json")]
    retry_after = getattr(error, "retry_after_seconds", None)
    if retry_after is not None:
        headers.append(_raw_header("retry-after", str(max(1, round(retry_after)))))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=status_codes.HttpStatus(code=HTTP_STATUS.get(error.status, 500)),
            headers=ep.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=f"picker_{error.code}",
        )
    )


OPENAI_401 = json.dumps(
    {
        "error": {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
)


class FakeAuthz(external_auth_pb2_grpc.AuthorizationServicer, auth_pb2_grpc.ApiKeyServiceServicer):
    """ext_authz `Check` accepting `Bearer good`; `mode` is "ok", "slow" or "error"."""

    def __init__(self, slow_s: float = 3.0) -> None:
        self.mode = "ok"
        self.slow_s = slow_s
        self.checks = 0

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.checks += 1
        if self.mode == "slow":
            time.sleep(self.slow_s)
        elif self.mode == "error":
            context.abort(grpc.StatusCode.UNAVAILABLE, "database is down")
        headers = request.attributes.request.http.headers
        if headers.get("authorization") != "Bearer good":
            return external_auth_pb2.CheckResponse(
                status=status_pb2.Status(code=code_pb2.UNAUTHENTICATED),
                denied_response=external_auth_pb2.DeniedHttpResponse(
                    status=http_status_pb2.HttpStatus(code=http_status_pb2.Unauthorized),
                    headers=[_header("content-type", "application/json")],
                    body=OPENAI_401,
                ),
            )
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=code_pb2.OK),
            ok_response=external_auth_pb2.OkHttpResponse(
                headers=[_header("x-inferplane-tenant-id", "tenant-a")],
                headers_to_remove=["authorization"],
            ),
        )

    def ListApiKeys(self, request: Any, context: grpc.ServicerContext) -> Any:
        return auth_pb2.ListApiKeysResponse(
            api_keys=[auth_pb2.ApiKey(name="api-keys/k1", display_name="ci", tenant="tenant-a")]
        )


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def start_grpc_server(*register: Any) -> tuple[grpc.Server, int]:
    """A sync gRPC server on a free loopback port; `register` are (add_fn, servicer) pairs."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=GRPC_OPTIONS)
    for add, servicer in register:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port

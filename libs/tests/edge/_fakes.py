"""Small in-process gRPC fakes the edge tests put behind a real Envoy.

- `FakeInference`: `inference.v1.InferenceService` with canned answers chosen by `model`
  (errors raised through the runtime's real trailer contract, `error_trailers`).
- `FakeAuthz`: Envoy ext_authz `Check` (accepts `Bearer good`) plus `ApiKeyService.ListApiKeys`
  and `CreateApiKey` (records the key it was given),
  with a `mode` switch: "ok", "slow" (past the edge's authz timeout), "error" (UNAVAILABLE).
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
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.api import httpbody_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.apis import anthropic
from inferplane.edge import MiB
from inferplane.runtime import (
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    error_trailers,
)
from inferplane.wire import ResponseSummary, read_form

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
    "down": UnavailableError("no replica is ready", code="no_ready_replica"),
}
#: Raised as a bare Python exception: grpc turns it into UNKNOWN with this text in the message.
CRASH_SECRET = "KeyError('tenant') in /srv/inferplane/router/servicer.py line 42"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Call:
    """One RPC the fake served: method name, request model, metadata, request size in bytes,
    and the OpenAI request body message as the transcoder built it (None for ListModels)."""

    method: str
    model: str
    metadata: dict[str, str]
    request_bytes: int
    body: Any = None


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
            self.calls.append(Call(method, model, metadata, request.ByteSize(), request.request))
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

    def CreateEmbedding(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._enter("CreateEmbedding", request, context)
        vector = struct_pb2.Value(
            list_value=struct_pb2.ListValue(values=[struct_pb2.Value(number_value=0.5)])
        )
        return pb.CreateEmbeddingResponse(
            object="list",
            data=[pb.Embedding(object="embedding", index=0, embedding=vector)],
            model=model,
            usage=pb.EmbeddingUsage(prompt_tokens=1, total_tokens=1),
        )

    def CreateTranscription(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Echoes what reached it of the multipart upload: its content type and size, as
        text/plain; the form's `model` picks errors as for the other methods, and model
        "too-large" is the replica refusing the file (code request_too_large)."""
        form = read_form(
            request.body.content_type,
            request.body.data,
            max_file_bytes=len(request.body.data),
            keep_files=False,
        )
        model = form.get("model") or ""
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        with self._lock:
            self.calls.append(Call("CreateTranscription", model, metadata, request.ByteSize()))
        error = ERRORS.get(model)
        if model == "too-large":
            error = InvalidArgumentError(
                "the file is larger than the limit", param="file", code="request_too_large"
            )
        if error is not None:
            context.set_trailing_metadata(error_trailers(error))
            context.abort(error.status, error.message)
        context.set_trailing_metadata(SUMMARY.to_metadata())
        echo = f"{len(request.body.data)} bytes of {request.body.content_type}\n"
        yield httpbody_pb2.HttpBody(content_type="text/plain; charset=utf-8", data=echo.encode())

    CreateTranslation = CreateTranscription

    def CreateMessage(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[httpbody_pb2.HttpBody]:
        """Anthropic Messages: a canned Message (JSON), or with `stream` its events."""
        model = self._enter("CreateMessage", request, context)
        context.set_trailing_metadata(SUMMARY.to_metadata())
        message = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": "fake"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 1},
        }
        if not request.request.stream:
            yield httpbody_pb2.HttpBody(
                content_type="application/json", data=json.dumps(message).encode()
            )
            return
        yield httpbody_pb2.HttpBody(
            content_type="text/event-stream",
            data=b"event: message_start\ndata: "
            + json.dumps({"type": "message_start", "message": message}).encode()
            + b'\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n',
        )

    def CountMessageTokens(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("CountMessageTokens", request, context)
        return apb.CountMessageTokensResponse(input_tokens=42)

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
        self.created: list[Any] = []

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.checks += 1
        if self.mode == "slow":
            time.sleep(self.slow_s)
        elif self.mode == "error":
            context.abort(grpc.StatusCode.UNAVAILABLE, "database is down")
        headers = request.attributes.request.http.headers
        if headers.get("authorization") != "Bearer good":
            # As auth: Anthropic's shape on Anthropic's paths.
            body = OPENAI_401
            if anthropic.is_anthropic_path(request.attributes.request.http.path):
                body = json.dumps(
                    anthropic.error_body(401, json.loads(OPENAI_401)["error"]["message"])
                )
            return external_auth_pb2.CheckResponse(
                status=status_pb2.Status(code=code_pb2.UNAUTHENTICATED),
                denied_response=external_auth_pb2.DeniedHttpResponse(
                    status=http_status_pb2.HttpStatus(code=http_status_pb2.Unauthorized),
                    headers=[_header("content-type", "application/json")],
                    body=body,
                ),
            )
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=code_pb2.OK),
            ok_response=external_auth_pb2.OkHttpResponse(
                headers=[_header("x-inferplane-tenant-id", "tenant-a")],
                headers_to_remove=["authorization"],
            ),
        )

    def CreateApiKey(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.created.append(request.api_key)
        key = auth_pb2.ApiKey()
        key.CopyFrom(request.api_key)
        key.name = "api-keys/k2"
        return auth_pb2.CreateApiKeyResponse(api_key=key, secret="ip-secret")

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

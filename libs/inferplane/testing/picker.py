"""`FakePicker`: Envoy's ext_proc `Process` answered the way the router's endpoint picker
answers (notes in inferplane.edge: the picker protocol), for tests that put a real Envoy in
front of fake replicas. It picks a fixed `host:port` list, refuses with an error, or hangs
past the edge's picker timeout, and records what it saw of each request.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2 as status_codes
from google.protobuf import struct_pb2

from inferplane.apis import anthropic
from inferplane.runtime import InferplaneError, ResourceExhaustedError
from inferplane.wire import SUMMARY_KEYS, ResponseSummary
from inferplane.wire.headers import DESTINATION_ENDPOINT as PICK_KEY
from inferplane.wire.headers import ENVOY_MAX_RETRIES, PICK_NAMESPACE


def _header_value(header: core_pb2.HeaderValue) -> str:
    return str(header.raw_value.decode() if header.raw_value else header.value)


@dataclasses.dataclass
class Pick:
    """One request as the fake picker saw it: gRPC path, body bytes, request headers, response
    status and the summary trailers it read, and the side stream's own gRPC metadata."""

    path: str = ""
    stream_metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    body_bytes: int = 0
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    grpc_status: str = ""
    summary: ResponseSummary | None = None
    removed: tuple[str, ...] = ()


class FakePicker(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
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

    def Process(self, requests: Iterable[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        pick = Pick()
        pick.stream_metadata = {
            k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)
        }
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
                    method = pick.path.rsplit("/", 1)[-1]
                    yield refusal(self.refuse, anthropic_shape=method in ANTHROPIC_METHODS)
                    continue
                metadata = struct_pb2.Struct()
                metadata.update({PICK_NAMESPACE: {PICK_KEY: ",".join(self.targets)}})
                retries = str(max(0, len(self.targets) - 1))
                yield ep.ProcessingResponse(
                    request_body=ep.BodyResponse(
                        response=ep.CommonResponse(
                            header_mutation=ep.HeaderMutation(
                                set_headers=[_raw_header(ENVOY_MAX_RETRIES, retries)]
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


#: The gRPC methods of Anthropic's Messages API (the real picker knows them by `Method.api`).
ANTHROPIC_METHODS = frozenset({"CreateMessage", "CountMessageTokens"})


def refusal(error: InferplaneError, *, anthropic_shape: bool = False) -> ep.ProcessingResponse:
    """An immediate response the way the picker refuses: OpenAI's JSON body with the HTTP
    status (Anthropic's body and 529 for 503 with `anthropic_shape`), Retry-After for a 429,
    details `picker_<code>` (the edge passes it through)."""
    status = HTTP_STATUS.get(error.status, 500)
    body: dict[str, Any]
    if anthropic_shape:
        body = anthropic.error_body(status, error.message)
        status = anthropic.error_status(status)
    else:
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
    retry_after = error.retry_after_seconds if isinstance(error, ResourceExhaustedError) else None
    if retry_after is not None:
        headers.append(_raw_header("retry-after", str(max(1, round(retry_after)))))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=status_codes.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=ep.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=f"picker_{error.code}",
        )
    )

"""`FakePicker`: Envoy's ext_proc `Process` answered the way the router's endpoint picker
answers (notes in inferplane.edge: the picker protocol), for tests that put a real Envoy in
front of fake replicas. It authenticates the request headers as the picker does (one good
key, `GOOD_KEY`: its verdict headers set, the key removed, the authenticated mark; any other
key: an immediate 401 in the API's shape), picks a fixed `host:port` list, refuses with an
error, or hangs past the edge's picker timeout, and records what it saw of each request.
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
from google.api import annotations_pb2
from google.protobuf import struct_pb2

from inferplane.api.inference.v1 import inference_pb2
from inferplane.apis import anthropic
from inferplane.runtime import (
    InferplaneError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from inferplane.runtime.security.api_keys import client_key
from inferplane.wire import SUMMARY_KEYS, ResponseSummary
from inferplane.wire.headers import (
    CLIENT_KEY_HEADERS,
    ENVOY_MAX_RETRIES,
    KEY_ID,
    PICK_NAMESPACE,
    PICKER_AUTHENTICATED,
    PICKER_NAMESPACE,
    TENANT,
    TRUSTED_PREFIX,
)
from inferplane.wire.headers import DESTINATION_ENDPOINT as PICK_KEY

#: The one key the fake picker accepts (`Authorization: Bearer good` or `x-api-key: good`).
GOOD_KEY = "good"
#: The verdict it sets for `GOOD_KEY`.
VERDICT = {TENANT: "tenant-a", KEY_ID: "k1"}
#: The public REST paths InferenceService binds (`google.api.http` POST): any other path or
#: verb is a 404, as the picker answers.
REST_PATHS = frozenset(
    rule.post
    for method in inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].methods
    if (rule := method.GetOptions().Extensions[annotations_pb2.http]).post.startswith("/v1/")
)


def _header_value(header: core_pb2.HeaderValue) -> str:
    return str(header.raw_value.decode() if header.raw_value else header.value)


@dataclasses.dataclass
class Pick:
    """One request as the fake picker saw it: the client's REST path, body bytes, request
    headers, response status and the summary trailers it read, and the side stream's own gRPC
    metadata."""

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
    `InferplaneError` answers every request with that error as an immediate response;
    `authenticate` False answers the headers without the authenticated mark (a picker that
    did not authenticate: the edge's guard must refuse).
    """

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.refuse: InferplaneError | None = None
        self.hang_s = 0.0  # > the edge's picker timeout: the picker never answers in time
        self.authenticate = True
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
                shape = anthropic.is_anthropic_path(pick.path)
                if client_key(pick.headers) != GOOD_KEY:
                    error: InferplaneError = UnauthenticatedError(
                        "Incorrect API key provided.", code="invalid_api_key"
                    )
                    yield refusal(error, anthropic_shape=shape)
                    return
                base = pick.path.partition("?")[0]
                if pick.headers.get(":method") != "POST" or base not in REST_PATHS:
                    error = NotFoundError(f"Invalid URL ({base})", code="unknown_url")
                    yield refusal(error, anthropic_shape=shape)
                    return
                yield self._authenticated(pick)
            elif kind == "request_body":
                pick.body_bytes = len(message.request_body.body)
                if self.hang_s:
                    time.sleep(self.hang_s)
                    return
                if self.refuse is not None:
                    shape = anthropic.is_anthropic_path(pick.path)
                    yield refusal(self.refuse, anthropic_shape=shape)
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

    def _authenticated(self, pick: Pick) -> ep.ProcessingResponse:
        """The verdict set, the key removed and (unless `authenticate` is off) the mark."""
        removed = [
            h
            for h in pick.headers
            if h in CLIENT_KEY_HEADERS or (h.startswith(TRUSTED_PREFIX) and h not in VERDICT)
        ]
        mutation = ep.HeaderMutation(
            set_headers=[_raw_header(k, v) for k, v in VERDICT.items()], remove_headers=removed
        )
        response = ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation))
        )
        if self.authenticate:
            response.dynamic_metadata.update({PICKER_NAMESPACE: {PICKER_AUTHENTICATED: True}})
        return response

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
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


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

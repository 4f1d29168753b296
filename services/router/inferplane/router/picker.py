"""The router as Envoy's endpoint picker: `envoy.service.ext_proc.v3.ExternalProcessor`.

Data path (docs/architecture.md): Envoy relays every token; the router decides once per
request where it goes, following the Gateway API Inference Extension's endpoint-picker
protocol, and learns from the response trailers how it ended. One ext_proc stream is one HTTP
request; with the edge's processing mode (request headers SEND, request body BUFFERED,
response headers SEND, response trailers SEND, everything else SKIP/NONE) it carries:

1. `request_headers` (`:path` is the transcoded gRPC path; ext_authz's `x-inferplane-*`
   headers) → an empty `HeadersResponse`, or an immediate 404 for a path that is no
   generation method (or 400 when the request has no body).
2. `request_body` (the whole gRPC-framed request) → the routing decision (route and
   aliases, the key's allow-list, features, admission with its queue, policy, breakers),
   answered as `dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]
   = "primary,fallback,..."` plus `x-envoy-max-retries: len(list)-1` (Envoy's retries walk
   down the list and never beyond it, as measured on Envoy 1.40), or as an `ImmediateResponse`
   in OpenAI's error shape (`immediate_response`). While the request waits in the admission
   queue, one `override_message_timeout` keeps Envoy from timing the message out.
3. `response_headers` and `response_trailers` → the `ResponseSummary` keys removed (no client
   sees internal topology); their `grpc-status`, OpenAI error code and summary are recorded.
   The endpoint that served is the one the summary's replica id names (or Envoy's `-served`
   metadata, when a gateway writes it).
4. The stream's end (or the trailers, or a trailers-only response) → exactly once: the slot
   released, breakers fed, one usage report (keyed requests), one telemetry record.

The picker never raises out of `Process`: a malformed message is answered with an immediate
400 (or 500 for a bug) in OpenAI's shape and logged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.api import httpbody_pb2
from google.protobuf import duration_pb2, json_format
from google.protobuf.message import DecodeError, Message

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.edge import PICK_KEY, PICK_NAMESPACE, SERVED_KEY
from inferplane.router.admission import Admission, Lease
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.metrics import RouterMetrics
from inferplane.router.records import RequestTrace
from inferplane.router.reporting import Reporter
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable, resolve
from inferplane.router.schemas import SchemaCheck
from inferplane.router.usage import UsageRecord
from inferplane.runtime import (
    OPENAI_ERROR_CODE_KEY,
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    error_trailers,
)
from inferplane.wire import (
    PICKER_KEY,
    REPLICA_KEY,
    SUMMARY_KEYS,
    FormError,
    ResponseSummary,
    error_body,
    read_form,
)
from inferplane.wire.headers import KEY_ID as KEY_ID_HEADER

log = structlog.get_logger("inferplane.router.picker")

# How many concluded request ids the picker remembers (a replica's report lands within seconds
# of the request's end; a few minutes of traffic at 1,000 requests/s, ~10 MB).
_CONCLUDED_MEMORY = 200_000

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_RETRIES_HEADER = "x-envoy-max-retries"
_GRPC_FRAME_HEADER = 5  # compressed flag (1 byte) + message length (4 bytes, big-endian)
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

Context = Any  # grpc.aio.ServicerContext
Extract = Callable[[Any, Mapping[str, str]], RequestFeatures]


@dataclasses.dataclass(frozen=True, slots=True)
class PickerSettings:
    """Knobs of the endpoint picker (see `RouterSettings.picker_*`).

    Attributes:
        fallbacks: endpoints listed after the primary (Envoy tries them, in order, when the
            primary fails before its first response byte); 0 = the primary only.
        keepalive_seconds: how long a request may wait in the admission queue before the
            picker extends Envoy's ext_proc message timer; must stay below the edge's
            `message_timeout` (1 s).
        timeout_margin_seconds: added to the longest remaining queue wait in that extension;
            the edge's `max_message_timeout` must be at least queue timeout + this margin
            (Envoy ignores a larger extension).
        outcome_address: `host:port` of this router's `inferplane.router.v1.OutcomeService`,
            sent to the replica with every pick (`x-inferplane-picker`) so that it reports how
            the request ended; "" = no report asked for (the trailers only).
        outcome_wait_seconds: how long a request whose response started but whose trailers
            never reached the picker (its client closed the connection right after
            `data: [DONE]`) waits for the replica's report before it is recorded as aborted.
        usage_wait_seconds: how long the picker holds the response's end (its answer to the
            trailers) until auth has the request's usage report, so that a client reading to
            the end of a response can send its next request at once without finding its
            concurrency slot still taken or its tokens not yet counted; must stay below the
            edge's `message_timeout` (1 s). Auth unreachable costs each response this much.
    """

    fallbacks: int = 2
    keepalive_seconds: float = 0.25
    timeout_margin_seconds: float = 1.0
    outcome_address: str = ""
    outcome_wait_seconds: float = 5.0
    usage_wait_seconds: float = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class _Method:
    """A generation method of InferenceService as the transcoder names it in `:path`."""

    request_type: type[Message]
    stream: bool
    chat: bool
    embedding: bool = False
    speech: bool = False


_PREFIX = "/inferplane.inference.v1.InferenceService/"
METHODS: Mapping[str, _Method] = {
    _PREFIX + "CreateChatCompletion": _Method(pb.CreateChatCompletionRequest, False, True),
    _PREFIX + "StreamChatCompletion": _Method(pb.StreamChatCompletionRequest, True, True),
    _PREFIX + "StreamChatCompletionEvents": _Method(
        pb.StreamChatCompletionEventsRequest, True, True
    ),
    _PREFIX + "CreateCompletion": _Method(pb.CreateCompletionRequest, False, False),
    _PREFIX + "StreamCompletion": _Method(pb.StreamCompletionRequest, True, False),
    _PREFIX + "StreamCompletionEvents": _Method(pb.StreamCompletionEventsRequest, True, False),
    _PREFIX + "CreateEmbedding": _Method(pb.CreateEmbeddingRequest, False, False, embedding=True),
    _PREFIX + "CreateTranscription": _Method(
        pb.CreateTranscriptionRequest, False, False, speech=True
    ),
    _PREFIX + "CreateTranslation": _Method(pb.CreateTranslationRequest, False, False, speech=True),
}
"""`:path` → method, for every path the picker decides on (ListModels never comes here)."""

#: Gateway mode (a conformant gateway's proxy sends the client's own request): the OpenAI
#: path → (the method without streaming, the method with `"stream": true`), the same pair the
#: edge's stream router and transcoder choose between (`inferplane.edge`).
GATEWAY_METHODS: Mapping[str, tuple[_Method, _Method]] = {
    "/v1/chat/completions": (
        METHODS[_PREFIX + "CreateChatCompletion"],
        METHODS[_PREFIX + "StreamChatCompletionEvents"],
    ),
    "/v1/completions": (
        METHODS[_PREFIX + "CreateCompletion"],
        METHODS[_PREFIX + "StreamCompletionEvents"],
    ),
    "/v1/embeddings": (METHODS[_PREFIX + "CreateEmbedding"],) * 2,
}
#: The endpoint-picker protocol's request header naming the pick (beside `envoy.lb` metadata).
DESTINATION_HEADER = PICK_KEY
#: Where a gateway sends the pool's endpoints the pick must come from
#: (`docs/proposals/004-endpoint-picker-protocol`, "Endpoint Subset").
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: The replica process the node-local Envoy forwards to (its ORIGINAL_DST header).
REPLICA_ADDRESS_HEADER = "x-inferplane-replica-address"
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# Envoy's ext_proc takes body chunks of any size; the GIE reference picker answers in chunks
# under 64 KiB, which every gRPC default message size accepts.
_BODY_CHUNK = 62_000


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayMode:
    """How the picker answers a conformant gateway (Gateway API Inference Extension) instead
    of inferplane's edge.

    The gateway's proxy sends the client's request as it came (`/v1/...` and OpenAI's JSON,
    buffered or FULL_DUPLEX_STREAMED) after its own ext_authz call to auth; the pick names
    the node-local Envoy of the chosen replica's node (`<replica host>:node_port`, an endpoint
    of the InferencePool) in `x-gateway-destination-endpoint` and `envoy.lb` metadata, and the
    replica process in `x-inferplane-replica-address` for that Envoy's ORIGINAL_DST cluster.

    Attributes:
        node_port: TCP port of the node-local Envoy on every node (the pool's `targetPorts`).
    """

    node_port: int

    def destination(self, replica_address: str) -> str:
        """`<host of replica_address>:node_port` (an IPv6 host keeps its brackets)."""
        host = replica_address.rpartition(":")[0]
        return f"{host}:{self.node_port}"


# Envoy's gRPC → HTTP mapping (Grpc::Utility::grpcToHttpStatus), as the edge's error shaper.
_HTTP_STATUS: Mapping[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def immediate_response(error: InferplaneError) -> ext_pb.ProcessingResponse:
    """The refusal Envoy answers the client with instead of forwarding the request.

    HTTP status from the error's gRPC code (Envoy's mapping: 403, 404, 429, 503...), the gRPC
    status for gRPC clients, OpenAI's body `{"error": {"message", "type", "param", "code"}}`
    with `content-type: application/json`, the `x-openai-error-*` headers and `retry-after`
    exactly as the gRPC servicers' trailers (`inferplane.runtime.error_trailers`), and
    `details = "picker_<code>"`, which the edge's local-reply mappers pass through unchanged.
    """
    headers = ext_pb.HeaderMutation()
    _set(headers, "content-type", "application/json")
    for key, value in error_trailers(error):
        if isinstance(value, str):  # grpc-status-details-bin is for gRPC servers only
            _set(headers, key, value)
    body = error_body(error.message, error.openai_type, error.code, error.param)
    return ext_pb.ProcessingResponse(
        immediate_response=ext_pb.ImmediateResponse(
            status={"code": _HTTP_STATUS.get(error.status, 500)},
            headers=headers,
            body=json.dumps(body).encode(),
            grpc_status=ext_pb.GrpcStatus(status=error.status.value[0]),
            details=f"picker_{error.code}",
        )
    )


def pick_response(addresses: Sequence[str], outcome_address: str = "") -> ext_pb.ProcessingResponse:
    """The answer to the request body: the ordered endpoint list (primary first) in the
    `envoy.lb` namespace that the `override_host` policy reads, `x-envoy-max-retries`
    capping Envoy's retries at the list (beyond it the fallback policy would pick any host),
    and, with `outcome_address`, `x-inferplane-picker` telling the replica where to report."""
    response = ext_pb.ProcessingResponse()
    mutation = response.request_body.response.header_mutation
    _set(mutation, MAX_RETRIES_HEADER, str(len(addresses) - 1))
    if outcome_address:
        _set(mutation, PICKER_KEY, outcome_address)
    lb = response.dynamic_metadata.fields[PICK_NAMESPACE].struct_value
    lb.fields[PICK_KEY].string_value = ",".join(addresses)
    return response


def gateway_pick_response(
    destination: str, replica: str, outcome_address: str = "", *, phase: str = "request_body"
) -> ext_pb.ProcessingResponse:
    """The pick as the endpoint-picker protocol asks for it, answering `phase`
    (`request_body` when the gateway buffers the body, `request_headers` in
    FULL_DUPLEX_STREAMED, where the headers wait for the body's end): `destination` (the node
    Envoy, `ip:port`) in both the `x-gateway-destination-endpoint` header and the `envoy.lb`
    metadata (one value: the replica header below is wrong on any other node, so no
    fallbacks), the replica process in `x-inferplane-replica-address` (`host:port`), and
    `x-inferplane-picker` as for the edge."""
    response = ext_pb.ProcessingResponse()
    mutation = getattr(response, phase).response.header_mutation
    _set(mutation, DESTINATION_HEADER, destination)
    _set(mutation, REPLICA_ADDRESS_HEADER, replica)
    if outcome_address:
        _set(mutation, PICKER_KEY, outcome_address)
    lb = response.dynamic_metadata.fields[PICK_NAMESPACE].struct_value
    lb.fields[PICK_KEY].string_value = destination
    return response


def parse_json_request(body: bytes) -> dict[str, Any]:
    """An OpenAI JSON request body as a dict (the gateway sends the client's bytes).

    Raises:
        InvalidArgumentError: not UTF-8 JSON holding an object (HTTP 400).
    """
    try:
        value = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError included
        raise InvalidArgumentError(
            f"Could not parse the request body: {exc}", code="invalid_request_body"
        ) from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            "The request body must be a JSON object.", code="invalid_request_body"
        )
    return value


def typed_request(body: Mapping[str, Any], method: _Method) -> Any:
    """The typed request of a parsed OpenAI body, by the proto3 JSON mapping the edge's
    transcoder applies (`body: "request"`): `method.request_type` with the body as `request`.
    Unknown keys are skipped here; the node-local Envoy's field guard answers them (400 naming
    the key, as on the edge).

    Raises:
        InvalidArgumentError: a field of the wrong type or value (HTTP 400).
    """
    wrapper: Any = method.request_type()
    try:
        json_format.ParseDict(dict(body), wrapper.request, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise InvalidArgumentError(
            f"Could not parse the request body: {exc}", code="invalid_request_body"
        ) from None
    return wrapper


def _subset(message: ext_pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's endpoint subset (`envoy.lb.subset_hint`), None when it sent none."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values)
    return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())


def decode_body(body: bytes, request_type: type[Message]) -> Any:
    """The typed request of a gRPC-framed unary body (1 flag byte, 4-byte big-endian length,
    the message).

    Raises:
        InvalidArgumentError: not exactly one uncompressed, parseable message (HTTP 400).
    """
    if len(body) < _GRPC_FRAME_HEADER:
        raise InvalidArgumentError("the request body is empty or truncated", code="invalid_body")
    if body[0] != 0:
        raise InvalidArgumentError("compressed requests are not supported", code="invalid_body")
    length = int.from_bytes(body[1:_GRPC_FRAME_HEADER], "big")
    if len(body) != _GRPC_FRAME_HEADER + length:
        raise InvalidArgumentError("the request body is not one message", code="invalid_body")
    try:
        return request_type.FromString(body[_GRPC_FRAME_HEADER:])
    except DecodeError:
        raise InvalidArgumentError(
            "the request body cannot be parsed", code="invalid_body"
        ) from None


_MODEL_ONLY = frozenset({"model"})


def form_model(body: httpbody_pb2.HttpBody) -> str:
    """The `model` field of an audio request's multipart/form-data body (the client's bytes,
    passed through by the edge as the request's HttpBody). File parts are measured, not copied
    (`read_form(keep_files=False)`); the replica checks the file itself.

    Raises:
        InvalidArgumentError: not a readable form, or no `model` field (HTTP 400, param as
            OpenAI's: `model`, or None for the body).
    """
    try:
        form = read_form(
            body.content_type,
            body.data,
            max_file_bytes=len(body.data),
            keep_files=False,
            only=_MODEL_ONLY,
        )
    except FormError as exc:
        raise InvalidArgumentError(str(exc), param=exc.param, code="invalid_body") from None
    model = form.get("model")
    if not model:
        raise InvalidArgumentError(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    return model


def _set(mutation: ext_pb.HeaderMutation, key: str, value: str) -> None:
    mutation.set_headers.add(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _headers(header_map: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-case keys → values; Envoy sends values in `raw_value` (bytes)."""
    return {
        h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in header_map.headers
    }


def _summary_removal(headers: Mapping[str, str]) -> ext_pb.HeaderMutation:
    return ext_pb.HeaderMutation(remove_headers=[k for k in SUMMARY_KEYS if k in headers])


def _served(message: ext_pb.ProcessingRequest) -> str:
    lb = message.metadata_context.filter_metadata.get(PICK_NAMESPACE)
    value = lb.fields.get(SERVED_KEY) if lb is not None else None
    return value.string_value if value is not None else ""


def _status_code(status: int) -> str:
    """The record's error code for a gRPC status that came without an OpenAI code."""
    if status == _UNAVAILABLE:
        return "replica_unavailable"  # no replica of the list could be reached
    for code in grpc.StatusCode:
        if code.value[0] == status:
            return str(code.name.lower())
    return "unknown"


class _Reader:
    """The side stream's requests, with at most one read in flight, so that a read can race
    admission (Envoy closing the stream while the request is queued = client gone)."""

    __slots__ = ("_it", "_pending")

    def __init__(self, requests: AsyncIterator[ext_pb.ProcessingRequest]) -> None:
        self._it = aiter(requests)
        self._pending: asyncio.Future[ext_pb.ProcessingRequest | None] | None = None

    async def _read(self) -> ext_pb.ProcessingRequest | None:
        try:
            return await anext(self._it)
        except StopAsyncIteration:
            return None

    def pending(self) -> asyncio.Future[ext_pb.ProcessingRequest | None]:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._read())
        return self._pending

    async def next(self) -> ext_pb.ProcessingRequest | None:
        """The next message; None once Envoy half-closed the stream."""
        pending, self._pending = self._pending, None
        return await (pending if pending is not None else self._read())

    def close(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()


class _ClientGone(Exception):
    """Envoy closed the side stream while the request waited in the queue."""


@dataclasses.dataclass(slots=True)
class _Exchange:
    """One HTTP request as the picker sees it (mutable: filled as its messages arrive)."""

    trace: RequestTrace
    begun: bool = False  # request headers seen (or a refusal): the request gets a record
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    method: _Method | None = None
    admitting: asyncio.Future[Lease] | None = None
    lease: Lease | None = None
    endpoints: tuple[Endpoint, ...] = ()
    picked: float = 0.0
    refused: bool = False
    served: str = ""
    http_status: int | None = None  # :status of the response headers
    grpc_status: int | None = None  # from trailers, or the headers of a trailers-only response
    error_code: str = ""  # x-openai-error-code of the response
    summary: ResponseSummary | None = None
    output_started: bool = False  # the replica's response headers came (it sent output)
    trailers: bool = False  # the response's trailers reached the picker
    reported: ResponseSummary | None = None  # the replica's out-of-band report
    waiting: asyncio.TimerHandle | None = None  # for the report, after the stream ended
    usage_position: int = 0  # the usage report's position in the sink (Reporter.delivered)
    judged: bool = False
    finished: bool = False
    # Gateway mode (`GatewayMode`): the body as it arrives, whether the gateway streams it
    # full-duplex (the headers' answer then waits for the body), the response body likewise,
    # and the endpoint subset it allows (None: the whole pool).
    gateway: GatewayMode | None = None
    chunks: list[bytes] = dataclasses.field(default_factory=list)
    duplex: bool = False
    duplex_response: bool = False
    subset: frozenset[str] | None = None
    path: str = ""


class EndpointPicker(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`envoy.service.ext_proc.v3.ExternalProcessor` as the router's endpoint picker.

    `admission` holds the slots, queues and breakers; `reporter` hands over one usage report
    and one record per request; `metrics` (optional) counts requests a fallback served.
    """

    def __init__(
        self,
        table: Callable[[], RouteTable],
        admission: Admission,
        reporter: Reporter,
        *,
        features: FeatureExtractor | None = None,
        settings: PickerSettings | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._table = table
        self._metrics = metrics
        self._admission = admission
        self._reporter = reporter
        self._features = features or FeatureExtractor()
        self._schemas = SchemaCheck()
        self._settings = settings or PickerSettings()
        self._clock = reporter.clock
        # Picked requests by request id, until concluded: what replicas' reports match.
        self._active: dict[str, _Exchange] = {}
        # Request ids concluded lately (oldest forgotten first): a replica's report of one of
        # them is a copy of what the trailers said; an id in neither map is an orphan.
        self._concluded: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def Process(
        self, request_iterator: AsyncIterator[ext_pb.ProcessingRequest], context: Context
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """One ext_proc stream = one HTTP request (module docstring); ends when Envoy
        half-closes, after an immediate response, or when the call is cancelled."""
        async for response in self.process(request_iterator):
            yield response

    async def process(
        self,
        request_iterator: AsyncIterator[ext_pb.ProcessingRequest],
        gateway: GatewayMode | None = None,
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """`Process` for the edge (`gateway` None) or for a conformant gateway
        (`GatewayProcessor`): one stream, one request, the same decision path."""
        # A placeholder until the request headers arrive (begin() there reads their ids).
        exchange = _Exchange(RequestTrace("", False, 0.0, 0.0), gateway=gateway)
        reader = _Reader(request_iterator)
        try:
            while (message := await reader.next()) is not None:
                if gateway is not None and message.HasField("protocol_config"):
                    config = message.protocol_config
                    exchange.duplex = config.request_body_mode == _FULL_DUPLEX
                    exchange.duplex_response = config.response_body_mode == _FULL_DUPLEX
                served = _served(message)
                if served and gateway is not None:
                    served = _gateway_served(exchange, gateway, served)
                exchange.served = served or exchange.served
                refused = False
                try:
                    async with contextlib.aclosing(
                        self._respond(exchange, message, reader)
                    ) as responses:
                        async for response in responses:
                            refused = response.HasField("immediate_response")
                            yield response
                except _ClientGone:
                    return
                if refused:
                    return  # Envoy ends the request; nothing else comes on this stream
        finally:
            reader.close()
            self._finish(exchange)

    async def _respond(
        self, exchange: _Exchange, message: ext_pb.ProcessingRequest, reader: _Reader
    ) -> AsyncGenerator[ext_pb.ProcessingResponse, None]:
        kind = message.WhichOneof("request")
        request_phase = kind in ("request_headers", "request_body", "request_trailers")
        try:
            if exchange.gateway is not None and request_phase:
                async for response in self._on_gateway_request(exchange, message, reader):
                    yield response
            elif kind == "request_headers":
                yield self._on_request_headers(exchange, message.request_headers)
            elif kind == "request_body":
                async for response in self._on_request_body(exchange, message.request_body, reader):
                    yield response
            elif kind == "response_headers":
                response = self._on_response_headers(exchange, message.response_headers)
                await self._usage_delivered(exchange)  # a trailers-only response ended here
                yield response
            elif kind == "response_trailers":
                response = self._on_response_trailers(exchange, message.response_trailers)
                await self._usage_delivered(exchange)
                yield response
            elif kind == "request_trailers":  # not in the edge's mode; pass through
                yield ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())
            elif kind == "response_body":
                yield _body_answer(message.response_body, "response_body", exchange.duplex_response)
            else:
                raise InvalidArgumentError("an ext_proc message without a request part")
        except InferplaneError as exc:
            yield self._refuse(exchange, exc)
        except (_ClientGone, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("picker_message_failed", kind=kind, request_id=exchange.trace.request_id)
            if request_phase or kind is None:
                yield self._refuse(exchange, InternalError("the endpoint picker failed"))
            elif kind == "response_headers":  # never break a response over our own bug
                yield ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse())
            else:
                yield ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse())

    def _refuse(self, exchange: _Exchange, error: InferplaneError) -> ext_pb.ProcessingResponse:
        if not exchange.begun:  # refused before any request headers (a broken stream)
            exchange.trace, exchange.begun = self._reporter.begin("", False, {}), True
        exchange.refused = True
        exchange.trace.fail(error.code)
        return immediate_response(error)

    # -- request ------------------------------------------------------------------------------

    def _on_request_headers(
        self, exchange: _Exchange, message: ext_pb.HttpHeaders
    ) -> ext_pb.ProcessingResponse:
        headers = _headers(message.headers)
        path = headers.get(":path", "").partition("?")[0]
        trace = self._reporter.begin("", False, headers)
        exchange.trace, exchange.metadata, exchange.begun = trace, headers, True
        method = METHODS.get(path)
        if method is None:
            raise NotFoundError(f"Invalid URL ({path or '/'})", code="unknown_url")
        trace.stream = method.stream
        exchange.method = method
        if message.end_of_stream:  # no body message would follow, so no pick
            raise InvalidArgumentError("the request has no body", code="invalid_body")
        return ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse())

    async def _on_request_body(
        self, exchange: _Exchange, message: ext_pb.HttpBody, reader: _Reader
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        method = exchange.method
        if method is None or exchange.endpoints:
            raise InvalidArgumentError("a request body without request headers")
        decoded = decode_body(message.body, method.request_type)
        async for keepalive in self._decide(exchange, method, decoded, reader):
            yield keepalive
        yield pick_response([e.address for e in exchange.endpoints], self._settings.outcome_address)

    async def _decide(
        self,
        exchange: _Exchange,
        method: _Method,
        decoded: Any,
        reader: _Reader,
        exclude: Callable[[ModelRoute], Sequence[tuple[str, str]]] | None = None,
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """The routing decision on a typed request (edge and gateway alike): route and
        aliases, the key's allow-list, features, admission with its queue (yielding the
        message-timer extension while queued), policy, breakers; sets `exchange.endpoints`
        (primary first; fallbacks unless `exclude` is given, the gateway's case, where
        `exclude(route)` names the replicas outside the gateway's subset)."""
        trace, metadata = exchange.trace, exchange.metadata
        if method.speech:
            trace.model = form_model(decoded.body)
            route = self._route(trace.model, metadata)
            trace.deployment = route.deployment_key
            features = self._features.speech(len(decoded.body.data), metadata)
        else:
            request = decoded.request
            trace.model = request.model
            if method.chat:
                self._schemas.check_chat(request)  # a client's bad schema never takes a slot
            route = self._route(request.model, metadata)
            trace.deployment = route.deployment_key
            extract: Extract = (
                self._features.chat
                if method.chat
                else self._features.embedding
                if method.embedding
                else self._features.completion
            )
            features = extract(request, metadata)
        excluded = exclude(route) if exclude is not None else ()
        async for keepalive in self._admit(exchange, route, features, reader, excluded):
            yield keepalive
        lease = exchange.lease
        assert lease is not None  # _admit either set it or raised
        trace.replica = lease.endpoint.replica_id or lease.endpoint.address
        trace.node = lease.endpoint.node
        fallbacks = (
            self._admission.fallbacks(route, lease, features, self._settings.fallbacks)
            if exclude is None
            else ()
        )
        exchange.endpoints = (lease.endpoint, *fallbacks)
        exchange.picked = self._clock.monotonic()
        if trace.request_id:
            self._active[trace.request_id] = exchange

    # -- gateway mode -------------------------------------------------------------------------

    async def _on_gateway_request(
        self, exchange: _Exchange, message: ext_pb.ProcessingRequest, reader: _Reader
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """A gateway's request phase: headers (checked, answered at once when the body is
        buffered, held in FULL_DUPLEX_STREAMED), body chunks (collected; in duplex mode
        nothing is answered until the end), then at the body's end (or the trailers') the
        decision and the pick, with the body sent back unchanged in duplex mode."""
        kind = message.WhichOneof("request")
        gateway = exchange.gateway
        assert gateway is not None
        if kind == "request_headers":
            self._on_gateway_headers(exchange, message)
            if not exchange.duplex:
                yield ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse())
            return
        if kind == "request_trailers" and exchange.endpoints:
            # Trailers after a body already decided on (BUFFERED with trailers sent).
            yield ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())
            return
        if exchange.method is None or exchange.endpoints:
            raise InvalidArgumentError("a request body without request headers")
        if kind == "request_body":
            exchange.chunks.append(message.request_body.body)
            if exchange.duplex and not message.request_body.end_of_stream:
                return  # more chunks (or the trailers) follow; BUFFERED sends it whole
        body = b"".join(exchange.chunks)
        parsed = parse_json_request(body)
        # Top-level `"stream": true` only, as the edge's json_to_metadata rule (a nested
        # `stream`, or the string "true", asks for no stream).
        method = GATEWAY_METHODS[exchange.path][1 if parsed.get("stream") is True else 0]
        exchange.method, exchange.trace.stream = method, method.stream
        decoded = typed_request(parsed, method)
        subset = exchange.subset

        def outside(route: ModelRoute) -> list[tuple[str, str]]:
            if subset is None:
                return []
            return [e.key for e in route.endpoints if gateway.destination(e.address) not in subset]

        async for keepalive in self._decide(exchange, method, decoded, reader, outside):
            yield keepalive
        replica = exchange.endpoints[0].address
        destination = gateway.destination(replica)
        outcome = self._settings.outcome_address
        if not exchange.duplex:
            yield gateway_pick_response(destination, replica, outcome, phase="request_body")
            return
        yield gateway_pick_response(destination, replica, outcome, phase="request_headers")
        chunks = [body[i : i + _BODY_CHUNK] for i in range(0, len(body), _BODY_CHUNK)] or [b""]
        ends_here = kind == "request_body"
        for i, chunk in enumerate(chunks):
            answer = ext_pb.ProcessingResponse()
            streamed = answer.request_body.response.body_mutation.streamed_response
            streamed.body = chunk
            streamed.end_of_stream = ends_here and i == len(chunks) - 1
            yield answer
        if kind == "request_trailers":
            yield ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())

    def _on_gateway_headers(self, exchange: _Exchange, message: ext_pb.ProcessingRequest) -> None:
        """Checks a gateway's request headers: a path the picker decides on, a body to come,
        and auth's verdict (the gateway's ext_authz towards auth; without it no key was
        checked, so the request is refused rather than served).

        Raises:
            NotFoundError: another path (404 unknown_url).
            UnauthenticatedError: no `x-inferplane-key-id` from auth's Check (401).
            InvalidArgumentError: no body (400).
        """
        headers = _headers(message.request_headers.headers)
        path = headers.get(":path", "").partition("?")[0]
        exchange.trace = self._reporter.begin("", False, headers)
        exchange.metadata, exchange.begun = headers, True
        exchange.subset = _subset(message)
        if path not in GATEWAY_METHODS:
            raise NotFoundError(f"Invalid URL ({path or '/'})", code="unknown_url")
        exchange.path, exchange.method = path, GATEWAY_METHODS[path][0]
        if not headers.get(KEY_ID_HEADER):
            raise UnauthenticatedError(
                "The request carries no verified API key: the gateway must ask inferplane's "
                "auth service (ext_authz Check) before the endpoint picker.",
                code="invalid_api_key",
            )
        if message.request_headers.end_of_stream:
            raise InvalidArgumentError("the request has no body", code="invalid_body")

    def _route(self, model: str, metadata: Mapping[str, str]) -> ModelRoute:
        table = self._table()
        route = resolve(table, model, metadata)
        self._admission.apply(table)  # no-op unless the table changed under us
        return route

    async def _admit(
        self,
        exchange: _Exchange,
        route: ModelRoute,
        features: RequestFeatures,
        reader: _Reader,
        exclude: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """Takes a slot (sets `exchange.lease`), yielding the message-timer extension when
        the request has to queue.

        Envoy honours ONE `override_message_timeout` per message (its ProcessorState keeps a
        `new_timeout_received_` flag, reset per message), so the single extension covers the
        longest remaining wait plus the margin instead of being re-sent periodically.

        Raises:
            ResourceExhaustedError / UnavailableError: from `Admission.acquire` (429 / 503).
            _ClientGone: Envoy closed the stream while the request was queued.
        """
        started = self._clock.monotonic()
        admitting = exchange.admitting = asyncio.ensure_future(
            self._admission.acquire(route, features, exclude=exclude)
        )
        try:
            done, _ = await asyncio.wait((admitting,), timeout=self._settings.keepalive_seconds)
            if not done:
                waited = self._clock.monotonic() - started
                remaining = max(0.0, self._admission.queue_timeout_seconds - waited)
                yield _extend(remaining + self._settings.timeout_margin_seconds)
                await self._wait_or_gone(admitting, reader)
            exchange.lease = admitting.result()
        finally:
            exchange.trace.queue_seconds += self._clock.monotonic() - started

    @staticmethod
    async def _wait_or_gone(admitting: asyncio.Future[Lease], reader: _Reader) -> None:
        incoming = reader.pending()
        await asyncio.wait((admitting, incoming), return_when=asyncio.FIRST_COMPLETED)
        if admitting.done():
            return
        if incoming.cancelled() or incoming.exception() is not None or incoming.result() is None:
            raise _ClientGone()
        # A message before our answer breaks the protocol; keep it for the loop, keep waiting.
        await admitting

    # -- response -----------------------------------------------------------------------------

    def _on_response_headers(
        self, exchange: _Exchange, message: ext_pb.HttpHeaders
    ) -> ext_pb.ProcessingResponse:
        headers = _headers(message.headers)
        status = headers.get(":status", "")
        exchange.http_status = int(status) if status.isdigit() else 0
        # The replica names itself in the headers it sends with its first message.
        exchange.output_started = REPLICA_KEY in headers and not message.end_of_stream
        self._note_outcome(exchange, headers)
        self._judge(exchange)
        if message.end_of_stream:  # trailers-only (an error): nothing else will come
            self._finish(exchange)
        mutation = _summary_removal(headers)
        return ext_pb.ProcessingResponse(
            response_headers=ext_pb.HeadersResponse(
                response=ext_pb.CommonResponse(header_mutation=mutation)
            )
        )

    def _on_response_trailers(
        self, exchange: _Exchange, message: ext_pb.HttpTrailers
    ) -> ext_pb.ProcessingResponse:
        trailers = _headers(message.trailers)
        exchange.trailers = True
        self._note_outcome(exchange, trailers)
        self._finish(exchange)
        return ext_pb.ProcessingResponse(
            response_trailers=ext_pb.TrailersResponse(header_mutation=_summary_removal(trailers))
        )

    @staticmethod
    def _note_outcome(exchange: _Exchange, headers: Mapping[str, str]) -> None:
        status = headers.get("grpc-status")
        if status is not None and status.isdigit():
            exchange.grpc_status = int(status)
        exchange.error_code = headers.get(OPENAI_ERROR_CODE_KEY, exchange.error_code)
        if any(k in headers for k in SUMMARY_KEYS):
            exchange.summary = ResponseSummary.from_metadata(headers)

    # -- the end ------------------------------------------------------------------------------

    def _judge(self, exchange: _Exchange) -> None:
        """Feeds the breakers once a response (or Envoy's reply for the upstream) is known.

        Envoy moves down the list only when an endpoint failed before answering (connect
        failure, refused stream, reset, UNAVAILABLE), so every endpoint before the served one
        failed. The served one failed too when the answer is UNAVAILABLE, or a 5xx without
        any gRPC status (Envoy's own reply for an upstream it could not use); any other answer,
        client errors included, means it is healthy. Without the served endpoint (edge
        without `-served`) the verdict goes to the primary.
        """
        lease = exchange.lease
        if exchange.judged or lease is None or exchange.http_status is None:
            return
        exchange.judged = True
        failed = exchange.grpc_status == _UNAVAILABLE or (
            exchange.grpc_status is None and exchange.http_status >= 500
        )
        addresses = [e.address for e in exchange.endpoints]
        served = _served_address(exchange) or lease.endpoint.address
        before = addresses[: addresses.index(served)] if served in addresses else addresses
        if before and self._metrics is not None:
            self._metrics.fallbacks_served.inc()
        for address in before:
            self._verdict(exchange, lease, address, ok=False)
        self._verdict(exchange, lease, served, ok=not failed)

    def _verdict(self, exchange: _Exchange, lease: Lease, address: str, *, ok: bool) -> None:
        if address != lease.endpoint.address:
            self._admission.observe(exchange.trace.deployment, address, ok=ok)
        elif ok:
            lease.first_chunk()
        else:
            lease.failed()

    def _finish(self, exchange: _Exchange) -> None:
        """Exactly once per stream: release the slot and feed the breakers at once, then
        classify the outcome into the trace and report it (usage + record) — at once, or,
        when the response started but neither its trailers nor the replica's report arrived
        yet, once the report comes (`report_outcomes`) or `outcome_wait_seconds` passed."""
        if exchange.finished or not exchange.begun:
            return  # already done, or a stream that never carried a request
        exchange.finished = True
        try:
            self._judge(exchange)
            self._release(exchange)
        finally:
            if (
                exchange.output_started
                and not exchange.trailers
                and exchange.reported is None
                and self._settings.outcome_address
                and exchange.trace.request_id in self._active
            ):
                exchange.waiting = asyncio.get_running_loop().call_later(
                    self._settings.outcome_wait_seconds, self._report, exchange
                )
            else:
                self._report(exchange)

    def report_outcomes(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """Replicas' reports of how requests they served ended (`OutcomeService`): each
        (request id, summary) concludes the request it names if its stream already ended
        without trailers, or is kept for when it ends. Ids this router concluded lately are
        ignored. Any other id is a request picked by this address before it restarted (its
        state died with the process): its usage is reported from the summary's key and model,
        so a router crash loses no tokens (auth drops a copy by request id if the previous
        process had reported it). Returns how many matched a request in flight."""
        return self._report_outcomes(outcomes)[0]

    async def report_outcomes_settled(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """`report_outcomes`, then waits (at most `usage_wait_seconds`) until auth has the
        usage reports they concluded, so that the replica's report is acknowledged only once
        nothing of it lives in this process's memory alone: a router killed in between is
        not acknowledged, the replica sends the report again, and the restarted router
        accounts it (auth keeps one row per request id)."""
        matched, positions = self._report_outcomes(outcomes)
        if positions and not await self._reporter.delivered(
            max(positions), self._settings.usage_wait_seconds
        ):
            log.warning("outcome_usage_late", reports=len(positions))
        return matched

    def _report_outcomes(
        self, outcomes: Sequence[tuple[str, ResponseSummary]]
    ) -> tuple[int, list[int]]:
        matched, positions = 0, []
        for request_id, summary in outcomes:
            exchange = self._active.get(request_id)
            if exchange is None:
                if request_id not in self._concluded and summary.key_id:
                    positions.append(self._account_orphan(request_id, summary))
                continue
            matched += 1
            exchange.reported = summary
            if exchange.waiting is not None:
                exchange.waiting.cancel()
                self._report(exchange)
                positions.append(exchange.usage_position)
        return matched, [p for p in positions if p]

    def _account_orphan(self, request_id: str, summary: ResponseSummary) -> int:
        self._concluded[request_id] = None
        position = self._reporter.usage.record(
            UsageRecord(
                key_id=summary.key_id,
                request_id=request_id,
                model=summary.model,
                prompt_tokens=summary.prompt_tokens,
                completion_tokens=summary.completion_tokens,
                ok=not summary.error_code and summary.finish_reason not in ("error", "abort"),
            )
        )
        if self._metrics is not None:
            self._metrics.orphan_outcomes.inc()
        log.info("orphan_outcome_accounted", request_id=request_id, key_id=summary.key_id)
        return position

    def _report(self, exchange: _Exchange) -> None:
        """Concludes the request and hands its trace over (usage + record), exactly once."""
        if self._active.get(exchange.trace.request_id) is exchange:
            del self._active[exchange.trace.request_id]
        if exchange.trace.request_id:
            self._concluded[exchange.trace.request_id] = None
            if len(self._concluded) > _CONCLUDED_MEMORY:
                self._concluded.popitem(last=False)
        exchange.waiting = None
        try:
            if not exchange.refused:
                self._conclude(exchange)
        finally:
            log.debug(
                "request_finished",
                request_id=exchange.trace.request_id,
                http_status=exchange.http_status,
                grpc_status=exchange.grpc_status,
                trailers=exchange.trailers,
                reported=exchange.reported is not None,
                finish_reason=exchange.trace.finish_reason,
            )
            exchange.usage_position = self._reporter.finish(exchange.trace, exchange.metadata)

    async def _usage_delivered(self, exchange: _Exchange) -> None:
        """Holds the response's end until auth has the request's usage report (bounded by
        `usage_wait_seconds`; see `PickerSettings`)."""
        position, exchange.usage_position = exchange.usage_position, 0
        if position and not await self._reporter.delivered(
            position, self._settings.usage_wait_seconds
        ):
            log.warning("usage_report_late", request_id=exchange.trace.request_id)

    @staticmethod
    def _release(exchange: _Exchange) -> None:
        admitting = exchange.admitting
        if exchange.lease is None and admitting is not None:
            if not admitting.done():
                admitting.cancel()  # Admission.acquire gives back a slot granted meanwhile
            elif not admitting.cancelled() and admitting.exception() is None:
                exchange.lease = admitting.result()
        if exchange.lease is not None:
            exchange.lease.release()

    @staticmethod
    def _conclude(exchange: _Exchange) -> None:
        """How the request ended, from what the response said (nothing = client gone)."""
        trace = exchange.trace
        address = _served_address(exchange)
        served = next((e for e in exchange.endpoints if e.address == address), None)
        if served is not None:
            trace.replica, trace.node = served.replica_id or served.address, served.node
        if not exchange.trailers and exchange.reported is not None:
            # The trailers never came (the client closed right after its last event): the
            # replica's report says how the request ended.
            summary = exchange.reported
            trace.on_summary(summary, exchange.picked)
            if summary.finish_reason == "abort":
                trace.cancel()
            elif summary.error_code:
                trace.fail(summary.error_code)
            return
        summary = exchange.summary or ResponseSummary()
        trace.on_summary(summary, exchange.picked)
        status = exchange.grpc_status
        if status is None:
            if exchange.http_status is not None and exchange.http_status >= 400:
                trace.fail(f"upstream_http_{exchange.http_status}")
            else:
                trace.cancel()  # no status at all: the client went away (or a reset)
        elif status != 0:
            trace.fail(exchange.error_code or summary.error_code or _status_code(status))
        elif summary.error_code:
            trace.fail(summary.error_code)  # an SSE stream that ended with an error event


def _gateway_served(exchange: _Exchange, gateway: GatewayMode, served: str) -> str:
    """A gateway's `-served` names the node Envoy (`<host>:node_port`), not the replica: the
    picked replica when it is that Envoy's, else "" (unknown; never a verdict on another)."""
    for endpoint in exchange.endpoints:
        if gateway.destination(endpoint.address) == served:
            return endpoint.address
    return ""


def _served_address(exchange: _Exchange) -> str:
    """The address of the endpoint that answered: Envoy's `-served` metadata when the edge
    writes it, else the endpoint whose replica id the replica's summary names (the edge's
    override_host cannot write it back, see inferplane.edge), else "" (unknown)."""
    if exchange.served:
        return exchange.served
    named = exchange.summary or exchange.reported
    replica_id = named.replica_id if named is not None else ""
    if replica_id:
        for endpoint in exchange.endpoints:
            if endpoint.replica_id == replica_id:
                return endpoint.address
    return ""


def _body_answer(message: ext_pb.HttpBody, phase: str, duplex: bool) -> ext_pb.ProcessingResponse:
    """A body chunk passed on unchanged: an empty answer (Envoy keeps the chunk), or, in
    FULL_DUPLEX_STREAMED, the chunk itself (Envoy forwards only what the processor sends)."""
    response = ext_pb.ProcessingResponse()
    answer = getattr(response, phase)
    answer.SetInParent()
    if duplex:
        streamed = answer.response.body_mutation.streamed_response
        streamed.body = message.body
        streamed.end_of_stream = message.end_of_stream
    return response


def _extend(seconds: float) -> ext_pb.ProcessingResponse:
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(max(seconds, 0.001) * 1e9))
    return ext_pb.ProcessingResponse(override_message_timeout=timeout)


class GatewayProcessor(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`envoy.service.ext_proc.v3.ExternalProcessor` for conformant gateways (the router's
    `gateway_port`): the same `EndpointPicker` (its admission, reports and outcomes) in
    `GatewayMode`."""

    def __init__(self, picker: EndpointPicker, mode: GatewayMode) -> None:
        self._picker = picker
        self._mode = mode

    async def Process(
        self, request_iterator: AsyncIterator[ext_pb.ProcessingRequest], context: Context
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """One gateway request (`EndpointPicker.process` with this mode)."""
        async for response in self._picker.process(request_iterator, self._mode):
            yield response

"""The ext_proc protocol codec: what the picker reads from Envoy's `ProcessingRequest`s and
the `ProcessingResponse`s it writes back (no decision, no state).

Reading: the generation methods by gRPC path (`METHODS`) and by the client's REST path
(`ROUTES`, derived from the methods' `google.api.http` bindings, the same the edge's
transcoder and stream router serve), header maps (`header_map`), the client's body as the
typed request (`decode_request`: JSON by the proto3 JSON mapping, or an audio upload's
multipart bytes as its `HttpBody`), the gRPC frame of a transcoded body (`decode_body`), the
`model` of an audio request's form (`form_model`), the endpoint that served (`served`) and a
gateway's endpoint subset (`subset`) from the stream's filter metadata.

Writing: a refusal in the API's error shape (`immediate_response`), the authenticated
request's headers answer (`authenticated_response`: auth's verdict headers, the key removed,
the picker's mark), the pick for the edge (`pick_response`) and for a gateway
(`gateway_pick_response`), the summary trailers removed from the response
(`summary_removal`), a body chunk passed on (`body_answer`), the message timer extended while
a request queues (`extend`). Header names come from `inferplane.wire.headers`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from google.api import annotations_pb2, httpbody_pb2
from google.protobuf import duration_pb2, json_format
from google.protobuf.message import DecodeError, Message

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.apis import anthropic, responses
from inferplane.runtime import (
    HTTP_STATUS,
    InferplaneError,
    InvalidArgumentError,
    ResourceExhaustedError,
    error_trailers,
)
from inferplane.wire import SUMMARY_KEYS, FormError, apis, error_body, headers, read_form

if TYPE_CHECKING:
    from inferplane.router.keys import Principal

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
#: Where a gateway sends the pool's endpoints the pick must come from (the Gateway API
#: Inference Extension's endpoint-picker protocol, "Endpoint Subset"), under the key
#: `headers.DESTINATION_ENDPOINT_SUBSET`.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
_GRPC_FRAME_HEADER = 5  # compressed flag (1 byte) + message length (4 bytes, big-endian)


@dataclasses.dataclass(frozen=True, slots=True)
class Method:
    """A generation method of InferenceService as the transcoder names it in `:path`: its
    request type, whether it streams, and which features it is decided on (chat, embedding,
    speech; otherwise a completion).

    `to_chat`, for an API whose request is a conversation in another wire format (Anthropic
    Messages, OpenAI Responses), gives the `ChatCompletionRequest` the replica renders from
    it (the same conversion the replica runs), so the picker decides on it as on chat:
    prefix blocks, root, session, schema check. Raises `InvalidArgumentError` for a body the
    API refuses (400 before it takes a slot).

    `api` names the API in the usage ledger and request records (`inferplane.wire.apis`).
    """

    request_type: type[Message]
    stream: bool
    chat: bool
    embedding: bool = False
    speech: bool = False
    to_chat: Callable[[Any], pb.ChatCompletionRequest] | None = None
    api: str = apis.CHAT_COMPLETIONS


_PREFIX = "/inferplane.inference.v1.InferenceService/"
METHODS: Mapping[str, Method] = {
    _PREFIX + "CreateChatCompletion": Method(pb.CreateChatCompletionRequest, False, True),
    _PREFIX + "StreamChatCompletion": Method(pb.StreamChatCompletionRequest, True, True),
    _PREFIX + "StreamChatCompletionEvents": Method(
        pb.StreamChatCompletionEventsRequest, True, True
    ),
    _PREFIX + "CreateCompletion": Method(
        pb.CreateCompletionRequest, False, False, api=apis.COMPLETIONS
    ),
    _PREFIX + "StreamCompletion": Method(
        pb.StreamCompletionRequest, True, False, api=apis.COMPLETIONS
    ),
    _PREFIX + "StreamCompletionEvents": Method(
        pb.StreamCompletionEventsRequest, True, False, api=apis.COMPLETIONS
    ),
    _PREFIX + "CreateEmbedding": Method(
        pb.CreateEmbeddingRequest, False, False, embedding=True, api=apis.EMBEDDINGS
    ),
    _PREFIX + "CreateTranscription": Method(
        pb.CreateTranscriptionRequest, False, False, speech=True, api=apis.TRANSCRIPTIONS
    ),
    _PREFIX + "CreateTranslation": Method(
        pb.CreateTranslationRequest, False, False, speech=True, api=apis.TRANSLATIONS
    ),
    # One RPC for unary and streamed (the body's `stream` says); decided as the chat of its
    # new turn: the stored conversation behind `previous_response_id` is the replica's to
    # load (`inferplane.apis.responses.to_chat`).
    _PREFIX + "CreateResponse": Method(
        rpb.CreateResponseRequest, False, True, to_chat=responses.to_chat, api=apis.RESPONSES
    ),
    # Anthropic Messages: one method for both forms (the body's `stream` says which).
    _PREFIX + "CreateMessage": Method(
        apb.CreateMessageRequest, False, True, to_chat=anthropic.to_chat, api=apis.MESSAGES
    ),
    _PREFIX + "CountMessageTokens": Method(
        apb.CountMessageTokensRequest,
        False,
        True,
        to_chat=anthropic.count_to_chat,
        api=apis.MESSAGES,
    ),
}
"""gRPC `:path` → method, for every method the picker decides on (ListModels never comes
here)."""


def _rest_routes() -> Mapping[str, tuple[Method, Method]]:
    """The client's REST path → (the method without streaming, the method for a top-level
    `"stream": true`), read from InferenceService's `google.api.http` POST bindings: a path
    bound under an internal prefix (`/internal/events/v1/chat/completions`) is the streamed
    variant of the public path it ends with, as the edge's stream router moves it."""
    service = pb.DESCRIPTOR.services_by_name["InferenceService"]
    bound: dict[str, Method] = {}
    for descriptor in service.methods:
        method = METHODS.get(_PREFIX + descriptor.name)
        rule = descriptor.GetOptions().Extensions[annotations_pb2.http]
        if method is not None and rule.post:
            bound[rule.post] = method
    public = [p for p in bound if p.startswith("/v1/")]
    routes: dict[str, tuple[Method, Method]] = {}
    for path in public:
        streamed = [m for p, m in bound.items() if p != path and p.endswith(path)]
        routes[path] = (bound[path], streamed[0] if streamed else bound[path])
    return routes


ROUTES: Mapping[str, tuple[Method, Method]] = _rest_routes()
"""REST path (no query string) → (unary method, streamed method), for every path the picker
decides on: the client's request as the edge and a gateway send it. The two are one method
where the body's `stream` is read by the replica (Messages, Responses) or where nothing
streams (embeddings, audio)."""


# -- reading -----------------------------------------------------------------------------------


def header_map(message: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-case keys → values; Envoy sends values in `raw_value` (bytes, decoded as UTF-8
    with replacement)."""
    return {
        h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in message.headers
    }


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


def parse_json_request(body: bytes) -> dict[str, Any]:
    """A client's JSON request body as a dict.

    Raises:
        InvalidArgumentError: not UTF-8 JSON holding an object (HTTP 400
            `invalid_request_body`, the edge's answer to a body its transcoder cannot parse).
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


def typed_request(body: Mapping[str, Any], method: Method) -> Any:
    """The typed request of a parsed JSON body, by the proto3 JSON mapping the edge's
    transcoder applies (`body: "request"`): `method.request_type` with the body as `request`.
    Unknown keys are skipped here; the edge's field guard (after the picker) answers them
    (400 naming the key).

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


def decode_request(
    methods: tuple[Method, Method], body: bytes, content_type: str
) -> tuple[Method, Any]:
    """The method and typed request of a client's body for a REST path's `methods`
    (`ROUTES`): an audio upload (`Method.speech`) as its `HttpBody` (the bytes and
    `content_type`, as the transcoder passes it on); a JSON body parsed, its top-level
    `"stream": true` (a JSON true only, as the edge's json_to_metadata rule reads it)
    choosing the streamed method.

    Raises:
        InvalidArgumentError: not a JSON object, or a field of the wrong type (400).
    """
    unary, streamed = methods
    if unary.speech:
        wrapper: Any = unary.request_type()
        wrapper.body.CopyFrom(httpbody_pb2.HttpBody(content_type=content_type, data=body))
        return unary, wrapper
    parsed = parse_json_request(body)
    method = streamed if parsed.get("stream") is True else unary
    return method, typed_request(parsed, method)


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


def served(message: ext_pb.ProcessingRequest) -> str:
    """The endpoint that served, as a gateway writes it (`envoy.lb` filter metadata,
    `x-gateway-destination-endpoint-served`); "" when absent."""
    lb = message.metadata_context.filter_metadata.get(headers.PICK_NAMESPACE)
    value = lb.fields.get(headers.DESTINATION_ENDPOINT_SERVED) if lb is not None else None
    return value.string_value if value is not None else ""


def subset(message: ext_pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's endpoint subset (`envoy.lb.subset_hint`, a list or a comma-separated
    string of `host:port`), None when it sent none."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or headers.DESTINATION_ENDPOINT_SUBSET not in hint.fields:
        return None
    value = hint.fields[headers.DESTINATION_ENDPOINT_SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values)
    return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())


# -- writing -----------------------------------------------------------------------------------


def set_header(mutation: ext_pb.HeaderMutation, key: str, value: str) -> None:
    """Adds `key: value` to `mutation` (as `raw_value`, overwriting any earlier value; an
    empty value is kept, not dropped)."""
    mutation.set_headers.add(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        keep_empty_value=True,
    )


def verdict(principal: Principal) -> dict[str, str]:
    """Auth's verdict on a key as the request headers the services behind the edge read
    (`headers.AUTH_VERDICT`, the values ext_authz's Check sets): tenant, key id, scopes and
    allowed models comma-separated (no models = every model), tier."""
    return {
        headers.TENANT: principal.tenant,
        headers.KEY_ID: principal.key_id,
        headers.SCOPES: ",".join(principal.scopes),
        headers.ALLOWED_MODELS: ",".join(principal.allowed_models),
        headers.TIER: principal.tier,
    }


def verdict_mutation(
    mutation: ext_pb.HeaderMutation, granted: Mapping[str, str], request_headers: Iterable[str]
) -> None:
    """Writes `granted` (`verdict`) into `mutation`, overwriting any copy, and removes the
    client's key (`headers.CLIENT_KEY_HEADERS`) and any other `x-inferplane-*` header among
    `request_headers` (forged: only the edge's services set them)."""
    for key, value in granted.items():
        set_header(mutation, key, value)
    mutation.remove_headers.extend(
        h
        for h in request_headers
        if h in headers.CLIENT_KEY_HEADERS
        or (h.startswith(headers.TRUSTED_PREFIX) and h not in granted)
    )


def picker_metadata(response: ext_pb.ProcessingResponse, values: Mapping[str, bool | str]) -> None:
    """Sets `values` under the picker's dynamic-metadata namespace (`headers.PICKER_NAMESPACE`:
    `authenticated`, `model`) on `response`; Envoy merges them into what it already holds."""
    namespace = response.dynamic_metadata.fields[headers.PICKER_NAMESPACE].struct_value
    for key, value in values.items():
        if isinstance(value, bool):
            namespace.fields[key].bool_value = value
        else:
            namespace.fields[key].string_value = value


def authenticated_response(granted: ext_pb.HeaderMutation | None) -> ext_pb.ProcessingResponse:
    """The answer to a request's headers: the verdict's mutation (`verdict_mutation`) and the
    picker's mark (`headers.PICKER_AUTHENTICATED`: true, without which the edge's picker
    guard refuses the request) when `granted`; an empty answer when None."""
    response = ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse())
    if granted is not None:
        response.request_headers.response.header_mutation.CopyFrom(granted)
        picker_metadata(response, {headers.PICKER_AUTHENTICATED: True})
    return response


def immediate_response(
    error: InferplaneError, api: str = apis.CHAT_COMPLETIONS
) -> ext_pb.ProcessingResponse:
    """The refusal Envoy answers the client with instead of forwarding the request.

    HTTP status from the error's gRPC code (Envoy's mapping, `inferplane.runtime.HTTP_STATUS`:
    403, 404, 429, 503...; 500 for a code without one), the gRPC status for gRPC clients,
    OpenAI's body `{"error": {"message", "type", "param", "code"}}` with
    `content-type: application/json`, the `x-openai-error-*` headers and `retry-after`
    exactly as the gRPC servicers' trailers (`inferplane.runtime.error_trailers`), a
    `ResourceExhaustedError`'s `headers` (a key's x-ratelimit-*), and
    `details = "picker_<code>"`, which the edge's local-reply mappers pass through unchanged.
    For `api` Anthropic Messages the body is Anthropic's
    (`{"type": "error", "error": {"type", "message"}}`) and a 503 is Anthropic's 529
    `overloaded_error` (`inferplane.apis.anthropic`).
    """
    mutation = ext_pb.HeaderMutation()
    set_header(mutation, "content-type", "application/json")
    for key, value in error_trailers(error):
        if isinstance(value, str):  # grpc-status-details-bin is for gRPC servers only
            set_header(mutation, key, value)
    if isinstance(error, ResourceExhaustedError):
        for key, value in error.headers:  # a key's x-ratelimit-* (`keylimits`)
            set_header(mutation, key, value)
    status = HTTP_STATUS.get(error.status, 500)
    if api == apis.MESSAGES:
        body = anthropic.error_body(status, error.message)
        status = anthropic.error_status(status)
    else:
        body = error_body(error.message, error.openai_type, error.code, error.param)
    return ext_pb.ProcessingResponse(
        immediate_response=ext_pb.ImmediateResponse(
            status={"code": status},
            headers=mutation,
            body=json.dumps(body).encode(),
            grpc_status=ext_pb.GrpcStatus(status=error.status.value[0]),
            details=f"picker_{error.code}",
        )
    )


def pick_response(
    addresses: Sequence[str], outcome_address: str = "", siblings: str = ""
) -> ext_pb.ProcessingResponse:
    """The answer to the request body: the ordered endpoint list (primary first) in the
    `envoy.lb` namespace that the `override_host` policy reads, `x-envoy-max-retries`
    capping Envoy's retries at the list (beyond it the fallback policy would pick any host),
    with `outcome_address`, `x-inferplane-picker` telling the replica where to report, and
    with `siblings` (`inferplane.wire.siblings`), `x-inferplane-siblings`: where the serving
    replica may move the stream if its engine dies mid-way."""
    response = ext_pb.ProcessingResponse()
    mutation = response.request_body.response.header_mutation
    set_header(mutation, headers.ENVOY_MAX_RETRIES, str(len(addresses) - 1))
    if outcome_address:
        set_header(mutation, headers.PICKER, outcome_address)
    if siblings:
        set_header(mutation, headers.SIBLINGS, siblings)
    lb = response.dynamic_metadata.fields[headers.PICK_NAMESPACE].struct_value
    lb.fields[headers.DESTINATION_ENDPOINT].string_value = ",".join(addresses)
    return response


def adapter_headers(mutation: ext_pb.HeaderMutation, adapter: str, source: str) -> None:
    """The LoRA adapter the replica serves the request with (issue 29): `headers.ADAPTER` and
    `headers.ADAPTER_SOURCE` from the route when it names one, else both removed (a client's
    copies never reach a replica; the headers phase strips `x-inferplane-*` too). Call it
    last on a mutation: a removal of the same header already in it is dropped, so the set
    wins whatever order Envoy applies them in."""
    if adapter:
        ours = (headers.ADAPTER, headers.ADAPTER_SOURCE)
        kept = [h for h in mutation.remove_headers if h not in ours]
        del mutation.remove_headers[:]
        mutation.remove_headers.extend(kept)
        set_header(mutation, headers.ADAPTER, adapter)
        set_header(mutation, headers.ADAPTER_SOURCE, source)
    else:
        mutation.remove_headers.extend((headers.ADAPTER, headers.ADAPTER_SOURCE))


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
    set_header(mutation, headers.DESTINATION_ENDPOINT, destination)
    set_header(mutation, headers.REPLICA_ADDRESS, replica)
    if outcome_address:
        set_header(mutation, headers.PICKER, outcome_address)
    lb = response.dynamic_metadata.fields[headers.PICK_NAMESPACE].struct_value
    lb.fields[headers.DESTINATION_ENDPOINT].string_value = destination
    return response


def summary_removal(seen: Mapping[str, str]) -> ext_pb.HeaderMutation:
    """Removes the `ResponseSummary` keys present in `seen` (no client sees internal
    topology or the replica's accounting)."""
    return ext_pb.HeaderMutation(remove_headers=[k for k in SUMMARY_KEYS if k in seen])


def body_answer(message: ext_pb.HttpBody, phase: str, duplex: bool) -> ext_pb.ProcessingResponse:
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


def extend(seconds: float) -> ext_pb.ProcessingResponse:
    """Extends Envoy's message timer to `seconds` (at least 1 ms) while a request queues."""
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(max(seconds, 0.001) * 1e9))
    return ext_pb.ProcessingResponse(override_message_timeout=timeout)


def status_code(status: int) -> str:
    """The record's error code for a gRPC status that came without an OpenAI code."""
    if status == UNAVAILABLE:
        return "replica_unavailable"  # no replica of the list could be reached
    for code in grpc.StatusCode:
        if code.value[0] == status:
            return str(code.name.lower())
    return "unknown"


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
"""The numeric gRPC status UNAVAILABLE (14): the endpoint failed."""

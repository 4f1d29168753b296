"""Gateway mode: the picker behind a conformant gateway (Gateway API Inference Extension)
instead of inferplane's edge.

The gateway's proxy sends the client's request as it came (`/v1/...` and OpenAI's JSON,
buffered or FULL_DUPLEX_STREAMED), as the edge does: the picker authenticates its headers
(`EndpointPicker`, with its key table; without one, auth's verdict from the gateway's own
ext_authz call is required), the body is parsed by the same decoder (`codec.decode_request`,
`codec.ROUTES`), decided by the same `Director` restricted to the gateway's endpoint subset,
and the pick names the node-local Envoy of the chosen replica's node
(`GatewayMode.destination`) and the replica process behind it, with auth's verdict headers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from inferplane.router.picker import codec
from inferplane.router.picker.codec import ROUTES, Method
from inferplane.router.picker.director import Outside
from inferplane.router.picker.state import Exchange
from inferplane.router.replicas import ReplicaKey
from inferplane.router.routes import ModelRoute
from inferplane.runtime import InvalidArgumentError, NotFoundError, UnauthenticatedError
from inferplane.wire import headers

if TYPE_CHECKING:
    from inferplane.router.picker.server import EndpointPicker

Context = Any  # grpc.aio.ServicerContext
#: The server's decision step for a typed request (`EndpointPicker.decide`): yields Envoy's
#: message-timer extension while the request queues, sets the exchange's pick.
Decide = Callable[[Exchange, Method, Any, Outside], AsyncIterator[ext_pb.ProcessingResponse]]

# Envoy's ext_proc takes body chunks of any size; the GIE reference picker answers in chunks
# under 64 KiB, which every gRPC default message size accepts.
_BODY_CHUNK = 62_000


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayMode:
    """How the picker answers a conformant gateway (Gateway API Inference Extension) instead
    of inferplane's edge.

    The gateway's proxy sends the client's request as it came (`/v1/...` and OpenAI's JSON,
    buffered or FULL_DUPLEX_STREAMED); the picker authenticates it; the pick names
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


def gateway_served(exchange: Exchange, gateway: GatewayMode, served: str) -> str:
    """A gateway's `-served` names the node Envoy (`<host>:node_port`), not the replica: the
    picked replica when it is that Envoy's, else "" (unknown; never a verdict on another)."""
    for endpoint in exchange.pick.endpoints:
        if gateway.destination(endpoint.address) == served:
            return endpoint.address
    return ""


def gateway_headers(
    exchange: Exchange, message: ext_pb.ProcessingRequest, *, authenticated: bool
) -> None:
    """Checks a gateway's request headers (the trace is opened and the key authenticated by
    the caller): a path the picker decides on, a body to come, and, when the picker has no
    key table (`authenticated` false), auth's verdict from the gateway's own ext_authz call
    (without it no key was checked, so the request is refused rather than served).

    Raises:
        NotFoundError: another path (404 unknown_url).
        UnauthenticatedError: not `authenticated` and no `x-inferplane-key-id` (401).
        InvalidArgumentError: no body (400).
    """
    request = exchange.request
    path = request.path
    request.subset = codec.subset(message)
    if path not in ROUTES:
        raise NotFoundError(f"Invalid URL ({path or '/'})", code="unknown_url")
    request.method = ROUTES[path][0]
    if not authenticated and not request.metadata.get(headers.KEY_ID):
        raise UnauthenticatedError(
            "The request carries no verified API key: the gateway must ask inferplane's "
            "auth service (ext_authz Check) before the endpoint picker.",
            code="invalid_api_key",
        )
    if message.request_headers.end_of_stream:
        raise InvalidArgumentError("the request has no body", code="invalid_body")


async def gateway_request(
    exchange: Exchange,
    message: ext_pb.ProcessingRequest,
    decide: Decide,
    outcome_address: str,
) -> AsyncIterator[ext_pb.ProcessingResponse]:
    """A gateway's request body or trailers (after `gateway_headers`): body chunks collected
    (in FULL_DUPLEX_STREAMED nothing is answered until the end), then at the body's end (or
    the trailers') the decision (`decide`) and the pick, with the body sent back unchanged in
    duplex mode.

    Raises:
        InvalidArgumentError: a body without request headers, or not a JSON object with
            fields of the right types (400).
    """
    kind = message.WhichOneof("request")
    gateway, request = exchange.gateway, exchange.request
    assert gateway is not None
    if kind == "request_trailers" and exchange.pick.endpoints:
        # Trailers after a body already decided on (BUFFERED with trailers sent).
        yield ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())
        return
    if request.method is None or exchange.pick.endpoints:
        raise InvalidArgumentError("a request body without request headers")
    if kind == "request_body":
        request.chunks.append(message.request_body.body)
        if request.duplex and not message.request_body.end_of_stream:
            return  # more chunks (or the trailers) follow; BUFFERED sends it whole
    body = b"".join(request.chunks)
    content_type = request.metadata.get("content-type", "")
    method, decoded = codec.decode_request(ROUTES[request.path], body, content_type)
    request.method, exchange.trace.stream = method, method.stream
    exchange.trace.api = method.api
    subset = request.subset

    def outside(route: ModelRoute) -> list[ReplicaKey]:
        if subset is None:
            return []
        return [e.key for e in route.endpoints if gateway.destination(e.address) not in subset]

    async for keepalive in decide(exchange, method, decoded, outside):
        yield keepalive
    replica = exchange.pick.endpoints[0].address
    destination = gateway.destination(replica)
    if not request.duplex:
        picked = codec.gateway_pick_response(
            destination, replica, outcome_address, phase="request_body"
        )
        codec.adapter_headers(
            picked.request_body.response.header_mutation,
            exchange.pick.adapter,
            exchange.pick.adapter_source,
        )
        codec.picker_metadata(picked, exchange.pick.labels)
        yield picked
        return
    picked = codec.gateway_pick_response(
        destination, replica, outcome_address, phase="request_headers"
    )
    # In duplex mode the headers were not answered yet: auth's verdict goes with the pick.
    if request.granted is not None:
        picked.request_headers.response.header_mutation.MergeFrom(request.granted)
        exchange.pick.labels[headers.PICKER_AUTHENTICATED] = True
    codec.adapter_headers(
        picked.request_headers.response.header_mutation,
        exchange.pick.adapter,
        exchange.pick.adapter_source,
    )
    codec.picker_metadata(picked, exchange.pick.labels)
    yield picked
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

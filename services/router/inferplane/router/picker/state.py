"""Per-request state of the endpoint picker: one `Exchange` per ext_proc stream (one HTTP
request), in four parts filled as its messages arrive, and the one `Phase` it is in.

Modelled on the Gateway API Inference Extension's endpoint picker (`RequestContext` and its
`StreamRequestState`): the request as it came (`RequestPart`), the decision on it (`PickPart`),
the response as Envoy relayed it (`ResponsePart`), and the exactly-once end (`ConclusionPart`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb

from inferplane.router.admission import Slot
from inferplane.router.keylimits import UNLIMITED, KeyLease
from inferplane.router.picker.codec import Method
from inferplane.router.picker.director import Decision
from inferplane.router.records import RequestTrace
from inferplane.router.routes import Endpoint
from inferplane.wire import ResponseSummary

if TYPE_CHECKING:
    from inferplane.router.picker.gateway import GatewayMode


class Phase(enum.Enum):
    """Where one request's stream is. It moves forward only:

    RECEIVED → REQUEST_HEADERS_DONE → BODY_DONE → RESPONSE_HEADERS_DONE or RESPONSE_STARTED
    → RESPONSE_DONE → ENDED → CONCLUDED, skipping phases when messages never come (a stream
    that ends at any phase goes to ENDED), or → REFUSED (an immediate response: nothing else
    comes) → ENDED → CONCLUDED.
    """

    RECEIVED = "received"
    """The stream is open; no request headers yet (a stream that ends here carried no
    request: no record)."""
    REQUEST_HEADERS_DONE = "request_headers_done"
    """The request headers were read: the request has its trace and will get a record."""
    BODY_DONE = "body_done"
    """The body was decided on: a slot is held and the endpoints are picked."""
    RESPONSE_HEADERS_DONE = "response_headers_done"
    """Response headers came that are not a replica's output (Envoy's own reply, or a
    trailers-only error); the breakers have their verdict."""
    RESPONSE_STARTED = "response_started"
    """The serving replica's response headers came (it names itself in them): output streams
    to the client; the breakers have their verdict."""
    RESPONSE_DONE = "response_done"
    """The response's trailers reached the picker."""
    REFUSED = "refused"
    """The picker answered with an immediate response (a refusal): Envoy ends the request."""
    ENDED = "ended"
    """The stream ended: the slot is released; the request is concluded at once or, when
    the response started without trailers, once the replica's report comes or its wait ran
    out."""
    CONCLUDED = "concluded"
    """The request was concluded (exactly once): its usage is in the outbox, its record
    handed to telemetry."""


@dataclasses.dataclass(slots=True)
class RequestPart:
    """The request as it came.

    Attributes:
        trace: what the router reports of it (a placeholder until the headers arrive).
        metadata: the request headers, lower-case keys (auth's verdict, ids).
        method: the generation method, once known (gateway mode: once the body says whether
            it streams).
        path: the client's REST path, without its query string.
        granted: the answer to the headers once the picker authenticated the key: auth's
            verdict headers set, the key and forged trusted headers removed (None: not
            authenticated here, e.g. no key table).
        key: the request's part of its key's limits (`keylimits.KeyLease`: released at the
            request's one end, its tokens accounted when known; `UNLIMITED` when none).
        duplex: a gateway streams the request body FULL_DUPLEX_STREAMED (the headers' answer
            waits for the body's end).
        duplex_response: a gateway streams the response body FULL_DUPLEX_STREAMED.
        chunks: the gateway's body chunks collected so far.
        subset: the endpoints a gateway allows (`host:port` of node Envoys), None = all.
    """

    trace: RequestTrace
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    method: Method | None = None
    path: str = ""
    granted: ext_pb.HeaderMutation | None = None
    key: KeyLease = UNLIMITED
    duplex: bool = False
    duplex_response: bool = False
    chunks: list[bytes] = dataclasses.field(default_factory=list)
    subset: frozenset[str] | None = None


@dataclasses.dataclass(slots=True)
class PickPart:
    """The decision on the request.

    Attributes:
        admitting: the admission in flight (a slot, then the endpoint list), while queued.
        slot: the slot held on the primary (released exactly once, at the end).
        endpoints: primary first, then the fallbacks Envoy may try, in order.
        picked: monotonic seconds when the pick was answered (TTFT counts from here).
        labels: what the picker tells the edge's later filters and access log about the
            decision (`headers.PICKER_NAMESPACE`: the routed model, or `UNKNOWN_MODEL`).
        adapter / adapter_source: the route's LoRA adapter and its folder, sent to the
            replica with the pick (`headers.ADAPTER`, `ADAPTER_SOURCE`); "" for the base.
    """

    admitting: asyncio.Future[Decision] | None = None
    slot: Slot | None = None
    endpoints: tuple[Endpoint, ...] = ()
    picked: float = 0.0
    labels: dict[str, bool | str] = dataclasses.field(default_factory=dict)
    adapter: str = ""
    adapter_source: str = ""


@dataclasses.dataclass(slots=True)
class ResponsePart:
    """The response as Envoy relayed it.

    Attributes:
        served: the address of the endpoint that answered, when Envoy's metadata named it.
        http_status: `:status` of the response headers (0 when unreadable).
        grpc_status: from the trailers, or the headers of a trailers-only response.
        error_code: `x-openai-error-code` of the response.
        summary: the replica's `ResponseSummary` from the headers or trailers.
    """

    served: str = ""
    http_status: int | None = None
    grpc_status: int | None = None
    error_code: str = ""
    summary: ResponseSummary | None = None


@dataclasses.dataclass(slots=True)
class ConclusionPart:
    """The request's end.

    Attributes:
        ended_in: the phase the stream was in when it ended (None until then).
        ended_at: when it ended (the reporter's monotonic seconds; 0 until then).
        reported: the replica's out-of-band report of the summary (`OutcomeService`).
        waiting: the timer that concludes without a report, once the stream ended.
        usage_position: the usage report's position in the outbox (`Reporter.durable`; 0:
            none).
        concluded: resolved with `usage_position` once concluded, for a replica's report that
            came while the stream still ran (created by whoever waits).
    """

    ended_in: Phase | None = None
    ended_at: float = 0.0
    reported: ResponseSummary | None = None
    waiting: asyncio.TimerHandle | None = None
    usage_position: int = 0
    concluded: asyncio.Future[int] | None = None


@dataclasses.dataclass(slots=True)
class Exchange:
    """One HTTP request as the picker sees it (the parts are filled as messages arrive).

    Attributes:
        phase: where its stream is (`Phase`).
        request / pick / response / conclusion: its parts.
        gateway: set when a conformant gateway sent it (gateway mode; `GatewayMode`).
    """

    request: RequestPart
    pick: PickPart = dataclasses.field(default_factory=PickPart)
    response: ResponsePart = dataclasses.field(default_factory=ResponsePart)
    conclusion: ConclusionPart = dataclasses.field(default_factory=ConclusionPart)
    phase: Phase = Phase.RECEIVED
    gateway: GatewayMode | None = None

    @property
    def trace(self) -> RequestTrace:
        """The request's trace (`request.trace`)."""
        return self.request.trace

"""Small hand-written fakes for the router's unit tests (no sleeps: time moves when told)."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import json
from collections.abc import Callable, Mapping

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.breaker import CircuitBreaker
from inferplane.router.policies import default_registry
from inferplane.router.records import ConcludedRequest
from inferplane.router.replicas import ReplicaSet, ReplicaState
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable
from inferplane.testing.clock import FakeClock


@dataclasses.dataclass(order=True)
class _Timer:
    when: float
    seq: int
    callback: Callable[[], None] = dataclasses.field(compare=False)
    cancelled: bool = dataclasses.field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class FakeScheduler:
    """`call_later` against a FakeClock; `advance(s)` moves time and fires what is due."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._timers: list[_Timer] = []
        self._seq = itertools.count()

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self.clock.monotonic() + delay, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    def advance(self, seconds: float) -> None:
        target = self.clock.monotonic() + seconds
        while self._timers and self._timers[0].when <= target:
            timer = heapq.heappop(self._timers)
            self.clock.advance(max(0.0, timer.when - self.clock.monotonic()))
            if not timer.cancelled:
                timer.callback()
        self.clock.advance(target - self.clock.monotonic())


def endpoints(n: int, cap: int = 0, prefix: str = "r") -> tuple[Endpoint, ...]:
    return tuple(
        Endpoint(f"10.0.0.{i}:50054", f"{prefix}{i}", max_concurrency=cap) for i in range(n)
    )


def route(n: int, policy: str = "least_load", cap: int = 0, model: str = "m") -> ModelRoute:
    return ModelRoute(
        model=model, endpoints=endpoints(n, cap), deployment="d", routing_policy=policy
    )


def replica_set(eps: tuple[Endpoint, ...], cap: int = 1 << 20) -> ReplicaSet:
    states = [ReplicaState(e.key, CircuitBreaker()) for e in eps]
    s = ReplicaSet("d", eps, states, cap, 0.0)
    s.attach()
    return s


def set_load(s: ReplicaSet, i: int, in_flight: int) -> None:
    s.states[i].in_flight = in_flight
    s.states[i].changed(0.0)


def admission(
    table: RouteTable, settings: AdmissionSettings | None = None
) -> tuple[Admission, FakeClock, FakeScheduler]:
    clock = FakeClock()
    scheduler = FakeScheduler(clock)
    a = Admission(default_registry(), settings or AdmissionSettings(), clock, scheduler)
    a.apply(table)
    return a, clock, scheduler


# -- the endpoint picker's side of Envoy (ext_proc) -----------------------------------------


def client_body(message: Message) -> bytes:
    """A request's body as a client sends it to the edge (which passes it to the picker as it
    came): the JSON (proto field names) of the wrapper's `request`, with `"stream": true` for
    a streamed (`Stream*EventsRequest`) wrapper; an audio wrapper's form bytes (`body.data`,
    whose content type goes in the request headers)."""
    if "request" not in message.DESCRIPTOR.fields_by_name:
        return bytes(message.body.data)  # type: ignore[attr-defined]
    body = json_format.MessageToDict(message.request, preserving_proto_field_name=True)  # type: ignore[attr-defined]
    if type(message).__name__.endswith("EventsRequest"):
        body["stream"] = True
    return json.dumps(body).encode()


def header_map(headers: Mapping[str, str]) -> base_pb2.HeaderMap:
    """Headers as Envoy 1.40 sends them over ext_proc: values in `raw_value`."""
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def lb_metadata(request: ext_pb.ProcessingRequest, served: str) -> None:
    """Puts `-served` in the request's `metadata_context`, as override_host reports it."""
    lb = request.metadata_context.filter_metadata["envoy.lb"]
    lb.fields["x-gateway-destination-endpoint-served"].string_value = served


class ExtProcStream:
    """One ext_proc `Process` stream driven the way Envoy does for one HTTP request (the
    client's request headers with its REST path, its buffered body, response headers,
    response trailers, half-close), over real gRPC.

    `overrides` collects the `override_message_timeout` messages that came before the answer
    to the body (the answer itself is what `body` returns).
    """

    def __init__(self, stub: ext_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()
        self.overrides: list[float] = []

    async def _exchange(self, request: ext_pb.ProcessingRequest) -> ext_pb.ProcessingResponse:
        await self.call.write(request)
        while True:
            response = await self.call.read()
            assert response is not grpc.aio.EOF, "the picker closed the stream"
            if not response.HasField("override_message_timeout"):
                return response
            self.overrides.append(response.override_message_timeout.ToNanoseconds() / 1e9)

    async def headers(
        self, path: str, metadata: Mapping[str, str] | None = None, *, end_of_stream: bool = False
    ) -> ext_pb.ProcessingResponse:
        headers = {":method": "POST", ":path": path, "content-type": "application/json"}
        return await self._exchange(
            ext_pb.ProcessingRequest(
                request_headers=ext_pb.HttpHeaders(
                    headers=header_map({**headers, **(metadata or {})}),
                    end_of_stream=end_of_stream,
                )
            )
        )

    async def body(self, data: bytes) -> ext_pb.ProcessingResponse:
        return await self._exchange(
            ext_pb.ProcessingRequest(request_body=ext_pb.HttpBody(body=data, end_of_stream=True))
        )

    async def response_headers(
        self, headers: Mapping[str, str], *, served: str = "", end_of_stream: bool = False
    ) -> ext_pb.ProcessingResponse:
        request = ext_pb.ProcessingRequest(
            response_headers=ext_pb.HttpHeaders(
                headers=header_map(headers), end_of_stream=end_of_stream
            )
        )
        if served:
            lb_metadata(request, served)
        return await self._exchange(request)

    async def response_trailers(
        self, trailers: Mapping[str, str], *, served: str = ""
    ) -> ext_pb.ProcessingResponse:
        request = ext_pb.ProcessingRequest(
            response_trailers=ext_pb.HttpTrailers(trailers=header_map(trailers))
        )
        if served:
            lb_metadata(request, served)
        return await self._exchange(request)

    async def close(self) -> None:
        """Envoy's half-close at the end of the request; waits for the picker to end it."""
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK


class RecordingUsage:
    """A `UsageSink` keeping every concluded request."""

    def __init__(self) -> None:
        self.reports: list[ConcludedRequest] = []
        self.durable_count = 0  # reports in the "outbox file": all of them unless `held`
        self.held = False  # hold reports back (the outbox's disk stalls) until `release()`
        self._progress: asyncio.Event | None = None

    def record(self, request: ConcludedRequest) -> int:
        self.reports.append(request)
        if not self.held:
            self.durable_count = len(self.reports)
        return len(self.reports)

    async def durable(self, position: int) -> None:
        while self.durable_count < position:
            self._progress = self._progress or asyncio.Event()
            await self._progress.wait()

    def release(self) -> None:
        self.held, self.durable_count = False, len(self.reports)
        if self._progress is not None:
            self._progress.set()
            self._progress = None

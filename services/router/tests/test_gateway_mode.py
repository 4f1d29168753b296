"""The endpoint picker in gateway mode (`GatewayProcessor`, the router's `gateway_port`) over
real gRPC, driven the way a conformant gateway's Envoy drives an endpoint picker
(Gateway API Inference Extension, docs/proposals/004-endpoint-picker-protocol): the client's
`/v1/...` request and OpenAI JSON body, buffered or FULL_DUPLEX_STREAMED, the subset hint in
`envoy.lb.subset_hint`; the answer in `x-gateway-destination-endpoint` and `envoy.lb`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.router.admission import Admission, AdmissionSettings
from inferplane.router.app import build_app
from inferplane.router.keys import KeyTable
from inferplane.router.picker.codec import SERVICE_NAME as PICKER_SERVICE
from inferplane.router.picker.gateway import GatewayMode, GatewayProcessor
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.policies import default_registry
from inferplane.router.reporting import Reporter
from inferplane.router.routes import ModelRoute, RouteTable
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import StaticRouteSource
from inferplane.runtime import ErrorInterceptor, RunningServer
from inferplane.runtime.processes.ports import free_port
from inferplane.testing.clock import FakeClock

from .fakes import FakeScheduler, RecordingUsage, endpoints, header_map, lb_metadata
from .test_picker_auth import GOOD, _table

pytestmark = pytest.mark.timeout(30)

NODE_PORT = 8000
KEYED = {"x-inferplane-key-id": "k1", "x-request-id": "req-1", "x-inferplane-tenant": "t1"}
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def _chat(stream: bool | None = None, model: str = "m") -> bytes:
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream is not None:
        body["stream"] = stream
    return json.dumps(body).encode()


@dataclasses.dataclass
class Rig:
    stub: ext_grpc.ExternalProcessorStub
    picker: EndpointPicker
    admission: Admission
    records: list[telemetry_pb2.RequestRecord]
    route: ModelRoute

    def in_flight(self) -> int:
        replicas = self.admission.replicas("d")
        assert replicas is not None
        return replicas.total_in_flight


@contextlib.asynccontextmanager
async def gateway_rig(n: int = 3, keys: KeyTable | None = None) -> AsyncIterator[Rig]:
    route = ModelRoute("m", endpoints(n), deployment="d", routing_policy="least_load")
    table = RouteTable.of([route])
    clock = FakeClock()
    control = Admission(default_registry(), AdmissionSettings(), clock, FakeScheduler(clock))
    control.apply(table)
    records: list[telemetry_pb2.RequestRecord] = []
    picker = EndpointPicker(
        lambda: table,
        control,
        Reporter(RecordingUsage(), records.append, clock, wall_clock=lambda: 1.7e9),
        settings=PickerSettings(keepalive_seconds=0.01, outcome_address="10.9.9.9:50052"),
        keys=keys,
    )
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    ext_grpc.add_ExternalProcessorServicer_to_server(
        GatewayProcessor(picker, GatewayMode(NODE_PORT)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Rig(ext_grpc.ExternalProcessorStub(channel), picker, control, records, route)
    finally:
        await server.stop(0)


class GatewayStream:
    """One ext_proc stream as a gateway's Envoy drives it for one request."""

    def __init__(self, stub: ext_grpc.ExternalProcessorStub, mode: int = BUFFERED) -> None:
        self.call = stub.Process()
        self.mode = mode
        self._first = True

    async def send(self, request: ext_pb.ProcessingRequest) -> None:
        if self._first:
            request.protocol_config.request_body_mode = self.mode  # type: ignore[assignment]
            request.protocol_config.response_body_mode = self.mode  # type: ignore[assignment]
            self._first = False
        await self.call.write(request)

    async def read(self) -> ext_pb.ProcessingResponse:
        response = await self.call.read()
        assert response is not grpc.aio.EOF, "the picker closed the stream"
        return response

    async def headers(
        self,
        path: str = "/v1/chat/completions",
        metadata: Mapping[str, str] | None = None,
        *,
        subset: Sequence[str] | None = None,
        end_of_stream: bool = False,
    ) -> None:
        headers = {":method": "POST", ":path": path, "content-type": "application/json"}
        request = ext_pb.ProcessingRequest(
            request_headers=ext_pb.HttpHeaders(
                headers=header_map({**headers, **(KEYED if metadata is None else metadata)}),
                end_of_stream=end_of_stream,
            )
        )
        if subset is not None:
            hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
            hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(list(subset))
        await self.send(request)

    async def body(self, data: bytes, *, end_of_stream: bool = True) -> None:
        await self.send(
            ext_pb.ProcessingRequest(
                request_body=ext_pb.HttpBody(body=data, end_of_stream=end_of_stream)
            )
        )

    async def close(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF


def _set_headers(mutation: ext_pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _destination(response: ext_pb.ProcessingResponse) -> str:
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value
    return lb.fields["x-gateway-destination-endpoint"].string_value


def _error(response: ext_pb.ProcessingResponse) -> tuple[int, dict[str, object]]:
    assert response.HasField("immediate_response"), response
    reply = response.immediate_response
    return reply.status.code, json.loads(reply.body)["error"]


def test_a_buffered_chat_is_picked_onto_the_node_envoy_with_the_replica_header() -> None:
    """Buffered body: headers answered at once; the body's answer names the node Envoy
    (`<replica host>:8000`) in the header AND the metadata (one value, no fallbacks), the
    replica process for the node Envoy, and where the replica reports; the slot is held."""

    async def scenario() -> None:
        async with gateway_rig(3) as rig:
            stream = GatewayStream(rig.stub)
            await stream.headers()
            assert (await stream.read()).HasField("request_headers")
            await stream.body(_chat())
            answer = await stream.read()
            assert answer.HasField("request_body")
            headers = _set_headers(answer.request_body.response.header_mutation)
            replica = headers["x-inferplane-replica-address"]
            assert replica.startswith("10.0.0.") and replica.endswith(":50054")
            node = replica.rpartition(":")[0] + f":{NODE_PORT}"
            assert headers["x-gateway-destination-endpoint"] == node == _destination(answer)
            assert headers["x-inferplane-picker"] == "10.9.9.9:50052"
            assert rig.in_flight() == 1
            await stream.close()
            assert rig.in_flight() == 0
            assert rig.records[-1].model == "m" and not rig.records[-1].stream

    asyncio.run(scenario())


def test_full_duplex_holds_the_headers_until_the_body_ends_then_echoes_the_body() -> None:
    """FULL_DUPLEX_STREAMED (what the protocol requires pickers to support): chunks are
    collected without answers; at the end come the headers' answer with the pick, then the
    body unchanged with end_of_stream; `"stream": true` is a streaming request; response
    body chunks are echoed back."""

    async def scenario() -> None:
        async with gateway_rig(2) as rig:
            stream = GatewayStream(rig.stub, DUPLEX)
            await stream.headers()
            body = _chat(stream=True)
            await stream.body(body[:10], end_of_stream=False)
            await stream.body(body[10:], end_of_stream=True)
            first = await stream.read()
            assert first.HasField("request_headers")
            headers = _set_headers(first.request_headers.response.header_mutation)
            assert headers["x-gateway-destination-endpoint"] == _destination(first)
            echoed = await stream.read()
            streamed = echoed.request_body.response.body_mutation.streamed_response
            assert streamed.body == body and streamed.end_of_stream
            await stream.send(
                ext_pb.ProcessingRequest(
                    response_headers=ext_pb.HttpHeaders(
                        headers=header_map({":status": "200", "x-inferplane-replica": "r0"})
                    )
                )
            )
            assert (await stream.read()).HasField("response_headers")
            await stream.send(
                ext_pb.ProcessingRequest(
                    response_body=ext_pb.HttpBody(body=b"data: {}\n\n", end_of_stream=True)
                )
            )
            chunk = (await stream.read()).response_body.response.body_mutation.streamed_response
            assert chunk.body == b"data: {}\n\n" and chunk.end_of_stream
            await stream.send(
                ext_pb.ProcessingRequest(
                    response_trailers=ext_pb.HttpTrailers(trailers=header_map({"grpc-status": "0"}))
                )
            )
            assert (await stream.read()).HasField("response_trailers")
            await stream.close()
            assert rig.in_flight() == 0
            assert rig.records[-1].stream and rig.records[-1].replica in ("r0", "r1")

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", [BUFFERED, DUPLEX], ids=["buffered", "duplex"])
def test_with_a_key_table_the_picker_authenticates_a_gateways_request(mode: int) -> None:
    """A gateway without ext_authz: the picker authenticates the client's key itself (a bad
    key: 401 at the headers), and auth's verdict replaces the key on the request it forwards
    (with the headers' answer: at once when buffered, with the pick in duplex mode)."""

    async def scenario() -> None:
        async with gateway_rig(2, keys=_table()) as rig:
            stream = GatewayStream(rig.stub, mode)
            await stream.headers(metadata={"authorization": "Bearer ip-unknown-0123456789"})
            refused = await stream.read()
            assert refused.immediate_response.status.code == 401
            stream = GatewayStream(rig.stub, mode)
            await stream.headers(metadata={"authorization": f"Bearer {GOOD}"})
            if mode == BUFFERED:
                first = await stream.read()
                await stream.body(_chat())
                await stream.read()
            else:
                await stream.body(_chat())
                first = await stream.read()
                await stream.read()  # the body echoed
            mutation = first.request_headers.response.header_mutation
            assert _set_headers(mutation)["x-inferplane-key-id"] == "k-good"
            assert "authorization" in mutation.remove_headers
            mark = first.dynamic_metadata.fields["inferplane.picker"].struct_value
            assert mark.fields["authenticated"].bool_value is True
            await stream.close()
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_a_large_duplex_body_comes_back_whole_in_chunks() -> None:
    async def scenario() -> None:
        async with gateway_rig(1) as rig:
            stream = GatewayStream(rig.stub, DUPLEX)
            await stream.headers()
            content = "x" * 150_000
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
            await stream.body(body.encode())
            assert (await stream.read()).HasField("request_headers")
            parts = []
            while True:
                streamed = (
                    await stream.read()
                ).request_body.response.body_mutation.streamed_response
                parts.append(streamed.body)
                if streamed.end_of_stream:
                    break
            assert len(parts) == 3 and b"".join(parts) == body.encode()
            await stream.close()

    asyncio.run(scenario())


def test_the_subset_hint_limits_the_pick_and_an_empty_intersection_is_a_503() -> None:
    async def scenario() -> None:
        async with gateway_rig(3) as rig:
            stream = GatewayStream(rig.stub)
            await stream.headers(subset=[f"10.0.0.2:{NODE_PORT}"])
            await stream.read()
            await stream.body(_chat())
            assert _destination(await stream.read()) == f"10.0.0.2:{NODE_PORT}"
            await stream.close()

            stream = GatewayStream(rig.stub)
            await stream.headers(subset=[f"10.0.0.7:{NODE_PORT}", f"10.0.0.1:{NODE_PORT + 1}"])
            await stream.read()
            await stream.body(_chat())
            status, error = _error(await stream.read())
            assert status == 503 and error["code"] == "no_ready_replica"
            assert rig.in_flight() == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("metadata", "path", "status", "code"),
    [
        ({"x-request-id": "r"}, "/v1/chat/completions", 401, "invalid_api_key"),
        ({"x-inferplane-key-id": ""}, "/v1/chat/completions", 401, "invalid_api_key"),
        (KEYED, "/v1/models/x", 404, "unknown_url"),
        (KEYED, "/inferplane.inference.v1.InferenceService/CreateChatCompletion", 404, None),
    ],
)
def test_requests_without_auths_verdict_or_on_other_paths_are_refused_at_the_headers(
    metadata: Mapping[str, str], path: str, status: int, code: str | None
) -> None:
    """A gateway that did not ask auth (no `x-inferplane-key-id`) cannot bypass API keys."""

    async def scenario() -> None:
        async with gateway_rig(1) as rig:
            stream = GatewayStream(rig.stub)
            await stream.headers(path, metadata)
            got, error = _error(await stream.read())
            assert got == status and error["code"] == (code or "unknown_url")
            assert set(error) == {"message", "type", "param", "code"}
            assert rig.in_flight() == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_request_body"),
        (b"[1, 2]", "invalid_request_body"),
        (b'{"model": "m", "messages": 5}', "invalid_request_body"),
        (_chat(model="nope"), "model_not_found"),
    ],
)
def test_a_bad_body_is_refused_in_openais_shape_without_a_slot(body: bytes, code: str) -> None:
    async def scenario() -> None:
        async with gateway_rig(1) as rig:
            stream = GatewayStream(rig.stub, DUPLEX)
            await stream.headers()
            await stream.body(body)
            status, error = _error(await stream.read())
            assert error["code"] == code and status in (400, 404)
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_the_router_app_serves_the_gateway_port_beside_the_edges() -> None:
    """`gateway_port` opens a second listener (plaintext here, as the router) with gRPC
    health, answering in gateway mode from the same routing table."""

    async def scenario() -> None:
        route = ModelRoute("m", endpoints(1), deployment="d")
        settings = RouterSettings(
            host="127.0.0.1", port=0, gateway_port=0, plaintext=True, metrics_port=0
        )
        gateway_port = free_port()
        settings = dataclasses.replace(settings, gateway_port=gateway_port)
        app = build_app(
            settings,
            source=StaticRouteSource(RouteTable.of([route])),
            usage=RecordingUsage(),
            registry=CollectorRegistry(),
        )
        server = RunningServer(app, settings)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=PICKER_SERVICE))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                stream = GatewayStream(ext_grpc.ExternalProcessorStub(channel))
                await stream.headers()
                await stream.read()
                await stream.body(_chat())
                assert _destination(await stream.read()) == f"10.0.0.0:{NODE_PORT}"
                await stream.close()
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_trailers_are_answered_whether_they_end_the_body_or_follow_it() -> None:
    """FULL_DUPLEX_STREAMED body ended by trailers: the pick comes at the trailers (headers'
    answer, the body echoed without end_of_stream, the trailers' answer). BUFFERED with
    trailers: the whole body is decided on at once, the trailers then passed on."""

    async def scenario() -> None:
        async with gateway_rig(1) as rig:
            stream = GatewayStream(rig.stub, DUPLEX)
            await stream.headers()
            await stream.body(_chat(), end_of_stream=False)
            await stream.send(ext_pb.ProcessingRequest(request_trailers=ext_pb.HttpTrailers()))
            assert (await stream.read()).HasField("request_headers")
            streamed = (await stream.read()).request_body.response.body_mutation
            assert streamed.streamed_response.body == _chat()
            assert not streamed.streamed_response.end_of_stream
            assert (await stream.read()).HasField("request_trailers")
            await stream.close()

            stream = GatewayStream(rig.stub, BUFFERED)
            await stream.headers()
            await stream.read()
            await stream.body(_chat(), end_of_stream=False)
            assert _destination(await stream.read()) == f"10.0.0.0:{NODE_PORT}"
            await stream.send(ext_pb.ProcessingRequest(request_trailers=ext_pb.HttpTrailers()))
            assert (await stream.read()).HasField("request_trailers")
            await stream.close()
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_a_gateways_served_endpoint_names_the_node_envoy_and_counts_for_the_replica() -> None:
    """Gateways write `x-gateway-destination-endpoint-served` (protocol v1.0) with the node
    Envoy's address; it is the picked replica that served, so a success is its success (not
    a failure of the primary for a "served" endpoint outside the list)."""

    async def scenario() -> None:
        async with gateway_rig(1) as rig:
            for _ in range(8):  # more than the breaker's 5 consecutive failures
                stream = GatewayStream(rig.stub)
                await stream.headers()
                await stream.read()
                await stream.body(_chat())
                node = _destination(await stream.read())
                request = ext_pb.ProcessingRequest(
                    response_headers=ext_pb.HttpHeaders(
                        headers=header_map({":status": "200", "x-inferplane-replica": "r0"})
                    )
                )
                lb_metadata(request, node)
                await stream.send(request)
                await stream.read()
                await stream.send(
                    ext_pb.ProcessingRequest(
                        response_trailers=ext_pb.HttpTrailers(
                            trailers=header_map({"grpc-status": "0"})
                        )
                    )
                )
                await stream.read()
                await stream.close()
            replicas = rig.admission.replicas("d")
            assert replicas is not None
            breaker = replicas.states[0].breaker.peek(0.0)
            assert breaker.name == "CLOSED", breaker
            assert rig.records[-1].replica == "r0"

    asyncio.run(scenario())

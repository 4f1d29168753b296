"""Scale from zero, the picker's side (issue 29): a request for a scale-to-zero deployment with
no ready replica is held in its admission queue (Envoy's message timer extended to the
cold-start budget) until a routing table brings a replica, or gets a 503 with Retry-After and
`deployment_cold_start` when the budget runs out; a route that does not scale to zero keeps
its immediate 503. Over real gRPC with the fake Envoy (`ExtProcStream`), admission on a fake
clock and scheduler (no sleeps beyond the picker's 10 ms keepalive)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.router.admission import COLD_START_CODE, Admission, AdmissionSettings
from inferplane.router.features import RequestFeatures
from inferplane.router.metrics import AdmissionCollector
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.policies import default_registry
from inferplane.router.reporting import Reporter
from inferplane.router.routes import (
    DEFAULT_COLD_START_BUDGET_SECONDS,
    ModelRoute,
    RouteTable,
    load_routes_file,
)
from inferplane.router.servicer import ModelsService
from inferplane.runtime import (
    ErrorInterceptor,
    ResourceExhaustedError,
    UnavailableError,
    error_trailers,
)
from inferplane.testing.clock import FakeClock

from .fakes import ExtProcStream, FakeScheduler, RecordingUsage, client_body, endpoints

pytestmark = pytest.mark.timeout(30)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
BUDGET = 30.0
MARGIN = 1.0


def _chat_body(model: str) -> bytes:
    request = pb.ChatCompletionRequest(model=model, messages=[pb.ChatMessage(role="user")])
    return client_body(pb.CreateChatCompletionRequest(request=request))


def _cold(n: int = 0, *, scale_to_zero: bool = True) -> ModelRoute:
    return ModelRoute(
        "z",
        endpoints(n, cap=4, prefix="z"),
        deployment="z",
        scale_to_zero=scale_to_zero,
        cold_start_budget_seconds=BUDGET,
    )


@dataclasses.dataclass
class Rig:
    stub: ext_grpc.ExternalProcessorStub
    admission: Admission
    scheduler: FakeScheduler
    tables: list[RouteTable]

    def apply(self, *routes: ModelRoute) -> None:
        """A new routing table (as the route source swaps it in)."""
        table = RouteTable.of(routes, version=str(len(self.tables)))
        self.tables.append(table)
        self.admission.apply(table)

    async def held(self, body: bytes, path: str = CHAT) -> tuple[ExtProcStream, asyncio.Future]:  # type: ignore[type-arg]
        stream = ExtProcStream(self.stub)
        assert (await stream.headers(path, {"x-inferplane-key-id": "k"})).HasField(
            "request_headers"
        )
        answer = asyncio.ensure_future(stream.body(body))
        return stream, answer


@contextlib.asynccontextmanager
async def rig(*routes: ModelRoute) -> AsyncIterator[Rig]:
    clock = FakeClock()
    scheduler = FakeScheduler(clock)
    admission = Admission(
        default_registry(),
        AdmissionSettings(queue_timeout_seconds=5.0, cold_start_retry_after_seconds=7.0),
        clock,
        scheduler,
    )
    tables = [RouteTable.of(routes, version="0")]
    admission.apply(tables[0])
    picker = EndpointPicker(
        lambda: tables[-1],
        admission,
        Reporter(RecordingUsage(), None, clock, wall_clock=lambda: 1.7e9),
        settings=PickerSettings(keepalive_seconds=0.01, timeout_margin_seconds=MARGIN),
    )
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    ext_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Rig(ext_grpc.ExternalProcessorStub(channel), admission, scheduler, tables)
    finally:
        await server.stop(0)


async def _until(condition: object, what: str) -> None:
    for _ in range(600):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def _headers(refusal: ext_pb.ImmediateResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in refusal.headers.set_headers}


def test_a_request_for_a_deployment_at_zero_is_held_then_sent_to_the_first_replica() -> None:
    """Held, not refused: the request waits (Envoy's timer extended to the cold-start budget
    plus the margin), is counted as cold-waiting, and the table that brings a ready replica
    sends the held requests there in order."""

    async def scenario() -> None:
        async with rig(_cold()) as r:
            first, first_answer = await r.held(_chat_body("z"))
            await _until(lambda: r.admission.cold_waiting("z") == 1, "the first hold")
            second, second_answer = await r.held(_chat_body("z"))
            await _until(lambda: r.admission.cold_waiting("z") == 2, "the second hold")
            await _until(lambda: first.overrides and second.overrides, "the extensions")
            assert first.overrides[0] == pytest.approx(BUDGET + MARGIN, abs=0.5)
            assert not first_answer.done() and not second_answer.done()
            r.scheduler.advance(BUDGET - 1)  # most of the budget: still held
            await asyncio.sleep(0.02)
            assert not first_answer.done()
            ready = dataclasses.replace(_cold(), endpoints=endpoints(1, cap=1, prefix="z"))
            r.apply(ready)  # a replica is ready, with room for one: the first held goes
            pick = await first_answer
            assert pick.HasField("request_body"), pick
            lb = pick.dynamic_metadata.fields["envoy.lb"].struct_value
            assert lb.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.0:50054"
            await asyncio.sleep(0.02)
            assert not second_answer.done()  # in order: the second waits for the slot
            assert r.admission.cold_waiting("z") == 1
            await first.response_headers({":status": "200"}, end_of_stream=True)
            assert (await second_answer).HasField("request_body")
            assert r.admission.cold_waiting("z") == 0 and r.admission.queue_length("z") == 0
            r.scheduler.advance(5.0)  # the budget's timers were cancelled: nothing fires
            assert r.admission.refused("z")["cold_start"] == 0
            await second.response_headers({":status": "200"}, end_of_stream=True)
            for stream in (first, second):
                await stream.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("path", "status"), [(CHAT, 503), (MESSAGES, 529)])
def test_past_the_budget_a_held_request_gets_a_shaped_503_with_retry_after(
    path: str, status: int
) -> None:
    """No replica within the budget: the API's own error (OpenAI's 503, Anthropic's 529
    overloaded_error on Messages) with Retry-After and the code `deployment_cold_start`,
    counted as the queue's `cold_start` refusal."""

    async def scenario() -> None:
        async with rig(_cold()) as r:
            if path == MESSAGES:
                body = json.dumps(
                    {"model": "z", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
                ).encode()
            else:
                body = _chat_body("z")
            _, answer = await r.held(body, path)
            await _until(lambda: r.admission.cold_waiting("z") == 1, "the hold")
            r.scheduler.advance(BUDGET)
            refusal = (await answer).immediate_response
            assert refusal.status.code == status
            headers = _headers(refusal)
            assert headers["retry-after"] == "7"
            assert headers["x-openai-error-code"] == COLD_START_CODE
            error = json.loads(refusal.body)
            if path == MESSAGES:
                assert error["type"] == "error"
                assert error["error"]["type"] == "overloaded_error"
                assert "starting" in error["error"]["message"]
            else:
                assert error["error"]["code"] == COLD_START_CODE
                assert "starting" in error["error"]["message"]
            assert r.admission.refused("z")["cold_start"] == 1
            assert r.admission.refused("z")["timeout"] == 0
            assert r.admission.cold_waiting("z") == 0

    asyncio.run(scenario())


def test_a_route_that_does_not_scale_to_zero_keeps_its_immediate_503() -> None:
    async def scenario() -> None:
        async with rig(_cold(scale_to_zero=False)) as r:
            _, answer = await r.held(_chat_body("z"))
            refusal = (await answer).immediate_response
            assert refusal.status.code == 503
            assert _headers(refusal)["x-openai-error-code"] == "no_ready_replica"
            assert r.admission.cold_waiting("z") == 0 and r.admission.queue_length("z") == 0

    asyncio.run(scenario())


def test_the_client_going_away_while_held_releases_it() -> None:
    async def scenario() -> None:
        async with rig(_cold()) as r:
            stream, answer = await r.held(_chat_body("z"))
            await _until(lambda: r.admission.cold_waiting("z") == 1, "the hold")
            stream.call.cancel()
            await _until(lambda: r.admission.cold_waiting("z") == 0, "the release")
            assert r.admission.queue_length("z") == 0
            r.apply(_cold(1))
            replicas = r.admission.replicas("z")
            assert replicas is not None and replicas.total_in_flight == 0
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await answer

    asyncio.run(scenario())


def test_held_requests_still_queue_fairly_and_the_metric_counts_them() -> None:
    """The hold is the deployment's fair queue: its cap per key applies (one key alone holds
    at most about half of it), and `inferplane_router_cold_waiting_requests` shows the held."""

    async def scenario() -> None:
        clock = FakeClock()
        admission = Admission(
            default_registry(),
            AdmissionSettings(max_queue_per_deployment=4),
            clock,
            FakeScheduler(clock),
        )
        admission.apply(RouteTable.of([_cold()]))
        held = [
            asyncio.ensure_future(admission.acquire(_cold(), RequestFeatures(flow="k")))
            for _ in range(3)
        ]
        await asyncio.sleep(0)
        assert isinstance(held[-1].exception(), ResourceExhaustedError)  # over its share
        assert admission.cold_waiting("z") == 2
        registry = CollectorRegistry()
        registry.register(AdmissionCollector(admission, clock.monotonic))
        value = registry.get_sample_value(
            "inferplane_router_cold_waiting_requests", {"deployment": "z"}
        )
        assert value == 2
        for f in held[:2]:
            f.cancel()
        await asyncio.sleep(0)
        assert admission.cold_waiting("z") == 0

    asyncio.run(scenario())


def test_models_lists_a_deployment_at_zero_and_routes_files_take_the_fields(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        models = ModelsService(lambda: RouteTable.of([_cold()]))
        listed = await models.ListModels(pb.ListModelsRequest(), None)
        assert [m.id for m in listed.data] == ["z"]

    asyncio.run(scenario())
    path = tmp_path / "routes.yaml"
    path.write_text("models:\n  - model: z\n    scale_to_zero: true\n")
    route = load_routes_file(path).routes["z"]
    assert route.scale_to_zero and route.endpoints == ()
    assert route.cold_start_budget == DEFAULT_COLD_START_BUDGET_SECONDS


def test_a_503_carries_retry_after_when_it_has_one() -> None:
    """`UnavailableError.retry_after_seconds` becomes `retry-after` (whole seconds, at least 1)."""
    trailers = dict(error_trailers(UnavailableError("starting", retry_after_seconds=7.2)))
    assert trailers["retry-after"] == "7"
    assert "retry-after" not in dict(error_trailers(UnavailableError("down")))


def test_the_hold_never_outlasts_what_the_edges_timer_extension_covers() -> None:
    """A route's budget above `max_cold_start_budget_seconds` is held only that long (Envoy
    ignores an extension above its `max_message_timeout`), then gets the cold-start 503."""

    async def scenario() -> None:
        clock = FakeClock()
        scheduler = FakeScheduler(clock)
        admission = Admission(
            default_registry(),
            AdmissionSettings(max_cold_start_budget_seconds=50.0),
            clock,
            scheduler,
        )
        long = dataclasses.replace(_cold(), cold_start_budget_seconds=600)
        admission.apply(RouteTable.of([long]))
        assert admission.wait_seconds(long) == 50.0
        held = asyncio.ensure_future(admission.acquire(long, RequestFeatures()))
        await asyncio.sleep(0)
        scheduler.advance(49.9)
        await asyncio.sleep(0)
        assert not held.done()
        scheduler.advance(0.1)
        await asyncio.sleep(0)
        error = held.exception()
        assert isinstance(error, UnavailableError) and error.code == COLD_START_CODE

    asyncio.run(scenario())

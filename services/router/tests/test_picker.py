"""The endpoint picker (Envoy ext_proc, data path v2) over real gRPC, driven by a small fake
Envoy (`ExtProcStream`) the way Envoy 1.40 drives it with the edge's processing mode; admission
runs on an injected clock and scheduler (no sleeps beyond the picker's keepalive)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.router.admission import Admission, AdmissionSettings, Slot
from inferplane.router.app import build_app
from inferplane.router.breaker import BreakerState
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.keylimits import KeyLimiter
from inferplane.router.keys import KeyTable
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.policies import default_registry
from inferplane.router.reporting import Reporter
from inferplane.router.routes import ModelRoute, RouteTable
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import StaticRouteSource
from inferplane.runtime import ErrorInterceptor, RunningServer
from inferplane.testing.clock import FakeClock
from inferplane.wire import SUMMARY_KEYS, ResponseSummary, headers
from inferplane.wire.headers import UNKNOWN_MODEL
from inferplane.wire.siblings import decode_siblings

from .fakes import (
    ExtProcStream,
    FakeScheduler,
    RecordingUsage,
    client_body,
    endpoints,
)

pytestmark = pytest.mark.timeout(30)

CHAT = "/v1/chat/completions"
STREAM_EVENTS = CHAT  # a streamed chat has the same path; its body says `"stream": true`
KEYED = {"x-inferplane-key-id": "k1", "x-request-id": "req-1", "x-inferplane-tenant": "t1"}
GRPC_OK = {":status": "200", "content-type": "application/grpc"}


def _chat_body(model: str = "m", stream: bool = True) -> bytes:
    request = pb.ChatCompletionRequest(model=model, messages=[pb.ChatMessage(role="user")])
    if not stream:
        return client_body(pb.CreateChatCompletionRequest(request=request))
    return client_body(pb.StreamChatCompletionEventsRequest(request=request))


def _endpoint_list(response: ext_pb.ProcessingResponse) -> list[str]:
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value
    return lb.fields["x-gateway-destination-endpoint"].string_value.split(",")


def _set_headers(mutation: ext_pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


@dataclasses.dataclass
class Rig:
    """A picker served over loopback gRPC, with what it reported."""

    stub: ext_grpc.ExternalProcessorStub
    picker: EndpointPicker
    admission: Admission
    metrics: RouterMetrics
    clock: FakeClock
    scheduler: FakeScheduler
    usage: RecordingUsage
    records: list[telemetry_pb2.RequestRecord]
    route: ModelRoute

    def stream(self) -> ExtProcStream:
        return ExtProcStream(self.stub)

    def breaker(self, index: int) -> BreakerState:
        replicas = self.admission.replicas("d")
        assert replicas is not None
        return replicas.states[index].breaker.peek(self.clock.monotonic())

    def in_flight(self) -> int:
        replicas = self.admission.replicas("d")
        assert replicas is not None
        return replicas.total_in_flight

    async def hold(self, index: int) -> Slot:
        """Takes a slot on replica `index` directly (load from other requests)."""
        others = [e.key for i, e in enumerate(self.route.endpoints) if i != index]
        return await self.admission.acquire(self.route, RequestFeatures(), exclude=others)


@contextlib.asynccontextmanager
async def picker_rig(
    n: int = 3,
    *,
    policy: str = "least_load",
    cap: int = 0,
    admission: AdmissionSettings | None = None,
    picker: PickerSettings | None = None,
    keys: KeyTable | None = None,
    key_limits: Callable[[FakeClock], KeyLimiter] | None = None,
) -> AsyncIterator[Rig]:
    route = ModelRoute("m", endpoints(n, cap), deployment="d", routing_policy=policy)
    table = RouteTable.of([route, dataclasses.replace(route, model="m-alias")])
    clock = FakeClock()
    scheduler = FakeScheduler(clock)
    control = Admission(default_registry(), admission or AdmissionSettings(), clock, scheduler)
    control.apply(table)
    usage = RecordingUsage()
    records: list[telemetry_pb2.RequestRecord] = []
    metrics = RouterMetrics(CollectorRegistry())
    servicer = EndpointPicker(
        lambda: table,
        control,
        Reporter(usage, records.append, clock, wall_clock=lambda: 1.7e9),
        settings=picker or PickerSettings(keepalive_seconds=0.01),
        metrics=metrics,
        keys=keys,
        key_limits=key_limits(clock) if key_limits is not None else None,
    )
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    ext_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ext_grpc.ExternalProcessorStub(channel)
            yield Rig(stub, servicer, control, metrics, clock, scheduler, usage, records, route)
    finally:
        await server.stop(0)


async def _until(condition: object, what: str) -> None:
    for _ in range(500):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def _pick(rig: Rig, metadata: Mapping[str, str] | None = None) -> ExtProcStream:
    stream = rig.stream()
    assert (await stream.headers(CHAT, metadata)).HasField("request_headers")
    return stream


def test_pick_is_the_least_loaded_replica_then_fallbacks_with_max_retries() -> None:
    """The primary is the least-loaded replica; the fallbacks follow in load order, and
    x-envoy-max-retries caps Envoy's retries at the list (no retry to a random host)."""

    async def scenario() -> None:
        async with picker_rig(3) as rig:
            busy = [await rig.hold(0), await rig.hold(0), await rig.hold(1)]
            stream = await _pick(rig)
            answer = await stream.body(_chat_body())
            assert answer.HasField("request_body")
            assert _endpoint_list(answer) == ["10.0.0.2:50054", "10.0.0.1:50054", "10.0.0.0:50054"]
            mutation = answer.request_body.response.header_mutation
            assert _set_headers(mutation) == {
                "x-envoy-max-retries": "2",
                headers.SIBLINGS: "r2||10.0.0.2:50054,r1||10.0.0.1:50054,r0||10.0.0.0:50054",
            }
            assert rig.in_flight() == 4  # the pick holds a slot on its primary
            await stream.close()
            for slot in busy:
                slot.release()

    asyncio.run(scenario())


def test_an_embeddings_request_is_picked_by_load_alone() -> None:
    """`POST /v1/embeddings` (CreateEmbedding, issue 19) is decided like a generation: the
    least-loaded replica of its model, then the fallbacks; no prefix blocks are computed (an
    embedding reuses no KV cache)."""

    async def scenario() -> None:
        async with picker_rig(2) as rig:
            busy = await rig.hold(0)
            stream = rig.stream()
            path = "/v1/embeddings"
            assert (await stream.headers(path, KEYED)).HasField("request_headers")
            inputs = struct_pb2.Value()
            inputs.list_value.values.add().string_value = "x" * 4096
            request = pb.EmbeddingRequest(model="m-alias", input=inputs)
            answer = await stream.body(client_body(pb.CreateEmbeddingRequest(request=request)))
            assert _endpoint_list(answer) == ["10.0.0.1:50054", "10.0.0.0:50054"]
            features = FeatureExtractor().embedding(request, KEYED)
            assert features.prefix_blocks == () and features.root is None
            assert features.flow == "k1" and features.prompt_tokens > 1000
            await stream.close()
            busy.release()

    asyncio.run(scenario())


AUDIO = {
    "CreateTranscription": "/v1/audio/transcriptions",
    "CreateTranslation": "/v1/audio/translations",
}


def _audio_body(model: str | None = "m-alias", audio: bytes = b"RIFF" * 1000) -> tuple[str, bytes]:
    """A transcription request as the client sends it: (its content type, its multipart form,
    written by httpx as the openai client does)."""
    data = {"model": model} if model is not None else {"language": "en"}
    form = httpx.Request(
        "POST", "http://x", data=data, files={"file": ("a.wav", audio, "audio/wav")}
    )
    return form.headers["content-type"], form.read()


@pytest.mark.parametrize("method", ["CreateTranscription", "CreateTranslation"])
def test_an_audio_request_is_routed_by_its_forms_model_and_picked_by_load(method: str) -> None:
    """`POST /v1/audio/transcriptions` / `translations` (issue 19): the picker reads `model`
    from the multipart form the edge passed through, and picks the least-loaded replica of
    that model with no prefix blocks (the input is audio)."""

    async def scenario() -> None:
        async with picker_rig(2) as rig:
            busy = await rig.hold(0)
            stream = rig.stream()
            content_type, body = _audio_body()
            headers = {**KEYED, "content-type": content_type}
            assert (await stream.headers(AUDIO[method], headers)).HasField("request_headers")
            answer = await stream.body(body)
            assert _endpoint_list(answer) == ["10.0.0.1:50054", "10.0.0.0:50054"]
            features = FeatureExtractor().speech(4000, KEYED)
            assert features.prefix_blocks == () and features.root is None
            assert features.flow == "k1" and features.prompt_tokens == 1000
            await stream.close()
            busy.release()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (_audio_body(model=None), 400, "missing_required_parameter", "model"),
        (_audio_body(model="nope"), 404, "model_not_found", "model"),
        (("application/json", b"{}"), 400, "invalid_body", None),
        (
            ("multipart/form-data; boundary=b", b"--b\r\ngarbage"),
            400,
            "invalid_body",
            None,
        ),
    ],
    ids=["no-model", "unknown-model", "not-multipart", "truncated"],
)
def test_an_audio_request_without_a_readable_model_is_refused_in_openais_shape(
    body: tuple[str, bytes], status: int, code: str, param: str | None
) -> None:
    """A form without `model`, a model no route serves, a body that is not multipart or is
    cut short: OpenAI's error body and status, no slot taken."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = rig.stream()
            content_type, data = body
            headers = {**KEYED, "content-type": content_type}
            assert (await stream.headers(AUDIO["CreateTranscription"], headers)).HasField(
                "request_headers"
            )
            answer = await stream.body(data)
            assert answer.immediate_response.status.code == status
            error = _error_json(answer)
            assert (error["code"], error["param"]) == (code, param)
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_fallbacks_setting_bounds_the_list() -> None:
    """With `fallbacks=0` the list is the primary alone and Envoy may not retry at all."""

    async def scenario() -> None:
        async with picker_rig(3, picker=PickerSettings(fallbacks=0)) as rig:
            stream = await _pick(rig)
            answer = await stream.body(_chat_body())
            assert len(_endpoint_list(answer)) == 1
            mutation = answer.request_body.response.header_mutation
            assert _set_headers(mutation) == {"x-envoy-max-retries": "0"}
            await stream.close()

    asyncio.run(scenario())


def test_session_affinity_keeps_a_session_on_one_primary_through_the_picker() -> None:
    """Requests of one session get the same primary, and the primary is never repeated among
    its own fallbacks; an alias shares the deployment's replicas."""

    async def scenario() -> None:
        async with picker_rig(4, policy="session_affinity") as rig:
            lists = []
            for model in ("m", "m", "m-alias"):
                stream = await _pick(rig, {"x-session-id": "conversation-9"})
                lists.append(_endpoint_list(await stream.body(_chat_body(model))))
                await stream.response_headers(GRPC_OK)
                await stream.response_trailers({"grpc-status": "0"})
                await stream.close()
            assert len({tuple(x) for x in lists}) == 1
            assert len(set(lists[0])) == 3
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def _error_json(response: ext_pb.ProcessingResponse) -> dict[str, object]:
    body = json.loads(response.immediate_response.body)
    error: dict[str, object] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_key_restricted_to_other_models_gets_a_shaped_403() -> None:
    """A key whose allow-list lacks the model is refused by Envoy with HTTP 403, gRPC
    PERMISSION_DENIED, OpenAI's error body and headers; the refusal is reported once."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = await _pick(rig, {**KEYED, "x-inferplane-allowed-models": "other, more"})
            answer = await stream.body(_chat_body())
            refusal = answer.immediate_response
            assert refusal.status.code == 403
            assert refusal.grpc_status.status == grpc.StatusCode.PERMISSION_DENIED.value[0]
            assert refusal.details == "picker_model_not_allowed"
            headers = _set_headers(refusal.headers)
            assert headers["content-type"] == "application/json"
            assert headers["x-openai-error-code"] == "model_not_allowed"
            assert headers["x-openai-error-param"] == "model"
            assert headers["x-openai-error-type"] == "invalid_request_error"
            error = _error_json(answer)
            assert error["code"] == "model_not_allowed" and error["param"] == "model"
            assert await stream.call.read() is grpc.aio.EOF  # the picker ends the stream
            assert [(r.key_id, r.ok) for r in rig.usage.reports] == [("k1", False)]
            assert [(r.error_code, r.finish_reason) for r in rig.records] == [
                ("model_not_allowed", "error")
            ]
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_an_unknown_model_gets_a_shaped_404() -> None:
    """A model no route serves is HTTP 404 / NOT_FOUND with code model_not_found."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = await _pick(rig)
            answer = await stream.body(_chat_body("nope"))
            assert answer.immediate_response.status.code == 404
            assert answer.immediate_response.grpc_status.status == 5
            assert _error_json(answer)["code"] == "model_not_found"

    asyncio.run(scenario())


def test_queue_timeout_is_a_429_with_retry_after() -> None:
    """With every replica at its cap the request queues; past the queue timeout Envoy answers
    HTTP 429 with retry-after, never a 5xx, and no slot stays taken."""

    async def scenario() -> None:
        settings = AdmissionSettings(queue_timeout_seconds=5, retry_after_seconds=3)
        async with picker_rig(1, cap=1, admission=settings) as rig:
            held = await rig.hold(0)
            stream = await _pick(rig)
            answer = asyncio.ensure_future(stream.body(_chat_body()))
            await _until(lambda: rig.admission.queue_length("d") == 1, "the request to queue")
            rig.scheduler.advance(5.0)
            refusal = (await answer).immediate_response
            assert refusal.status.code == 429
            assert refusal.grpc_status.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            headers = _set_headers(refusal.headers)
            assert headers["retry-after"] == "3"
            assert headers["x-openai-error-code"] == "model_overloaded"
            assert _error_json(await answer)["type"] == "rate_limit_error"
            held.release()
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_a_queued_request_extends_envoys_message_timer_then_gets_the_freed_slot() -> None:
    """A request waiting in the queue longer than the keepalive sends one
    override_message_timeout covering the rest of the queue wait plus the margin (Envoy
    honours one per message), so Envoy's 1 s message timeout never fires while it queues."""

    async def scenario() -> None:
        settings = AdmissionSettings(queue_timeout_seconds=5)
        picker = PickerSettings(keepalive_seconds=0.01, timeout_margin_seconds=1.0)
        async with picker_rig(1, cap=1, admission=settings, picker=picker) as rig:
            first = await _pick(rig)
            await first.body(_chat_body())
            second = await _pick(rig)
            answer = asyncio.ensure_future(second.body(_chat_body()))
            await _until(lambda: second.overrides, "the timer extension")
            assert second.overrides == [pytest.approx(6.0)]
            await first.response_headers(GRPC_OK)
            await first.response_trailers({"grpc-status": "0"})  # frees the only slot
            assert _endpoint_list(await answer) == ["10.0.0.0:50054"]
            await first.close()
            await second.close()
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_trailers_give_one_usage_report_and_one_record_and_are_stripped() -> None:
    """The replica's ResponseSummary trailers become the usage report (tokens) and the
    telemetry record (tokens, TTFT, finish reason, replica), and never reach the client."""

    async def scenario() -> None:
        async with picker_rig(2) as rig:
            stream = await _pick(rig, KEYED)
            answer = await stream.body(_chat_body())
            primary = _endpoint_list(answer)[0]
            headers = await stream.response_headers(GRPC_OK, served=primary)
            assert not headers.response_headers.response.header_mutation.remove_headers
            summary = ResponseSummary(
                replica_id="replica-a",
                prompt_tokens=11,
                completion_tokens=5,
                cached_tokens=3,
                reasoning_tokens=2,
                finish_reason="stop",
                ttft_seconds=0.25,
                gpu_seconds=0.5,
            )
            trailers = {"grpc-status": "0", "x-other": "kept", **dict(summary.to_metadata())}
            rig.clock.advance(1.0)  # the stream took a second
            answer = await stream.response_trailers(trailers, served=primary)
            removed = answer.response_trailers.header_mutation.remove_headers
            assert set(removed) == {k for k, _ in summary.to_metadata()}
            assert set(removed) <= set(SUMMARY_KEYS) and "x-other" not in removed
            assert rig.in_flight() == 0  # released on the trailers, before the stream closes
            await stream.close()
            assert [(r.key_id, r.request_id, r.prompt_tokens, r.completion_tokens, r.ok)
                    for r in rig.usage.reports] == [("k1", "req-1", 11, 5, True)]  # fmt: skip
            # What the usage ledger keeps: where it ran, the token details, times, GPU-seconds.
            (usage,) = rig.usage.reports
            assert (usage.deployment, usage.replica, usage.status) == (
                "d",
                "replica-a",
                "completed",
            )
            assert (usage.cached_tokens, usage.reasoning_tokens) == (3, 2)
            assert usage.ttft_seconds == pytest.approx(0.25)
            assert usage.duration_seconds == pytest.approx(1.0)
            assert usage.gpu_seconds == pytest.approx(0.5) and usage.start_time > 0
            wire = usage.usage()
            assert (wire.replica, wire.gpu_seconds, wire.status) == ("replica-a", 0.5, "completed")
            assert wire.HasField("start_time") and wire.cached_tokens == 3
            assert usage.api == wire.api == "chat"  # the method's API, in its own column
            (record,) = rig.records
            assert record.api == "chat"
            assert (record.prompt_tokens, record.completion_tokens) == (11, 5)
            assert (record.cached_tokens, record.reasoning_tokens) == (3, 2)
            assert record.time_to_first_token_seconds == pytest.approx(0.25)
            assert record.e2e_latency_seconds == pytest.approx(1.0)
            assert record.finish_reason == "stop" and record.error_code == ""
            assert record.replica == "replica-a" and record.deployment == "d"
            assert record.stream and record.tenant == "t1" and record.model == "m"
            assert record.record_source == telemetry_pb2.RECORD_SOURCE_ROUTER

    asyncio.run(scenario())


def test_requests_for_models_no_route_serves_are_grouped_under_one_unknown_model() -> None:
    """Usage groups a request by the name its model is served under; a name no route serves
    is `UNKNOWN_MODEL` in the usage report, and stays the client's text only in the record
    (data, never a group)."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            for name in ("../../etc/passwd", "no-such-model-xyz", "m-alias"):
                stream = await _pick(rig, {**KEYED, "x-request-id": name})
                answer = await stream.body(_chat_body(model=name))
                if answer.HasField("immediate_response"):
                    assert answer.immediate_response.status.code == 404
                else:
                    await stream.response_headers(GRPC_OK)
                    await stream.response_trailers({"grpc-status": "0"})
                    await stream.close()
            await _until(lambda: len(rig.usage.reports) == 3, "three usage reports")
            models = sorted(r.usage().model for r in rig.usage.reports)
            assert models == sorted([UNKNOWN_MODEL, UNKNOWN_MODEL, "m-alias"])
            assert sorted(r.model for r in rig.records) == sorted(
                ["../../etc/passwd", "no-such-model-xyz", "m-alias"]
            )

    asyncio.run(scenario())


def test_the_response_end_waits_for_nothing_the_replica_report_for_the_outbox() -> None:
    """The answer to the trailers comes at once even when the usage outbox cannot write (its
    disk stalled, `held`): nothing on the response path waits. A replica's report of that
    request is acknowledged only once the conclusion is in the outbox."""

    async def scenario() -> None:
        async with picker_rig(1, picker=PickerSettings(keepalive_seconds=0.01)) as rig:
            rig.usage.held = True
            stream = await _pick(rig, KEYED)
            primary = _endpoint_list(await stream.body(_chat_body()))[0]
            await stream.response_headers(GRPC_OK, served=primary)
            ended = await asyncio.wait_for(
                stream.response_trailers({"grpc-status": "0"}, served=primary), 0.5
            )
            assert ended.HasField("response_trailers")
            await stream.close()
            assert len(rig.usage.reports) == 1 and rig.usage.durable_count == 0
            acked = asyncio.ensure_future(
                rig.picker.report_outcomes_settled([("req-1", ResponseSummary(prompt_tokens=1))])
            )
            await asyncio.sleep(0.05)
            assert not acked.done()  # the conclusion is not on disk yet
            rig.usage.release()
            assert await asyncio.wait_for(acked, 1.0) == 0  # concluded already: no match
            assert len(rig.usage.reports) == 1  # the copy concluded nothing twice

    asyncio.run(scenario())


def test_a_trailers_only_error_is_read_from_the_response_headers() -> None:
    """A trailers-only error response (no trailers message follows) is recorded from its
    headers: grpc-status and the OpenAI code; its summary keys are removed; the slot is free."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = await _pick(rig, KEYED)
            primary = _endpoint_list(await stream.body(_chat_body()))[0]
            headers = {
                **GRPC_OK,
                "grpc-status": "3",
                "grpc-message": "bad tool_choice",
                "x-openai-error-code": "invalid_tool_choice",
                "x-inferplane-replica": "replica-a",
                "x-inferplane-error-code": "invalid_tool_choice",
            }
            answer = await stream.response_headers(headers, served=primary, end_of_stream=True)
            removed = answer.response_headers.response.header_mutation.remove_headers
            assert set(removed) == {"x-inferplane-replica", "x-inferplane-error-code"}
            assert rig.in_flight() == 0
            await stream.close()
            (record,) = rig.records
            assert (record.error_code, record.finish_reason) == ("invalid_tool_choice", "error")
            assert [r.ok for r in rig.usage.reports] == [False]

    asyncio.run(scenario())


def test_a_stream_closed_without_trailers_releases_the_slot_and_records_an_abort() -> None:
    """Envoy half-closing without a trailers message (client gone, reset) still frees the
    slot and sends one record, finish_reason "abort" with no error code."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = await _pick(rig, KEYED)
            primary = _endpoint_list(await stream.body(_chat_body()))[0]
            await stream.response_headers(GRPC_OK, served=primary)
            assert rig.in_flight() == 1
            await stream.close()
            await _until(lambda: rig.records, "the record")
            assert rig.in_flight() == 0
            (record,) = rig.records
            assert (record.finish_reason, record.error_code) == ("abort", "")
            assert [r.ok for r in rig.usage.reports] == [False]

    asyncio.run(scenario())


def test_a_client_gone_while_queued_takes_no_slot() -> None:
    """Envoy closing the stream while the request waits in the queue removes it from the
    queue: the slot freed later goes to nobody, and the request is recorded as an abort."""

    async def scenario() -> None:
        async with picker_rig(1, cap=1) as rig:
            held = await rig.hold(0)
            stream = await _pick(rig)
            await stream.call.write(
                ext_pb.ProcessingRequest(request_body=ext_pb.HttpBody(body=_chat_body()))
            )
            await _until(lambda: rig.admission.queue_length("d") == 1, "the request to queue")
            await stream.call.done_writing()
            await _until(lambda: rig.records, "the record")
            held.release()
            assert rig.in_flight() == 0
            assert rig.records[0].finish_reason == "abort"

    asyncio.run(scenario())


@pytest.mark.parametrize("told_by", ["summary", "envoy"])
def test_served_by_a_fallback_counts_a_failure_for_the_primary(told_by: str) -> None:
    """When a fallback served the request (its replica names itself in its response headers,
    or Envoy reports it as the served endpoint), the primary failed before answering: its
    breaker counts a failure (here: opens), the fallback's a success, the record names the
    fallback, and the fallbacks-served counter moves."""

    async def scenario() -> None:
        settings = AdmissionSettings(breaker_failures=1)
        async with picker_rig(2, admission=settings) as rig:
            stream = await _pick(rig)
            primary, fallback = _endpoint_list(await stream.body(_chat_body()))
            index = {e.address: i for i, e in enumerate(rig.route.endpoints)}
            replica = rig.route.endpoints[index[fallback]].replica_id
            served = fallback if told_by == "envoy" else ""
            named = dict(ResponseSummary(replica_id=replica).to_metadata())
            headers = {**GRPC_OK, **(named if told_by == "summary" else {})}
            await stream.response_headers(headers, served=served)
            await stream.response_trailers({"grpc-status": "0", **named}, served=served)
            await stream.close()
            assert rig.breaker(index[primary]) is BreakerState.OPEN
            assert rig.breaker(index[fallback]) is BreakerState.CLOSED
            assert rig.records[0].replica == replica
            assert rig.metrics.fallbacks_served._value.get() == 1
            stream = await _pick(rig)  # the open breaker keeps the primary out of the list
            assert _endpoint_list(await stream.body(_chat_body())) == [fallback]
            await stream.close()

    asyncio.run(scenario())


def test_unavailable_without_a_served_endpoint_is_the_primarys_failure() -> None:
    """An UNAVAILABLE answer with no served endpoint reported counts against the primary."""

    async def scenario() -> None:
        settings = AdmissionSettings(breaker_failures=1)
        async with picker_rig(2, admission=settings) as rig:
            stream = await _pick(rig)
            primary = _endpoint_list(await stream.body(_chat_body()))[0]
            headers = {**GRPC_OK, "grpc-status": "14", "grpc-message": "upstream connect error"}
            await stream.response_headers(headers, end_of_stream=True)
            await stream.close()
            index = {e.address: i for i, e in enumerate(rig.route.endpoints)}
            assert rig.breaker(index[primary]) is BreakerState.OPEN
            assert rig.records[0].error_code == "replica_unavailable"

    asyncio.run(scenario())


def test_client_errors_never_open_a_breaker() -> None:
    """A replica answering INVALID_ARGUMENT (the client's fault) is healthy: however many such
    answers, its breaker stays closed and it keeps getting requests."""

    async def scenario() -> None:
        settings = AdmissionSettings(breaker_failures=1)
        async with picker_rig(1, admission=settings) as rig:
            for _ in range(3):
                stream = await _pick(rig)
                primary = _endpoint_list(await stream.body(_chat_body()))[0]
                headers = {**GRPC_OK, "grpc-status": "3", "x-openai-error-code": "bad"}
                await stream.response_headers(headers, served=primary, end_of_stream=True)
                await stream.close()
            assert rig.breaker(0) is BreakerState.CLOSED
            assert [r.error_code for r in rig.records] == ["bad"] * 3

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b'{"model": "m", "messages": [',
        b'["not", "an", "object"]',
        b"\xff\xfe",
        b'{"model": "m", "messages": "oops"}',
        b'{"model": "m", "max_tokens": "many", "messages": []}',
    ],
    ids=["empty", "truncated", "not-an-object", "not-utf8", "wrong-type", "wrong-scalar"],
)
def test_a_malformed_body_gets_a_shaped_400(body: bytes) -> None:
    """A body that is not a JSON object, or holds a field of the wrong type, is HTTP 400 /
    INVALID_ARGUMENT in OpenAI's shape (`invalid_request_body`, as the edge's transcoder
    answers), never an exception out of the picker, and takes no slot."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = await _pick(rig)
            answer = await stream.body(body)
            assert answer.immediate_response.status.code == 400
            assert answer.immediate_response.grpc_status.status == 3
            assert _error_json(answer)["code"] == "invalid_request_body"
            assert rig.in_flight() == 0

    asyncio.run(scenario())


TOOL_PARAM, FORMAT_PARAM = "tools[0].function.parameters", "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("field", "schema", "param", "code"),
    [
        ("tool", {"type": "objekt"}, TOOL_PARAM, "invalid_function_parameters"),
        ("tool", {"required": "city"}, TOOL_PARAM, "invalid_function_parameters"),
        ("format", {"type": 5}, FORMAT_PARAM, "invalid_json_schema"),
        ("format", "not a schema", FORMAT_PARAM, "invalid_json_schema"),
    ],
)
def test_a_request_with_a_bad_schema_is_a_400_before_admission(
    field: str, schema: object, param: str, code: str
) -> None:
    """A schema that is not a JSON schema is the client's error: a 400 naming the parameter,
    no slot taken, no replica asked, no breaker touched; a good schema goes through."""

    async def scenario() -> None:
        async with picker_rig(1, admission=AdmissionSettings(breaker_failures=1)) as rig:
            for bad in (True, True, False):
                request = pb.ChatCompletionRequest(
                    model="m", messages=[pb.ChatMessage(role="user")]
                )
                value = schema if bad else {"type": "object"}
                if field == "tool":
                    tool = request.tools.add(type="function")
                    tool.function.name = "f"
                    tool.function.parameters.update(value)
                else:
                    request.response_format.update(
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
                    )
                stream = await _pick(rig)
                body = client_body(pb.StreamChatCompletionEventsRequest(request=request))
                answer = await stream.body(body)
                if bad:
                    assert answer.immediate_response.status.code == 400
                    error = _error_json(answer)
                    assert (error["param"], error["code"]) == (param, code)
                    assert rig.in_flight() == 0
                else:
                    assert _endpoint_list(answer)
                await stream.close()
            assert rig.breaker(0) is BreakerState.CLOSED

    asyncio.run(scenario())


def test_an_unknown_path_or_a_request_without_body_is_refused_at_the_headers() -> None:
    """A path or verb that is no generation method is a shaped 404 at once (`/internal/...`
    included: only the edge's stream router, after the picker, moves a request there); a
    request without a body (nothing to pick on) a shaped 400, instead of the edge's generic
    503."""

    async def scenario() -> None:
        async with picker_rig() as rig:
            for path in ("/v1/nope", "/internal/events/v1/chat/completions", "/"):
                answer = await rig.stream().headers(path)
                assert answer.immediate_response.status.code == 404
                assert _error_json(answer)["code"] == "unknown_url"
            answer = await rig.stream().headers(CHAT, {":method": "GET"})
            assert answer.immediate_response.status.code == 404
            answer = await rig.stream().headers(CHAT, end_of_stream=True)
            assert answer.immediate_response.status.code == 400

    asyncio.run(scenario())


def test_the_router_app_serves_the_picker_beside_list_models() -> None:
    """The composition root binds the ext_proc picker and the InferenceService on one port;
    ListModels keeps answering (the edge disables ext_proc on GET /v1/models)."""

    async def scenario() -> None:
        route = ModelRoute("m", endpoints(2), deployment="d")
        settings = RouterSettings(host="127.0.0.1", port=0, picker_fallbacks=1)
        usage = RecordingUsage()
        app = build_app(settings, source=StaticRouteSource(RouteTable.of([route])), usage=usage)
        server = RunningServer(app, settings)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                models = await inference_pb2_grpc.InferenceServiceStub(channel).ListModels(
                    pb.ListModelsRequest()
                )
                assert [m.id for m in models.data] == ["m"]
                stream = ExtProcStream(ext_grpc.ExternalProcessorStub(channel))
                await stream.headers(CHAT, KEYED)
                answer = await stream.body(_chat_body(stream=False))
                assert len(_endpoint_list(answer)) == 2
                await stream.response_headers(GRPC_OK)
                await stream.response_trailers({"grpc-status": "0"})
                await stream.close()
                assert [r.ok for r in usage.reports] == [True]
        finally:
            await server.server.stop(0)
            await app.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("when", ["queued", "picked"])
def test_a_cancelled_side_stream_releases_everything(when: str) -> None:
    """Envoy resetting the ext_proc call (instead of half-closing it) ends the request the
    same way: no slot left taken, one record saying abort."""

    async def scenario() -> None:
        async with picker_rig(1, cap=1) as rig:
            held = await rig.hold(0) if when == "queued" else None
            stream = await _pick(rig)
            await stream.call.write(
                ext_pb.ProcessingRequest(request_body=ext_pb.HttpBody(body=_chat_body()))
            )
            if held is not None:
                await _until(lambda: rig.admission.queue_length("d") == 1, "the request to queue")
            else:
                assert (await stream.call.read()).HasField("request_body")
            stream.call.cancel()
            await _until(lambda: rig.records, "the record")
            if held is not None:
                held.release()
            assert rig.in_flight() == 0
            assert [r.finish_reason for r in rig.records] == ["abort"]

    asyncio.run(scenario())


REPORTING = PickerSettings(
    keepalive_seconds=0.01, outcome_address="10.1.2.3:50052", outcome_wait_seconds=0.2
)
DONE = ResponseSummary(
    replica_id="r0", prompt_tokens=9, completion_tokens=40, finish_reason="stop", ttft_seconds=0.05
)


def _replica_headers(replica: str = "r0") -> dict[str, str]:
    return {**GRPC_OK, **dict(ResponseSummary(replica_id=replica).to_metadata())}


def test_the_pick_tells_the_replica_where_to_report() -> None:
    """With an outcome address the pick sets `x-inferplane-picker` (next to the retry cap) so
    the replica that serves the request reports how it ended to this router."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            mutation = (await stream.body(_chat_body())).request_body.response.header_mutation
            assert _set_headers(mutation) == {
                "x-envoy-max-retries": "0",
                "x-inferplane-picker": "10.1.2.3:50052",
            }
            await stream.close()

    asyncio.run(scenario())


def test_the_pick_names_its_replicas_to_the_serving_one_as_siblings() -> None:
    """With fallbacks, the pick lists its replicas (id, revision, address) in
    `x-inferplane-siblings`: where a replica whose engine dies mid-stream moves the stream."""

    async def scenario() -> None:
        async with picker_rig(2, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            mutation = (await stream.body(_chat_body())).request_body.response.header_mutation
            named = decode_siblings(_set_headers(mutation)[headers.SIBLINGS])
            assert sorted(s.replica_id for s in named) == ["r0", "r1"]
            assert {s.address for s in named} == {"10.0.0.0:50054", "10.0.0.1:50054"}
            await stream.close()

    asyncio.run(scenario())


def test_a_response_cut_before_its_trailers_is_concluded_by_the_replicas_report() -> None:
    """A client that closes right after `data: [DONE]` makes Envoy cancel the side stream
    before the trailers arrive: the slot is freed at once, and the usage and the record
    wait for the replica's report, which carries the tokens and the finish reason."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            await stream.body(_chat_body())
            await stream.response_headers(_replica_headers())
            await stream.close()
            assert rig.in_flight() == 0
            await asyncio.sleep(0.05)
            assert rig.records == [] and rig.usage.reports == []  # waiting for the report
            assert rig.picker.report_outcomes([("req-1", DONE), ("unknown", DONE)]) == 1
            (record,) = rig.records
            assert (record.finish_reason, record.error_code) == ("stop", "")
            assert (record.prompt_tokens, record.completion_tokens) == (9, 40)
            assert record.time_to_first_token_seconds == pytest.approx(0.05)  # fake clock
            (usage,) = rig.usage.reports
            assert (usage.ok, usage.prompt_tokens, usage.completion_tokens) == (True, 9, 40)
            assert rig.picker.report_outcomes([("req-1", DONE)]) == 0  # concluded once

    asyncio.run(scenario())


def test_a_report_that_comes_first_is_used_when_the_trailers_never_come() -> None:
    """The replica's report may arrive before Envoy closes the side stream: the request is
    concluded with it as soon as the stream ends, without waiting."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            await stream.body(_chat_body())
            await stream.response_headers(_replica_headers())
            assert rig.picker.report_outcomes([("req-1", DONE)]) == 1
            assert rig.records == []  # the stream still runs
            await stream.close()
            await _until(lambda: rig.records, "the record")
            assert rig.records[0].completion_tokens == 40

    asyncio.run(scenario())


def test_without_trailers_or_report_the_request_is_an_abort_after_the_wait() -> None:
    """No trailers and no report within `outcome_wait_seconds` (the replica died with its
    report, or is slow to send it): the request is recorded as an abort, once, its usage
    marked provisional. The replica's report coming later amends the usage once (the tokens,
    how it really ended, no longer provisional); a copy of that report changes nothing."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            await stream.body(_chat_body())
            await stream.response_headers(_replica_headers())
            await stream.close()
            await _until(lambda: rig.records, "the record")
            (record,) = rig.records
            assert (record.finish_reason, record.error_code) == ("abort", "")
            (first,) = rig.usage.reports
            assert first.provisional and first.usage().provisional
            assert (first.status, first.completion_tokens) == ("cancelled", 0)
            assert rig.metrics.provisional_conclusions._value.get() == 1

            assert rig.picker.report_outcomes([("req-1", DONE)]) == 0  # nothing in flight
            first_again, amended = rig.usage.reports
            assert first_again is first
            assert amended.request_id == first.request_id and not amended.usage().provisional
            assert (amended.status, amended.finish_reason) == ("completed", DONE.finish_reason)
            assert amended.completion_tokens == DONE.completion_tokens
            assert amended.replica == first.replica
            assert rig.metrics.provisional_amended._value.get() == 1
            assert len(rig.records) == 1  # telemetry keeps its one record per request

            assert rig.picker.report_outcomes([("req-1", DONE)]) == 0
            assert len(rig.usage.reports) == 2

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("took", "stream_seconds", "status"),
    [
        (0.01, 0.0, "completed"),
        (29.5, 30.0, "completed"),
        (600.0, 0.0, "cancelled"),
        (0.01, 30.0, "cancelled"),
    ],
)
def test_a_late_report_of_an_end_the_client_cannot_have_seen_keeps_the_request_cancelled(
    took: float, stream_seconds: float, status: str
) -> None:
    """The replica's late report says how long it took; the client's stream ended
    `stream_seconds` after the pick. Ends that match (within 2 s) were delivered. A replica's
    end long after the stream's (600 s: cut off from the edge, generating on), or long before
    it (the stream reset 30 s later: its last bytes never arrived), was not: the request stays
    cancelled, its tokens accounted all the same."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            await stream.body(_chat_body())
            await stream.response_headers(_replica_headers())
            rig.clock.advance(stream_seconds)
            await stream.close()
            await _until(lambda: rig.usage.reports, "the provisional usage")
            late = dataclasses.replace(DONE, duration_seconds=took)
            rig.picker.report_outcomes([("req-1", late)])
            _, amended = rig.usage.reports
            assert (amended.status, amended.provisional) == (status, False)
            assert amended.completion_tokens == DONE.completion_tokens

    asyncio.run(scenario())


def test_trailers_conclude_at_once_and_a_late_report_is_ignored() -> None:
    """When the trailers arrive they conclude the request; the replica's report that follows
    matches nothing (exactly one record and one usage report per request)."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            stream = await _pick(rig, KEYED)
            await stream.body(_chat_body())
            await stream.response_headers(_replica_headers())
            trailers = {"grpc-status": "0", **dict(DONE.to_metadata())}
            await stream.response_trailers(trailers)
            await stream.close()
            assert len(rig.records) == 1 and len(rig.usage.reports) == 1
            assert rig.picker.report_outcomes([("req-1", DONE)]) == 0
            assert len(rig.records) == 1 and len(rig.usage.reports) == 1

    asyncio.run(scenario())


def test_a_report_of_a_request_picked_before_a_restart_is_accounted_once() -> None:
    """A replica's report naming a request this router never saw (it was picked by the same
    address before the router restarted: its state died with the process) still reports the
    usage, from the key and model the report carries; a second copy does not, and neither
    does a late report of a request this router concluded, nor one without a key."""

    async def scenario() -> None:
        async with picker_rig(1, picker=REPORTING) as rig:
            orphan = dataclasses.replace(DONE, key_id="k9", model="m", api="chat")
            assert rig.picker.report_outcomes([("lost-1", orphan)]) == 0
            assert rig.picker.report_outcomes([("lost-1", orphan)]) == 0
            assert rig.picker.report_outcomes([("lost-2", DONE)]) == 0  # no key: nothing to do
            (usage,) = rig.usage.reports
            assert (usage.key_id, usage.request_id, usage.model) == ("k9", "lost-1", "m")
            assert usage.api == usage.usage().api == "chat"  # no row without its API
            assert (usage.prompt_tokens, usage.completion_tokens, usage.ok) == (
                DONE.prompt_tokens,
                DONE.completion_tokens,
                True,
            )
            assert rig.metrics.orphan_outcomes._value.get() == 1
            assert not rig.records  # the record died with the old process

    asyncio.run(scenario())

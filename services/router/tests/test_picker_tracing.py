"""The endpoint picker's spans (`picker/tracing.py`): `authn`, `pick` and `queue` under the
span Envoy's ext_proc stream names in its gRPC metadata (else the request's `traceparent`),
with the request id, exported to the suite's OTLP receiver."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from inferplane.router.picker.tracing import PICKER_TRACING_OFF, PickerTracing
from inferplane.runtime.tracing import REQUEST_ID_ATTRIBUTE, Tracing, TracingSettings
from inferplane.testing.otlp import OtlpReceiver, ReceivedSpan

from .fakes import ExtProcStream
from .test_picker import KEYED, STREAM_EVENTS, _chat_body, _endpoint_list, picker_rig

pytestmark = pytest.mark.timeout(30)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
STREAM_SPAN = "00f067aa0ba902b7"  # Envoy's ext_proc span, in the side stream's metadata
HEADER_SPAN = "1111111111111111"  # a traceparent among the request headers


class _TracedStream(ExtProcStream):
    def __init__(self, stub: ext_grpc.ExternalProcessorStub, traceparent: str) -> None:
        self.call = stub.Process(metadata=(("traceparent", traceparent),))
        self.overrides = []


def _by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans}


async def _one_request(receiver: OtlpReceiver, *, stream_metadata: bool) -> list[ReceivedSpan]:
    async with picker_rig(2) as rig:
        assert rig.picker.tracing is PICKER_TRACING_OFF
        tracing = Tracing(TracingSettings(endpoint=receiver.endpoint, sampling_ratio=0.0))
        rig.picker.tracing = PickerTracing(tracing)
        headers = {**KEYED, "traceparent": f"00-{TRACE}-{HEADER_SPAN}-01"}
        if stream_metadata:
            stream: ExtProcStream = _TracedStream(rig.stub, f"00-{TRACE}-{STREAM_SPAN}-01")
        else:
            stream = rig.stream()
        assert (await stream.headers(STREAM_EVENTS, headers)).HasField("request_headers")
        picked = _endpoint_list(await stream.body(_chat_body()))
        await stream.close()
        assert await asyncio.to_thread(tracing.flush)
        spans = await asyncio.to_thread(receiver.wait_for, lambda s: len(s) >= 3)
        tracing.shutdown()
        pick = _by_name(spans)["pick"]
        assert pick.attributes["inferplane.endpoints"] == picked
        return spans


@pytest.mark.parametrize(("stream_metadata", "parent"), [(True, STREAM_SPAN), (False, HEADER_SPAN)])
def test_authn_pick_and_queue_continue_the_edge_trace(stream_metadata: bool, parent: str) -> None:
    with OtlpReceiver() as receiver:
        spans = asyncio.run(_one_request(receiver, stream_metadata=stream_metadata))
    by_name = _by_name(spans)
    assert sorted(by_name) == ["authn", "pick", "queue"]
    assert {s.trace_id for s in spans} == {TRACE}
    assert by_name["authn"].parent_id == parent
    assert by_name["pick"].parent_id == parent
    assert by_name["queue"].parent_id == by_name["pick"].span_id
    for span in spans:
        assert span.service == "inferplane"
        assert span.attributes[REQUEST_ID_ATTRIBUTE] == KEYED["x-request-id"]
        assert span.start_ns <= span.end_ns
    pick, queue = by_name["pick"], by_name["queue"]
    assert pick.start_ns <= queue.start_ns <= queue.end_ns <= pick.end_ns
    assert by_name["authn"].end_ns <= pick.start_ns
    assert pick.attributes["inferplane.model"] == "m"
    assert pick.attributes["inferplane.deployment"] == "d"


def test_an_unsampled_request_gets_no_span() -> None:
    async def scenario(receiver: OtlpReceiver) -> None:
        async with picker_rig(2) as rig:
            tracing = Tracing(TracingSettings(endpoint=receiver.endpoint, sampling_ratio=1.0))
            rig.picker.tracing = PickerTracing(tracing)
            stream = _TracedStream(rig.stub, f"00-{TRACE}-{STREAM_SPAN}-00")
            assert (await stream.headers(STREAM_EVENTS, KEYED)).HasField("request_headers")
            assert _endpoint_list(await stream.body(_chat_body()))
            await stream.close()
            assert await asyncio.to_thread(tracing.flush)
            tracing.shutdown()

    with OtlpReceiver() as receiver:
        asyncio.run(scenario(receiver))
        assert receiver.spans == []


def test_a_failing_tracer_never_fails_a_request() -> None:
    class Broken(Tracing):
        def start(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            raise RuntimeError("exporter bug")

    async def scenario() -> None:
        async with picker_rig(2) as rig:
            broken = Broken(TracingSettings(endpoint="127.0.0.1:9", sampling_ratio=1.0))
            rig.picker.tracing = PickerTracing(broken)
            stream = _TracedStream(rig.stub, f"00-{TRACE}-{STREAM_SPAN}-01")
            assert (await stream.headers(STREAM_EVENTS, KEYED)).HasField("request_headers")
            assert _endpoint_list(await stream.body(_chat_body()))
            await stream.close()
            broken.shutdown()

    asyncio.run(scenario())

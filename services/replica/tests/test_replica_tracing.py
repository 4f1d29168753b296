"""The replica's spans (`inferplane.replica.tracing`): one `replica` span under the request's
`traceparent`, its stages `render`, `prefill`, `decode` and `parse` once per request, the
request id on each, and the W3C headers the engine is handed (vLLM's `trace_headers`).
Real grpc.aio server, the pipeline's servicer, a scripted engine, the suite's OTLP receiver."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import EngineOutput, SamplingParams
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    TickingClock,
    kimi_tiny_ids,
    run_scenario,
    script,
)
from inferplane.replica.tracing import CURRENT, REPLICA_TRACING_OFF, ReplicaTracing
from inferplane.runtime.tracing import REQUEST_ID_ATTRIBUTE, Tracing, TracingSettings
from inferplane.testing.otlp import OtlpReceiver, ReceivedSpan
from inferplane.wire import chat_request_from_dict

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
UPSTREAM_SPAN = "00f067aa0ba902b7"  # Envoy's upstream span
TEXT_IDS = kimi_tiny_ids("Here is a short note about Paris. I hope it helps.<|im_end|>")


class HeaderRecordingEngine(ScriptedEngine):
    """Remembers the trace headers current when each generation started (what the inproc
    engine hands vLLM)."""

    def __init__(self, outputs: Sequence[EngineOutput]) -> None:
        super().__init__(outputs)
        self.trace_headers: list[dict[str, str] | None] = []

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        trace = CURRENT.get()
        self.trace_headers.append(dict(trace.headers) if trace is not None else None)
        async for out in super().generate(request_id, prompt_ids, params):
            yield out


def _request() -> pb.StreamChatCompletionEventsRequest:
    return pb.StreamChatCompletionEventsRequest(
        request=chat_request_from_dict(kt.WEATHER.request(stream=True))
    )


def _serve(
    engine: ScriptedEngine, tracing: Tracing | None, metadata: tuple[tuple[str, str], ...]
) -> None:
    """One streamed chat with `metadata`, on a servicer whose spans go to `tracing` (None:
    tracing off) on the servicer's own clock."""
    clock = TickingClock()

    async def body(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
        async for _ in stub.StreamChatCompletionEvents(_request(), metadata=metadata):
            pass

    from inferplane.replica.server import InferenceServicer

    original = InferenceServicer.tracing
    if tracing is not None:
        InferenceServicer.tracing = ReplicaTracing(tracing, clock)
    try:
        run_scenario(engine, body, clock=clock)
    finally:
        InferenceServicer.tracing = original
    assert InferenceServicer.tracing is REPLICA_TRACING_OFF


def test_a_request_continues_the_edge_trace_with_one_span_per_stage() -> None:
    engine = HeaderRecordingEngine(script(TEXT_IDS, prompt_tokens=12))
    with OtlpReceiver() as receiver:
        tracing = Tracing(TracingSettings(endpoint=receiver.endpoint, sampling_ratio=0.0))
        metadata = (
            ("traceparent", f"00-{TRACE}-{UPSTREAM_SPAN}-01"),
            ("x-request-id", "req-7"),
        )
        _serve(engine, tracing, metadata)
        assert tracing.flush()
        spans = receiver.wait_for(lambda s: len(s) >= 5)
        tracing.shutdown()
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted(by_name) == ["decode", "parse", "prefill", "render", "replica"]
    assert all(len(v) == 1 for v in by_name.values())  # per request, never per token
    top = by_name["replica"][0]
    assert top.trace_id == TRACE and top.parent_id == UPSTREAM_SPAN
    assert top.kind == 2 and top.service == "inferplane"
    assert top.attributes["inferplane.completion_tokens"] == len(TEXT_IDS)
    assert top.attributes["inferplane.model"] == "kimi-tiny"
    stages = [by_name[n][0] for n in ("render", "prefill", "decode", "parse")]
    for span in [top, *stages]:
        assert span.attributes[REQUEST_ID_ATTRIBUTE] == "req-7"
    for span in stages:
        assert span.parent_id == top.span_id
        assert top.start_ns <= span.start_ns <= span.end_ns <= top.end_ns
    render, prefill, decode, parse = stages
    assert render.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
    assert parse.start_ns == decode.start_ns
    assert parse.attributes["inferplane.parse_seconds"] > 0
    # The engine was handed the replica span as its parent.
    assert engine.trace_headers == [{"traceparent": f"00-{TRACE}-{top.span_id}-01"}]


def test_an_unsampled_request_records_nothing_but_still_tells_the_engine() -> None:
    engine = HeaderRecordingEngine(script(TEXT_IDS))
    with OtlpReceiver() as receiver:
        tracing = Tracing(TracingSettings(endpoint=receiver.endpoint, sampling_ratio=1.0))
        metadata = (("traceparent", f"00-{TRACE}-{UPSTREAM_SPAN}-00"),)
        _serve(engine, tracing, metadata)
        assert tracing.flush()
        tracing.shutdown()
        assert receiver.spans == []
    (headers,) = engine.trace_headers
    assert headers is not None and headers["traceparent"].endswith("-00")


def test_tracing_off_hands_the_engine_nothing() -> None:
    engine = HeaderRecordingEngine(script(TEXT_IDS))
    _serve(engine, None, (("traceparent", f"00-{TRACE}-{UPSTREAM_SPAN}-01"),))
    assert engine.trace_headers == [None]


def test_a_failing_tracer_never_fails_a_request() -> None:
    class Broken(Tracing):
        def start(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            raise RuntimeError("exporter bug")

    engine = HeaderRecordingEngine(script(TEXT_IDS))
    broken = Broken(TracingSettings(endpoint="127.0.0.1:9", sampling_ratio=1.0))
    _serve(engine, broken, (("traceparent", f"00-{TRACE}-{UPSTREAM_SPAN}-01"),))
    broken.shutdown()
    assert engine.trace_headers == [None]  # untraced, served

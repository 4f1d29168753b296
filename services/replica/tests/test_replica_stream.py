"""What a replica's stream looks like on the wire: SSE framing, the ResponseSummary trailers the
endpoint picker reads, the same summary reported to the picker out of band, and message
coalescing. Real grpc.aio server behind the runtime's
ErrorInterceptor, the pipeline's servicer, scripted engines replaying fixture-tokenizer ids."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.router.v1 import outcome_pb2, outcome_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import EngineOutput, SamplingParams
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.pipeline.coalesce import CoalescingEngine, merge_outputs
from inferplane.replica.server import InferenceServicer, RequestOutcome, StreamMetrics
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    TickingClock,
    kimi_tiny_assets,
    kimi_tiny_ids,
    kimi_tiny_spec,
    script,
)
from inferplane.routing_client import OutcomeReporter
from inferplane.runtime import OPENAI_ERROR_CODE_KEY, ErrorInterceptor
from inferplane.wire import (
    SUMMARY_KEYS,
    ResponseSummary,
    apis,
    chat_request_from_dict,
    completion_request_from_dict,
)
from inferplane.wire.headers import PICKER, SERVED_BY

Stub = inference_pb2_grpc.InferenceServiceStub
WEATHER_IDS = kimi_tiny_ids(kt.WEATHER.output + "<|im_end|>")
TEXT = "Here is a short note about Paris. I hope it helps."
TEXT_IDS = kimi_tiny_ids(TEXT + "<|im_end|>")
LONG = " ".join([TEXT] * 8)
LONG_IDS = kimi_tiny_ids(LONG + "<|im_end|>")


class StepEngine:
    """An engine that produces one increment every `step_seconds` on its own, whether or not
    anyone reads, and merges the increments the reader has not taken yet (what vLLM's output
    collector does with DELTA outputs)."""

    def __init__(self, outputs: Sequence[EngineOutput], step_seconds: float) -> None:
        self._outputs = list(outputs)
        self._step = step_seconds
        self.aborted: list[str] = []

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        pending: list[EngineOutput] = []
        ready = asyncio.Event()

        async def produce() -> None:
            for out in self._outputs:
                await asyncio.sleep(self._step)
                pending.append(out)
                ready.set()

        task = asyncio.get_running_loop().create_task(produce())
        try:
            while True:
                await ready.wait()
                ready.clear()
                merged = merge_outputs(pending)
                pending.clear()
                yield merged
                if merged.finished:
                    return
        finally:
            task.cancel()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class TrailerSpy(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Records the trailing metadata a streaming handler left on its context, however it
    ended (a cancelled call's trailers never reach the client)."""

    def __init__(self) -> None:
        self.trailers: list[tuple[tuple[str, str], ...]] = []
        self.done = asyncio.Event()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_stream is None:
            return handler
        inner = handler.unary_stream
        spy = self

        async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                spy.trailers.append(tuple(context.trailing_metadata() or ()))
                spy.done.set()

        return handler._replace(unary_stream=wrapper)


def serve(
    engine: Any,
    body: Any,
    *,
    channel_options: Sequence[tuple[str, Any]] = (),
    registry: CollectorRegistry | None = None,
    outcomes: list[RequestOutcome] | None = None,
    spy: TrailerSpy | None = None,
    report_to_picker: Any = None,
) -> None:
    """Serves the fixture model on replica "r1" whose engine is `engine`; runs `body(stub)`."""
    assets = ModelAssetsCache()
    assets.put(kimi_tiny_assets(), "kimi_k2")
    servicer = InferenceServicer(
        FakeReplica("r1", kimi_tiny_spec(), engine),
        assets,
        clock=TickingClock(),
        on_outcome=outcomes.append if outcomes is not None else (lambda _o: None),
        metrics=StreamMetrics(registry) if registry is not None else None,
        report_to_picker=report_to_picker,
    )

    async def scenario() -> None:
        interceptors: list[Any] = [ErrorInterceptor("replica")]
        if spy is not None:
            interceptors.insert(0, spy)
        server = grpc.aio.server(interceptors=interceptors)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=list(channel_options)
            ) as channel:
                await body(Stub(channel))
        finally:
            await server.stop(0)
        await asyncio.sleep(0)

    asyncio.run(scenario())


def chat_events(**extra: Any) -> pb.StreamChatCompletionEventsRequest:
    return pb.StreamChatCompletionEventsRequest(
        request=chat_request_from_dict(kt.WEATHER.request(stream=True, **extra))
    )


def completion(stream: bool = True, **extra: Any) -> Any:
    body = {"model": kt.SERVED_MODEL_NAME, "prompt": "Tell me about Paris.", **extra}
    req = completion_request_from_dict(body)
    if stream:
        return pb.StreamCompletionRequest(request=req)
    return pb.CreateCompletionRequest(request=req)


def events_of(bodies: Sequence[Any]) -> list[bytes]:
    data = b"".join(b.data for b in bodies)
    assert data.endswith(b"\n\n")
    return [e for e in data.split(b"\n\n") if e]


def summary(metadata: Any) -> ResponseSummary:
    return ResponseSummary.from_metadata(tuple(metadata or ()))


# -- SSE framing ----------------------------------------------------------------------------


def test_sse_stream_is_openai_event_bytes_ending_with_done_and_a_summary() -> None:
    """StreamChatCompletionEvents writes OpenAI's exact SSE: the first HttpBody says
    text/event-stream, each chunk is `data: {json}`, the stream ends with `data: [DONE]`; the
    trailers summarise usage, finish reason, TTFT and the replica."""

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletionEvents(chat_events())
        bodies = [b async for b in call]
        assert bodies[0].content_type == "text/event-stream"
        assert all(not b.content_type for b in bodies[1:])
        events = events_of(bodies)
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert all("usage" not in c for c in chunks)  # not asked for (stream_options)
        names = [
            tc["function"].get("name")
            for c in chunks
            for tc in c["choices"][0]["delta"].get("tool_calls", ())
        ]
        assert "get_weather" in names
        # The response headers name the replica (the picker learns who answered).
        assert dict(await call.initial_metadata())[SERVED_BY] == "r1"
        s = summary(await call.trailing_metadata())
        assert s.replica_id == "r1"
        assert s.finish_reason == "tool_calls"
        assert s.completion_tokens == len(WEATHER_IDS)
        assert s.prompt_tokens > 0 and s.ttft_seconds > 0 and s.reasoning_tokens > 0
        assert s.error_code == ""
        assert await call.code() == grpc.StatusCode.OK

    serve(ScriptedEngine(script(WEATHER_IDS)), body)


def test_sse_usage_chunk_only_when_asked_but_summary_always_carries_usage() -> None:
    """`stream_options.include_usage` adds OpenAI's usage chunk (empty choices) before [DONE];
    without it there is none. Either way the trailers carry the usage."""

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletionEvents(chat_events(stream_options={"include_usage": True}))
        events = events_of([b async for b in call])
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(WEATHER_IDS)
        assert summary(await call.trailing_metadata()).completion_tokens == len(WEATHER_IDS)

    serve(ScriptedEngine(script(WEATHER_IDS)), body)


def test_sse_failure_after_first_byte_is_an_error_event_then_ok_with_an_error_summary() -> None:
    """An engine failure after the first byte cannot become an HTTP status any more: the SSE
    stream ends with OpenAI's error event (code engine_failed), no [DONE], status OK, and the
    summary says finish_reason error with the code, plus the usage so far."""
    outcomes: list[RequestOutcome] = []
    engine = ScriptedEngine(script(WEATHER_IDS), fail_at=5)

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletionEvents(chat_events())
        events = events_of([b async for b in call])
        assert b"[DONE]" not in events[-1]
        error = json.loads(events[-1].removeprefix(b"data: "))["error"]
        assert error["code"] == "engine_failed" and error["type"] == "server_error"
        assert await call.code() == grpc.StatusCode.OK
        s = summary(await call.trailing_metadata())
        assert (s.finish_reason, s.error_code) == ("error", "engine_failed")
        assert s.completion_tokens == 5 and s.replica_id == "r1"

    serve(engine, body, outcomes=outcomes)
    assert [(o.status, o.error_code) for o in outcomes] == [("error", "engine_failed")]


def test_sse_failure_before_first_byte_is_a_retryable_status_with_summary_trailers() -> None:
    """An engine that fails before any output gives UNAVAILABLE (Envoy retries it on the next
    endpoint), with the OpenAI error trailers AND the summary keys: the runtime interceptor's
    abort must not drop them."""

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletionEvents(chat_events())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Trailers-only: no response headers before the status, or Envoy could not retry.
        assert SERVED_BY not in dict(info.value.initial_metadata() or ())
        trailers = dict(info.value.trailing_metadata() or ())
        assert trailers[OPENAI_ERROR_CODE_KEY] == "engine_failed"
        assert "grpc-status-details-bin" in trailers
        s = summary(info.value.trailing_metadata())
        assert (s.replica_id, s.error_code, s.finish_reason) == ("r1", "engine_failed", "")
        assert s.completion_tokens == 0

    serve(ScriptedEngine(script(WEATHER_IDS), fail_at=0), body)


def test_completion_events_frame_text_completion_chunks() -> None:
    """StreamCompletionEvents frames text_completion chunks the same way (one framing copy)."""

    async def body(stub: Stub) -> None:
        call = stub.StreamCompletionEvents(
            pb.StreamCompletionEventsRequest(request=completion().request)
        )
        events = events_of([b async for b in call])
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
        assert summary(await call.trailing_metadata()).finish_reason == "stop"

    serve(ScriptedEngine(script(TEXT_IDS)), body)


# -- summary trailers on the typed and unary methods ------------------------------------------


def test_unary_and_typed_stream_end_with_summary_trailers() -> None:
    """Every method ends with the summary: a unary completion and a typed stream both carry the
    replica, usage and finish reason in their trailers."""

    async def body(stub: Stub) -> None:
        call = stub.CreateCompletion(completion(stream=False))
        response = await call
        s = summary(await call.trailing_metadata())
        assert s.completion_tokens == response.usage.completion_tokens == len(TEXT_IDS)
        assert (s.replica_id, s.finish_reason) == ("r1", "stop")
        stream = stub.StreamCompletion(completion())
        assert [c async for c in stream]
        s = summary(await stream.trailing_metadata())
        assert (s.finish_reason, s.completion_tokens) == ("stop", len(TEXT_IDS))

    serve(ScriptedEngine(script(TEXT_IDS)), body)


def test_typed_stream_failure_after_first_chunk_is_a_status_with_summary() -> None:
    """The typed stream keeps ending a mid-stream failure with its status (never a silent
    truncation), and that status carries the summary (finish_reason error, tokens so far)."""

    async def body(stub: Stub) -> None:
        call = stub.StreamCompletion(completion())
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                got.append(chunk)
        assert got and info.value.code() == grpc.StatusCode.UNAVAILABLE
        s = summary(info.value.trailing_metadata())
        assert (s.finish_reason, s.error_code, s.completion_tokens) == ("error", "engine_failed", 4)

    serve(ScriptedEngine(script(TEXT_IDS), fail_at=4), body)


def test_client_cancel_leaves_an_abort_summary_and_aborts_the_engine() -> None:
    """A client gone mid-stream: the engine request is aborted, the record says cancelled, and
    the handler's trailers (which Envoy would get if it still listened) say abort."""
    outcomes: list[RequestOutcome] = []
    engine = ScriptedEngine(script(TEXT_IDS), block_at=3)
    spy = TrailerSpy()

    async def body(stub: Stub) -> None:
        call = stub.StreamCompletionEvents(
            pb.StreamCompletionEventsRequest(request=completion().request)
        )
        await call.read()
        await engine.blocked.wait()
        call.cancel()
        await asyncio.wait_for(spy.done.wait(), 5)

    serve(engine, body, outcomes=outcomes, spy=spy)
    assert engine.aborted and engine.cancelled
    s = summary(spy.trailers[0])
    assert (s.finish_reason, s.replica_id, s.completion_tokens) == ("abort", "r1", 3)
    assert [o.status for o in outcomes] == ["cancelled"]


# -- the summary reported to the picker ------------------------------------------------------

PICKED = (("x-request-id", "req-1"), (PICKER, "10.0.0.9:50070"))
"""The request metadata Envoy forwards for a picked request (the picker's address, the id)."""


class Reports:
    """Records `(picker address, request id, summary)` reports (the servicer's hook)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str, ResponseSummary]] = []

    def __call__(self, address: str, request_id: str, summary: ResponseSummary) -> None:
        self.got.append((address, request_id, summary))


class FakePicker(outcome_pb2_grpc.OutcomeServiceServicer):  # type: ignore[misc]
    """The router's OutcomeService: records each reported outcome."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, dict[str, str]]] = []

    async def ReportOutcomes(self, request: Any, context: Any) -> Any:
        self.outcomes.extend((o.request_id, dict(o.summary)) for o in request.outcomes)
        return outcome_pb2.ReportOutcomesResponse(matched=len(request.outcomes))


def summary_trailers(metadata: Any) -> dict[str, str]:
    return {k: v for k, v in metadata or () if k in SUMMARY_KEYS}


def as_reported(
    trailers: dict[str, str], key_id: str = "", api: str = apis.CHAT_COMPLETIONS
) -> dict[str, str]:
    """What the picker gets: the trailers' summary plus the request's model, API (and key):
    what a restarted router, which never saw the request, accounts its usage from."""
    extra = {"x-inferplane-summary-model": "kimi-tiny", "x-inferplane-summary-api": api}
    if key_id:
        extra["x-inferplane-summary-key-id"] = key_id
    return {**trailers, **extra}


def sans_duration(reported: dict[str, str]) -> dict[str, str]:
    """A report without its `duration_seconds` (the replica's own time, not in the trailers)."""
    return {k: v for k, v in reported.items() if k != "x-inferplane-summary-duration-seconds"}


def test_a_picked_stream_is_reported_to_its_picker_with_the_trailers_summary() -> None:
    """A streamed request that names its picker (`x-inferplane-picker`) and id (`x-request-id`)
    is reported exactly once, through the real `OutcomeReporter` over gRPC, to that picker,
    under that id, with the summary of its trailers (plus its model and key, which never go
    into the trailers): what makes usage exact when the client closes right after [DONE] and
    the trailers never reach the picker."""
    reporter = OutcomeReporter(CollectorRegistry())
    picker = FakePicker()

    async def body(stub: Stub) -> None:
        server = grpc.aio.server()
        outcome_pb2_grpc.add_OutcomeServiceServicer_to_server(picker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await reporter.start()
        try:
            metadata = (
                ("x-request-id", "req-7"),
                (PICKER, f"127.0.0.1:{port}"),
                ("x-inferplane-key-id", "key-9"),
            )
            call = stub.StreamChatCompletionEvents(chat_events(), metadata=metadata)
            events = events_of([b async for b in call])
            assert events[-1] == b"data: [DONE]"
            trailers = summary_trailers(await call.trailing_metadata())
            for _ in range(500):
                if picker.outcomes and not reporter.pending:
                    break
                await asyncio.sleep(0.01)
        finally:
            await reporter.close()
            await server.stop(0)
        assert [(r, sans_duration(o)) for r, o in picker.outcomes] == [
            ("req-7", as_reported(trailers, "key-9"))
        ]
        assert "x-inferplane-summary-key-id" not in trailers
        assert trailers["x-inferplane-finish-reason"] == "tool_calls"
        assert ResponseSummary.from_metadata(trailers).completion_tokens == len(WEATHER_IDS)

    serve(ScriptedEngine(script(WEATHER_IDS)), body, report_to_picker=reporter.report)


def test_a_failure_after_output_is_reported_with_its_error_summary() -> None:
    """A request that failed after its first byte (SSE error event, status OK; or a typed
    stream's error status) is still reported: only this replica can have started it, and its
    summary (finish_reason error, the code, the tokens so far) equals the trailers'."""
    reports = Reports()

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletionEvents(chat_events(), metadata=PICKED)
        [b async for b in call]
        sse_trailers = summary_trailers(await call.trailing_metadata())
        typed = stub.StreamCompletion(completion(), metadata=PICKED)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in typed:
                pass
        typed_trailers = summary_trailers(info.value.trailing_metadata())
        await asyncio.sleep(0)
        assert [(a, r, sans_duration(dict(s.to_metadata()))) for a, r, s in reports.got] == [
            ("10.0.0.9:50070", "req-1", as_reported(sse_trailers)),
            ("10.0.0.9:50070", "req-1", as_reported(typed_trailers, api=apis.COMPLETIONS)),
        ]
        assert [(s.finish_reason, s.error_code) for _, _, s in reports.got] == [
            ("error", "engine_failed"),
            ("error", "engine_failed"),
        ]

    serve(ScriptedEngine(script(WEATHER_IDS), fail_at=4), body, report_to_picker=reports)


def test_a_failure_before_any_output_is_not_reported() -> None:
    """A request that failed before any output (a trailers-only UNAVAILABLE, which Envoy may
    retry on another replica) is not reported: the picker reads it from that response, and a
    report could conclude a request another replica is now serving."""
    reports = Reports()

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletionEvents(chat_events(), metadata=PICKED)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        unknown = pb.StreamCompletionRequest(request=completion().request)
        unknown.request.model = "no-such-model"
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub.StreamCompletion(unknown, metadata=PICKED):
                pass
        await asyncio.sleep(0.05)

    serve(ScriptedEngine(script(WEATHER_IDS), fail_at=0), body, report_to_picker=reports)
    assert reports.got == []


def test_requests_without_picker_or_request_id_are_not_reported() -> None:
    """Direct callers (tests, the orchestrator's warm-up probe) send no `x-inferplane-picker`
    or no `x-request-id`: their requests are served as usual and reported nowhere."""
    reports = Reports()

    async def body(stub: Stub) -> None:
        for metadata in ((), (("x-request-id", "req-1"),), ((PICKER, "10.0.0.9:50070"),)):
            call = stub.StreamChatCompletionEvents(chat_events(), metadata=metadata)
            assert events_of([b async for b in call])[-1] == b"data: [DONE]"
        await asyncio.sleep(0.05)

    serve(ScriptedEngine(script(WEATHER_IDS)), body, report_to_picker=reports)
    assert reports.got == []


def test_a_client_cancel_after_output_is_reported_as_abort() -> None:
    """A client gone mid-stream (Envoy cancels the picker's side stream too, so no trailers
    reach it) is reported once with finish_reason abort and the tokens so far, the summary
    the handler left in its trailers."""
    reports = Reports()
    engine = ScriptedEngine(script(TEXT_IDS), block_at=3)
    spy = TrailerSpy()

    async def body(stub: Stub) -> None:
        call = stub.StreamCompletionEvents(
            pb.StreamCompletionEventsRequest(request=completion().request), metadata=PICKED
        )
        await call.read()
        await engine.blocked.wait()
        call.cancel()
        await asyncio.wait_for(spy.done.wait(), 5)
        await asyncio.sleep(0.05)

    serve(engine, body, spy=spy, report_to_picker=reports)
    assert [(a, r) for a, r, _ in reports.got] == [("10.0.0.9:50070", "req-1")]
    reported = reports.got[0][2]
    assert (reported.finish_reason, reported.completion_tokens) == ("abort", 3)
    assert sans_duration(dict(reported.to_metadata())) == as_reported(
        summary_trailers(spy.trailers[0]), api=apis.COMPLETIONS
    )


# -- coalescing -------------------------------------------------------------------------------


def _messages(registry: CollectorRegistry) -> float:
    return (
        registry.get_sample_value(
            "inferplane_replica_stream_messages_sum", {"api": "completion", "framing": "typed"}
        )
        or 0.0
    )


def test_a_stream_that_keeps_up_gets_one_message_per_engine_step() -> None:
    """A reader that keeps up gets every increment at once: one message per engine step,
    counted in inferplane_replica_stream_messages."""
    registry = CollectorRegistry()
    outputs = script(TEXT_IDS)

    async def body(stub: Stub) -> None:
        chunks = [c async for c in stub.StreamCompletion(completion())]
        assert "".join(c.choices[0].text for c in chunks) == TEXT
        assert len(chunks) == len(outputs)

    serve(StepEngine(outputs, 0.03), body, registry=registry)
    assert _messages(registry) == len(outputs)


def test_a_slow_reader_gets_fewer_fuller_messages_with_the_same_content() -> None:
    """When the writer is blocked by a slow reader (HTTP/2 flow control), the increments the
    engine produced meanwhile go out together: far fewer messages, identical text."""
    registry = CollectorRegistry()
    outputs = script(LONG_IDS)
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

    async def body(stub: Stub) -> None:
        chunks = []
        async for chunk in stub.StreamCompletion(completion()):
            chunks.append(chunk)
            await asyncio.sleep(0.03)
        assert "".join(c.choices[0].text for c in chunks) == LONG
        assert chunks[-1].choices[0].finish_reason.string_value == "stop"
        assert len(chunks) < len(outputs) // 2

    serve(StepEngine(outputs, 0.001), body, channel_options=small_window, registry=registry)
    assert 0 < _messages(registry) < len(outputs) // 2


def test_coalescing_engine_merges_buffered_increments_and_keeps_errors_in_order() -> None:
    """CoalescingEngine (the gRPC transport's read-ahead) hands a busy consumer everything that
    arrived meanwhile as one increment with the same ids and the last counts, a fast one each
    increment as it comes, and an engine error only after the increments before it."""
    outputs = script(TEXT_IDS)

    async def scenario() -> None:
        slow = CoalescingEngine(ScriptedEngine(outputs))
        got = []
        async for out in slow.generate("a", [1], SamplingParams(max_tokens=64)):
            got.append(out)
            await asyncio.sleep(0.01)
        assert len(got) < len(outputs)
        assert [i for o in got for i in o.token_ids] == list(TEXT_IDS)
        assert got[-1].finished and got[-1].completion_tokens == len(TEXT_IDS)

        fast = CoalescingEngine(ScriptedEngine(outputs, delay=0.002))
        assert len([o async for o in fast.generate("b", [1], SamplingParams(8))]) == len(outputs)

        failing = CoalescingEngine(ScriptedEngine(outputs, fail_at=3))
        seen: list[int] = []
        with pytest.raises(Exception, match="engine process died"):
            async for out in failing.generate("c", [1], SamplingParams(8)):
                seen.extend(out.token_ids)
        assert seen == list(TEXT_IDS[:3])

    asyncio.run(scenario())

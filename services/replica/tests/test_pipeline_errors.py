"""Failures a client notices: 400s naming the offending `param`, unknown models, replicas that
are not ready, engines that die before or during a stream, and clients that go away."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.server import RequestOutcome
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_ids,
    kimi_tiny_spec,
    run_scenario,
    script,
)
from inferplane.wire import chat_request_from_dict

Stub = inference_pb2_grpc.InferenceServiceStub
OUTPUT = kt.NO_TOOL.output + "<|im_end|>"


def _engine(**kwargs: Any) -> ScriptedEngine:
    return ScriptedEngine(script(kimi_tiny_ids(OUTPUT)), **kwargs)


def _unary(body: dict[str, Any]) -> pb.CreateChatCompletionRequest:
    return pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))


def _stream(body: dict[str, Any]) -> pb.StreamChatCompletionRequest:
    return pb.StreamChatCompletionRequest(request=chat_request_from_dict(body))


def _trailers(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: v for k, v in (error.trailing_metadata() or ()) if isinstance(v, str)}


WEATHER_TOOLS = kt.WEATHER.request()["tools"]

INVALID = [
    ({"n": 9}, "n", "invalid_value"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "unsupported_parameter"),
    ({"priority": 5}, "priority", "unsupported_parameter"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "unsupported_parameter"),
    ({"structured_outputs": {}}, "structured_outputs", "invalid_value"),
    (
        {"structured_outputs": {"json": {}, "regex": "a"}},
        "structured_outputs.regex",
        "invalid_value",
    ),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "invalid_value"),
    (
        {"guided_choice": ["a"], "chat_template_kwargs": {"thinking": True}},
        "guided_choice",
        "invalid_value",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"},
                {"role": "user", "content": "go"},
            ]
        },
        "messages[1].reasoning",
        "invalid_value",
    ),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", None),
    (
        {"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        None,
    ),
    ({"tool_choice": "required", "tools": []}, "tool_choice", None),
    ({"max_tokens": 5000}, "messages", "context_length_exceeded"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"presence_penalty": -2.5}, "presence_penalty", "invalid_value"),
    ({"stop": ["ok", ""]}, "stop", "invalid_value"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "invalid_value"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "invalid_value",
    ),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking", None),
    # JSON schemas xgrammar (the engine's constraint backend) cannot compile.
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
            }
        },
        "response_format.json_schema.schema",
        "invalid_json_schema",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
        "invalid_function_parameters",
    ),
]


@pytest.mark.parametrize(("extra", "param", "code"), INVALID, ids=[i[1] for i in INVALID])
def test_invalid_requests_are_400s_naming_the_param(
    extra: dict[str, Any], param: str, code: str | None
) -> None:
    """Each invalid or unsupported field is INVALID_ARGUMENT (HTTP 400) with OpenAI's type,
    the offending `param`, and nothing reaches the engine; unary and streaming alike."""
    engine = _engine()

    async def body(stub: Stub) -> None:
        request = kt.NO_TOOL.request(**extra)
        for call in (
            lambda: stub.CreateChatCompletion(_unary(request)),
            lambda: _drain(stub.StreamChatCompletion(_stream(request))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            trailers = _trailers(info.value)
            assert trailers["x-openai-error-type"] == "invalid_request_error"
            assert trailers.get("x-openai-error-param") == param, info.value.details()
            if code is not None:
                assert trailers["x-openai-error-code"] == code
        assert engine.requests == []

    run_scenario(engine, body)


async def _drain(call: Any) -> list[Any]:
    return [c async for c in call]


def test_context_length_error_reads_like_openai() -> None:
    """Prompt + max tokens beyond the context: OpenAI's message with both numbers."""
    engine = _engine()

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(_unary(kt.NO_TOOL.request(max_tokens=2040)))
        message = info.value.details()
        assert message.startswith("This model's maximum context length is 2048 tokens.")
        assert "in the messages, 2040 in the completion" in message

    run_scenario(engine, body)


def test_known_model_without_a_ready_replica_is_unavailable() -> None:
    """The replica is not READY: UNAVAILABLE (the router tries another replica), never
    NOT_FOUND; the code is the replica's own (replica_not_ready)."""
    engine = _engine()
    replica = FakeReplica("r1", kimi_tiny_spec(), engine)
    replica.ready = False

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(_unary(kt.NO_TOOL.request()))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _trailers(info.value)["x-openai-error-code"] == "replica_not_ready"
        assert engine.requests == []

    run_scenario(engine, body, replicas=[replica])


def test_engine_failure_before_the_first_chunk_is_unavailable_and_retryable() -> None:
    """An engine that fails before producing anything: UNAVAILABLE with no chunk sent, so the
    router can retry the request on another replica."""
    engine = _engine(fail_at=0)

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletion(_stream(kt.NO_TOOL.request()))
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                received.append(chunk)
        assert received == []
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _trailers(info.value)["x-openai-error-code"] == "engine_failed"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(_unary(kt.NO_TOOL.request()))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    run_scenario(engine, body)


def test_a_request_the_engine_rejects_is_a_400_not_an_engine_failure() -> None:
    """The engine refusing a request (e.g. a schema its constraint backend cannot compile) is
    the client's fault: INVALID_ARGUMENT (HTTP 400), which the router never retries and never
    counts against the replica; not UNAVAILABLE engine_failed."""
    engine = _engine(fail_at=0, rejects=True)

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.StreamChatCompletion(_stream(kt.NO_TOOL.request())):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _trailers(info.value)["x-openai-error-code"] == "invalid_request"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(_unary(kt.NO_TOOL.request()))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run_scenario(engine, body)


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_status() -> None:
    """An engine dying after chunks were sent: the client gets those chunks, then an error
    status (never a stream that just ends without finish_reason)."""
    engine = _engine(fail_at=12)
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletion(_stream(kt.NO_TOOL.request()))
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                received.append(chunk)
        assert len(received) >= 2 and received[0].choices[0].delta.role == "assistant"
        assert all(not c.choices[0].HasField("finish_reason") for c in received)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _trailers(info.value)["x-openai-error-code"] == "engine_failed"

    run_scenario(engine, body, on_outcome=outcomes.append)
    assert [(o.status, o.error_code) for o in outcomes] == [("error", "engine_failed")]


def test_engine_failure_with_a_stream_interval_still_delivers_what_was_generated() -> None:
    """With `stream_interval` the node-agent holds tokens back; when the engine dies, what it
    held reaches the client before the error status (nothing generated is silently lost)."""
    engine = _engine(fail_at=12)

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletion(
            _stream(kt.NO_TOOL.request(stream_interval=100))  # more than the whole output
        )
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                received.append(chunk)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        shown = "".join(
            c.choices[0].delta.reasoning_content + c.choices[0].delta.content for c in received
        )
        # 12 one-token increments (all reasoning) arrived before the failure: all are shown
        text = kimi_tiny_assets().backend.decode(kimi_tiny_ids(OUTPUT)[:12])
        assert "</think>" not in text
        assert shown == text
        assert len(received) == 3  # the role chunk, the first token, the flushed rest

    run_scenario(engine, body)


def test_engine_abort_is_an_error_not_a_finish() -> None:
    """An engine that reports finish_reason "abort" (preempted, drained) is an error."""
    outputs = script(kimi_tiny_ids(OUTPUT), finish_reason="abort")
    engine = ScriptedEngine(outputs)

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _drain(stub.StreamChatCompletion(_stream(kt.NO_TOOL.request())))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    run_scenario(engine, body)


def test_client_cancel_aborts_the_engine_request() -> None:
    """A client that goes away mid-stream cancels the handler, and the engine request is
    aborted (its iterator closed and `abort` called): no orphan generation on the GPU."""
    engine = _engine(block_at=8)
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub) -> None:
        call = stub.StreamChatCompletion(_stream(kt.NO_TOOL.request()))
        received = 0
        async for _ in call:
            received += 1
            if received == 3:
                break
        await asyncio.wait_for(engine.blocked.wait(), 5)
        call.cancel()
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        rid = engine.requests[0][0]
        assert engine.aborted == [rid]
        assert engine.cancelled == [rid]

    run_scenario(engine, body, on_outcome=outcomes.append)
    assert [o.status for o in outcomes] == ["cancelled"]
    assert outcomes[0].completion_tokens == 8  # what the engine generated before the cancel


def test_deadline_aborts_the_engine_request() -> None:
    """A deadline that expires mid-generation aborts the engine request too (unary)."""
    engine = _engine(block_at=4)

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(_unary(kt.NO_TOOL.request()), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == [engine.requests[0][0]]

    run_scenario(engine, body)

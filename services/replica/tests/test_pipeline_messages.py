"""Anthropic Messages through the real gRPC path (CreateMessage, CountMessageTokens): the
replica's servicer, the scripted engine replaying ids the fixture tokenizer produced from
Kimi-format output, the events read back by the official `anthropic` SDK's own accumulator."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from google.protobuf import json_format

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import EngineOutput
from inferplane.replica.server import RequestOutcome
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_ids,
    run_scenario,
    script,
)

Stub = inference_pb2_grpc.InferenceServiceStub
EOS = "<|im_end|>"


def anthropic_tools(names: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in kt.tools(*names)
    ]


def body_of(case: kt.CanonicalCase, **extra: Any) -> apb.MessagesRequest:
    body: dict[str, Any] = {
        "model": kt.SERVED_MODEL_NAME,
        "max_tokens": 1200,
        "messages": [dict(m) for m in case.messages],
        "thinking": {"type": "adaptive"} if case.thinking else {"type": "disabled"},
    }
    if case.tool_names:
        body["tools"] = anthropic_tools(case.tool_names)
    body.update(extra)
    return json_format.ParseDict(body, apb.MessagesRequest())


def events_of(data: bytes) -> list[dict[str, Any]]:
    """Server-sent events → their JSON, checking the `event:` line names the data's type."""
    out = []
    for frame in data.decode().split("\n\n"):
        if not frame:
            continue
        event_line, data_line = frame.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == "event: " + event["type"]
        out.append(event)
    return out


def expected_blocks(case: kt.CanonicalCase) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if case.reasoning:
        blocks.append({"type": "thinking", "thinking": case.reasoning, "signature": ""})
    if case.content:
        blocks.append({"type": "text", "text": case.content})
    for call in case.tool_calls:
        blocks.append({"type": "tool_use", "name": call.name, "input": dict(call.arguments)})
    return blocks


def without_ids(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for block in blocks:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
            block = {k: v for k, v in block.items() if k != "id"}
        out.append(block)
    return out


async def whole_message(stub: Stub, request: apb.MessagesRequest) -> dict[str, Any]:
    messages = [m async for m in stub.CreateMessage(apb.CreateMessageRequest(request=request))]
    assert len(messages) == 1
    return json.loads(messages[0].data)  # type: ignore[no-any-return]


def prompts(engine: ScriptedEngine) -> list[list[int]]:
    return [prompt for _, prompt, _ in engine.requests]


def run(
    outputs: Sequence[EngineOutput],
    body: Any,
    outcomes: list[RequestOutcome] | None = None,
    **engine_options: Any,
) -> None:
    engine = ScriptedEngine(outputs, **engine_options)

    async def with_engine(stub: Stub) -> None:
        await body(stub, engine)

    run_scenario(
        engine, with_engine, on_outcome=outcomes.append if outcomes is not None else lambda _: None
    )


CASES = [kt.WEATHER, kt.THINKING_OFF, kt.NO_TOOL, kt.PARALLEL, kt.NESTED_ARGUMENTS]


@pytest.mark.parametrize("per_increment", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_sdk_assembles_the_stream_into_the_whole_message(
    case: kt.CanonicalCase, per_increment: int
) -> None:
    """The events, accumulated by the anthropic SDK, give the same message as the unary call,
    and both hold exactly the expected thinking, text and tool_use blocks."""
    ids_of = kimi_tiny_ids(case.output + EOS)
    outputs = script(ids_of, per_increment=per_increment)

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = [
            m async for m in stub.CreateMessage(apb.CreateMessageRequest(request=body_of(case)))
        ]
        assert len(unary) == 1 and unary[0].content_type == "application/json"
        whole = json.loads(unary[0].data)
        streamed = [
            m
            async for m in stub.CreateMessage(
                apb.CreateMessageRequest(request=body_of(case, stream=True))
            )
        ]
        assert streamed[0].content_type == "text/event-stream"
        events = events_of(b"".join(m.data for m in streamed))
        snapshot = None
        json_bufs: dict[int, bytes] = {}
        for event in events:
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
        assert snapshot is not None
        assembled = snapshot.model_dump(mode="json", exclude_none=True)
        assert without_ids(whole["content"]) == expected_blocks(case)
        assert without_ids(assembled["content"]) == expected_blocks(case)
        reason = "tool_use" if case.tool_calls else "end_turn"
        assert whole["stop_reason"] == assembled["stop_reason"] == reason
        assert whole["id"].startswith("msg_") and whole["type"] == "message"
        assert whole["usage"]["output_tokens"] == len(ids_of)
        assert whole["usage"]["cache_creation_input_tokens"] == 0
        assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
        assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]

    run(outputs, body)


def test_event_order_and_block_indexes() -> None:
    """thinking → text never interleave: each block starts, gets its deltas and stops before
    the next starts, indexes counting up from 0; tool input arrives as input_json_delta."""
    case = kt.WEATHER
    outputs = script(kimi_tiny_ids(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = apb.CreateMessageRequest(request=body_of(case, stream=True))
        events = events_of(b"".join([m.data async for m in stub.CreateMessage(request)]))
        open_block: int | None = None
        started = []
        for event in events:
            if event["type"] == "content_block_start":
                assert open_block is None
                open_block = event["index"]
                started.append((event["index"], event["content_block"]["type"]))
            elif event["type"] == "content_block_delta":
                assert event["index"] == open_block
            elif event["type"] == "content_block_stop":
                assert event["index"] == open_block
                open_block = None
        assert open_block is None
        assert started == [(0, "thinking"), (1, "tool_use")]
        kinds = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
        assert kinds == {"thinking_delta", "input_json_delta"}
        delta = next(e for e in events if e["type"] == "message_delta")
        assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}

    run(outputs, body)


def test_omitted_thinking_and_thinking_off_show_no_thinking_text() -> None:
    case = kt.NO_TOOL
    outputs = script(kimi_tiny_ids(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        omitted = body_of(case, thinking={"type": "adaptive", "display": "omitted"})
        whole = await whole_message(stub, omitted)
        assert whole["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
        streamed = body_of(case, thinking={"type": "adaptive", "display": "omitted"}, stream=True)
        events = events_of(
            b"".join(
                [
                    m.data
                    async for m in stub.CreateMessage(apb.CreateMessageRequest(request=streamed))
                ]
            )
        )
        assert not [e for e in events if e.get("delta", {}).get("type") == "thinking_delta"]
        # The engine saw thinking on for both: the prompt opened <think>.
        assert all(kimi_tiny_ids("<think>")[0] in p for p in prompts(engine)[-2:])

    run(outputs, body)


def test_a_stop_sequence_is_reported() -> None:
    case = kt.NO_TOOL
    outputs = script(kimi_tiny_ids(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = body_of(case, stop_sequences=["short note"])
        whole = await whole_message(stub, request)
        assert whole["stop_reason"] == "stop_sequence"
        assert whole["stop_sequence"] == "short note"
        # The text before the stop sequence (the parser trims trailing white space).
        assert whole["content"][-1] == {"type": "text", "text": "Here is a"}

    run(outputs, body)


def test_max_tokens_is_the_stop_reason_when_output_is_cut() -> None:
    case = kt.NO_TOOL
    ids = kimi_tiny_ids(case.output)[:5]
    outputs = script(ids, finish_reason="length")

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = body_of(case, stream=True, max_tokens=5)
        events = events_of(
            b"".join(
                [
                    m.data
                    async for m in stub.CreateMessage(apb.CreateMessageRequest(request=request))
                ]
            )
        )
        delta = next(e for e in events if e["type"] == "message_delta")
        assert delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] == 5

    run(outputs, body)


def test_an_engine_failure_after_the_first_byte_is_an_error_event() -> None:
    case = kt.NO_TOOL
    outputs = script(kimi_tiny_ids(case.output + EOS), per_increment=4)

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = apb.CreateMessageRequest(request=body_of(case, stream=True))
        events = events_of(b"".join([m.data async for m in stub.CreateMessage(request)]))
        assert events[0]["type"] == "message_start"
        assert events[-1] == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": events[-1]["error"]["message"]},
        }
        assert not [e for e in events if e["type"] == "message_stop"]

    outcomes: list[RequestOutcome] = []
    run(outputs, body, outcomes, fail_at=2)
    assert outcomes[-1].api == "messages"
    assert outcomes[-1].ending.finish_reason == "error"


def test_a_refused_request_is_invalid_argument_before_any_output() -> None:
    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        image = body_of(
            kt.NO_TOOL,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}],
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.CreateMessage(apb.CreateMessageRequest(request=image))]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "image" in (info.value.details() or "")
        assert engine.requests == []

    run([], body)


def test_count_tokens_is_the_rendered_prompt() -> None:
    """The count equals the prompt the same request generates from, and costs no tokens."""
    case = kt.WEATHER
    outputs = script(kimi_tiny_ids(case.output + EOS))
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = body_of(case)
        counted = await stub.CountMessageTokens(apb.CountMessageTokensRequest(request=request))
        [m async for m in stub.CreateMessage(apb.CreateMessageRequest(request=request))]
        assert counted.input_tokens == len(prompts(engine)[-1])
        bigger = body_of(case, system="A longer system prompt than before.")
        assert (
            await stub.CountMessageTokens(apb.CountMessageTokensRequest(request=bigger))
        ).input_tokens > counted.input_tokens

    run(outputs, body, outcomes)
    count = outcomes[0]
    assert count.api == "messages" and count.prompt_tokens == 0


def test_the_next_turn_renders_the_call_id_the_model_wrote() -> None:
    """The tool_use id the client got carries the model's own `functions.get_weather:7`: sending
    the call and its result back renders that id, so the next prompt begins with this turn's
    prompt and output as generated (the prefix cache can serve it)."""
    case = kt.WEATHER
    # A number the renderer would not give a client's id (that would be :0): the model's own.
    output = case.output.replace("functions.get_weather:0", "functions.get_weather:7")
    outputs = script(kimi_tiny_ids(output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        first = await whole_message(stub, body_of(case))
        (call,) = [b for b in first["content"] if b["type"] == "tool_use"]
        history = [
            {"role": "user", "content": case.messages[0]["content"]},
            {"role": "assistant", "content": first["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18"}],
            },
        ]
        await whole_message(stub, body_of(case, messages=history))
        backend = kimi_tiny_assets().backend
        rendered = backend.decode(prompts(engine)[-1], skip_special_tokens=False)
        assert "functions.get_weather:7" in rendered and call["id"] not in rendered

    run(outputs, body)

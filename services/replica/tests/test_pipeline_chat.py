"""Chat completions through the real gRPC path: in-process server with the pipeline's servicer,
the generated stub as client, and a scripted engine replaying token ids that the REAL fixture
tokenizer (models/kimi-tiny) produced from Kimi-format model output."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import EngineOutput
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
EOS = "<|im_end|>"
ids_of = kimi_tiny_ids


def run(
    outputs: Sequence[EngineOutput],
    body: Callable[[Stub, ScriptedEngine], Awaitable[None]],
    *,
    strict: bool = False,
    outcomes: list[RequestOutcome] | None = None,
) -> None:
    """Serves one fixture-model replica whose engine replays `outputs`; runs `body`."""
    engine = ScriptedEngine(outputs)

    async def with_engine(stub: Stub) -> None:
        await body(stub, engine)

    run_scenario(
        engine,
        with_engine,
        strict_tool_calls=strict,
        on_outcome=outcomes.append if outcomes is not None else (lambda _: None),
    )


def chat(case: kt.CanonicalCase, **extra: Any) -> pb.ChatCompletionRequest:
    return chat_request_from_dict(case.request(**extra))


def assemble(chunks: Sequence[pb.StreamChatCompletionResponse]) -> dict[str, Any]:
    """What an OpenAI client assembles from the chunks."""
    reasoning, content = [], []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for c in chunks:
        for choice in c.choices:
            d = choice.delta
            reasoning.append(d.reasoning_content)
            content.append(d.content)
            for tc in d.tool_calls:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.HasField("id"):
                    call["id"] = tc.id
                    call["name"] = tc.function.name
                call["arguments"] += tc.function.arguments
            if choice.HasField("finish_reason"):
                finish = choice.finish_reason
    return {
        "reasoning": "".join(reasoning) or None,
        "content": "".join(content) or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


def from_message(response: pb.CreateChatCompletionResponse) -> dict[str, Any]:
    choice = response.choices[0]
    m = choice.message
    content = None if m.content.WhichOneof("kind") == "null_value" else m.content.string_value
    return {
        "reasoning": m.reasoning_content if m.HasField("reasoning_content") else None,
        "content": content or None,
        "tool_calls": [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in m.tool_calls
        ],
        "finish_reason": choice.finish_reason,
    }


def expected(case: kt.CanonicalCase) -> dict[str, Any]:
    return {
        "reasoning": case.reasoning,
        "content": case.content,
        "tool_calls": [
            {"id": t.id, "name": t.name, "arguments": t.arguments} for t in case.tool_calls
        ],
        "finish_reason": case.finish_reason,
    }


def parsed(d: dict[str, Any]) -> dict[str, Any]:
    return {
        **d,
        "tool_calls": [{**t, "arguments": json.loads(t["arguments"])} for t in d["tool_calls"]],
    }


CASES = [
    kt.WEATHER,
    kt.URGENT,
    kt.THINKING_OFF,
    kt.NO_TOOL,
    kt.PARALLEL,
    kt.NESTED_ARGUMENTS,
    kt.EMPTY_ARGUMENTS,
    kt.TOOL_LOOP_FOLLOWUP,
    kt.SECOND_TURN,
]


@pytest.mark.parametrize(
    ("per_increment", "separate_finish"), [(1, False), (3, False), (1, True), (2, True)]
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_streamed_chunks_assemble_to_the_unary_response_and_the_expected_parse(
    case: kt.CanonicalCase, per_increment: int, separate_finish: bool
) -> None:
    """For every canonical Kimi output (reasoning then </think>, tool calls, the skip-</think>
    case, thinking off, parallel calls, a tool loop), the streamed chunks assemble to exactly the
    unary response, and both equal the expected reasoning / content / tool calls; the final
    <|im_end|> never shows, whether it comes with the finish or (as vLLM's gRPC stream sends
    it) in the chunk before an empty finishing message."""
    outputs = script(
        ids_of(case.output + EOS), per_increment=per_increment, separate_finish=separate_finish
    )

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=chat(case))
            )
        ]
        streamed = assemble(chunks)
        assert streamed == from_message(unary)
        assert parsed(streamed) == expected(case)
        for text in (streamed["reasoning"] or "", streamed["content"] or ""):
            assert "<|" not in text and "</think>" not in text
        assert unary.usage.completion_tokens == len(ids_of(case.output + EOS))

    run(outputs, body)


def test_chunk_shapes_follow_openai() -> None:
    """Same id/created/model everywhere; first chunk role+"" content; a tool call's first
    delta carries index, id, type, name and "" arguments, later ones only fragments; the last
    choice chunk has finish_reason; include_usage adds one chunk with no choices and usage."""
    case = kt.WEATHER
    outputs = script(ids_of(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = chat(case, stream_options={"include_usage": True})
        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=request)
            )
        ]
        assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1
        assert chunks[0].id.startswith("chatcmpl-") and chunks[0].object == "chat.completion.chunk"
        assert chunks[0].model == kt.SERVED_MODEL_NAME
        assert chunks[0].system_fingerprint == "rev-1"
        first = chunks[0].choices[0]
        assert first.delta.role == "assistant" and first.delta.HasField("content")
        assert first.delta.content == "" and not first.HasField("finish_reason")
        assert all(not c.choices[0].delta.HasField("role") for c in chunks[1:-1])
        # One chunk per visible engine increment: no empty deltas in between.
        for c in chunks[1:-2]:
            d = c.choices[0].delta
            assert d.content or d.reasoning_content or d.tool_calls
        call_deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls]
        head = call_deltas[0]
        assert (head.index, head.id, head.type, head.function.name) == (
            0,
            "functions.get_weather:0",
            "function",
            "get_weather",
        )
        assert head.function.HasField("arguments") and head.function.arguments == ""
        for tc in call_deltas[1:]:
            assert tc.index == 0 and not tc.HasField("id") and not tc.HasField("type")
            assert not tc.function.HasField("name") and tc.function.arguments
        finishing = [c for c in chunks if c.choices and c.choices[0].HasField("finish_reason")]
        assert finishing == [chunks[-2]] and finishing[0].choices[0].finish_reason == "tool_calls"
        assert not chunks[-1].choices and chunks[-1].HasField("usage")
        assert all(not c.HasField("usage") for c in chunks[:-1])

    run(outputs, body)


def test_usage_counts_prompt_completion_reasoning_and_cached_tokens() -> None:
    """Usage is always in unary responses: prompt tokens (engine's count), completion tokens
    (eos included, as vLLM counts), cached tokens from the engine, and reasoning tokens = the
    tokens generated while the parser was in reasoning (here: up to and including </think>)."""
    case = kt.WEATHER
    reasoning_ids = ids_of(case.reasoning + "</think>")
    output_ids = ids_of(case.output + EOS)
    outputs = script(output_ids, cached_tokens=96)

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        u = unary.usage
        prompt_ids = engine.requests[0][1]
        assert u.prompt_tokens == len(prompt_ids) > 100
        assert u.completion_tokens == len(output_ids)
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.prompt_tokens_details.cached_tokens == 96
        assert u.completion_tokens_details.reasoning_tokens == len(reasoning_ids)
        assert unary.choices[0].message.content.WhichOneof("kind") == "null_value"
        assert unary.choices[0].logprobs.WhichOneof("kind") == "null_value"

    run(outputs, body)


def test_thinking_off_counts_no_reasoning_tokens() -> None:
    """With thinking off the output never enters reasoning: reasoning_tokens is 0."""
    case = kt.THINKING_OFF
    outputs = script(ids_of(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        assert unary.usage.completion_tokens_details.reasoning_tokens == 0
        assert unary.choices[0].finish_reason == "tool_calls"

    run(outputs, body)


def test_stop_string_is_cut_out_and_the_engine_request_aborted() -> None:
    """A stop string ends the output before it (the stop text never reaches the client, even
    split across tokens and chunks); finish_reason is stop; the engine request is aborted when
    the engine would have run on."""
    case = kt.NO_TOOL
    outputs = script(ids_of(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        request = chat(case, stop=["short note", "never"])
        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=request)
            )
        ]
        streamed = assemble(chunks)
        assert streamed["content"] == "Here is a"
        assert streamed["reasoning"] == case.reasoning
        assert streamed["finish_reason"] == "stop"
        assert all("short" not in c.choices[0].delta.content for c in chunks if c.choices)
        rid = engine.requests[0][0]
        assert rid in engine.aborted
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=request))
        assert unary.choices[0].message.content.string_value == "Here is a"
        assert engine.requests[1][2].stop == ("short note", "never")

    run(outputs, body)


def test_length_finish_when_max_tokens_is_hit() -> None:
    """An engine that stops on max_tokens gives finish_reason length, even inside tool calls."""
    case = kt.WEATHER
    ids = ids_of(case.output)[:20]
    outputs = script(ids, finish_reason="length")

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=chat(case, max_completion_tokens=20))
        )
        assert unary.choices[0].finish_reason == "length"
        assert engine.requests[0][2].max_tokens == 20
        assert unary.usage.completion_tokens == 20

    run(outputs, body)


def test_unicode_split_across_tokens_never_shows_a_replacement_character() -> None:
    """Multi-byte characters whose bytes span several byte-level tokens arrive whole: no
    U+FFFD in any chunk, and the text equals the model's."""
    text = "Ünïcödé: 日本語のテキスト 😀🎉 ok"
    ids = ids_of("Thinking é😀.</think>" + text + EOS)
    assert len(ids) > len(text) // 2  # the fixture's BPE splits these characters into bytes
    outputs = script(ids)

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=chat(kt.NO_TOOL))
            )
        ]
        pieces = [c.choices[0].delta.content for c in chunks if c.choices]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == text
        assert assemble(chunks)["reasoning"] == "Thinking é😀."

    run(outputs, body)


def test_tool_choice_required_and_named_send_the_tool_constraint() -> None:
    """tool_choice required / a named function send build_tool_constraint's structural tag;
    auto sends none; response_format json_schema sends a JSON constraint."""
    case = kt.WEATHER
    outputs = script(ids_of(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named, "auto"):
            await stub.CreateChatCompletion(
                pb.CreateChatCompletionRequest(request=chat(case, tool_choice=choice))
            )
        required, forced, auto = (r[2].constraint for r in engine.requests)
        assert required is not None and required.kind == "structural_tag"
        assert forced is not None and forced.kind == "structural_tag"
        assert "functions.get_weather:" in forced.value and "get_time" not in forced.value
        assert "get_time" in required.value
        assert auto is None
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(
                request=chat(
                    kt.THINKING_OFF,
                    tool_choice="none",
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": schema},
                    },
                )
            )
        )
        # Thinking off, the whole output is the JSON value, whose strings cannot hold the
        # model's markers (a structural tag: vLLM's json_schema has no exclusions).
        constraint = engine.requests[-1][2].constraint
        assert constraint is not None and constraint.kind == "structural_tag"
        answer = json.loads(constraint.value)["format"]
        assert answer["type"] == "json_schema" and answer["json_schema"] == schema
        assert answer["excludes"] == ["<|", "think>"]
        # With thinking on the output starts inside <think>: reasoning, </think>, then JSON.
        await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(
                request=chat(kt.NO_TOOL, response_format={"type": "json_object"})
            )
        )
        constraint = engine.requests[-1][2].constraint
        assert constraint is not None and constraint.kind == "structural_tag"
        reasoning, value = json.loads(constraint.value)["format"]["elements"]
        assert reasoning["end"] == "</think>"
        assert value == {
            "type": "json_schema",
            "json_schema": {"type": "object"},
            "excludes": ["<|", "think>"],
            "max_whitespace_cnt": 8,
        }

    run(outputs, body)


def test_a_replica_with_constrain_tool_choice_auto_constrains_auto() -> None:
    """A replica whose profile turns `constrain_tool_choice_auto` on sends auto requests with
    tools (tool_choice "auto" or absent) under the tool section's structural tag, one call only
    when `parallel_tool_calls` is false; without tools, with "none", or with a response_format
    JSON constraint, the request is as on any replica."""
    case = kt.WEATHER
    spec = kimi_tiny_spec()  # a private copy: the change must not reach later tests
    spec.constrain_tool_choice_auto = True
    engine = ScriptedEngine(script(ids_of(case.output + EOS)))

    async def body(stub: Stub) -> None:
        async def constraint(request: pb.ChatCompletionRequest) -> Any:
            await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=request))
            return engine.requests[-1][2].constraint

        for extra in ({"tool_choice": "auto"}, {}):
            auto = await constraint(chat(case, **extra))
            assert auto is not None and auto.kind == "structural_tag"
            fmt = json.loads(auto.value)["format"]
            assert fmt["type"] == "triggered_tags" and fmt["stop_after_first"] is False
            (section,) = fmt["tags"]
            assert [t["begin"] for t in section["content"]["tags"]] == [
                "<|tool_call_begin|>functions.get_weather:",
                "<|tool_call_begin|>functions.web_search:",
                "<|tool_call_begin|>functions.get_time:",
            ]
        single = await constraint(chat(case, parallel_tool_calls=False))
        fmt = json.loads(single.value)["format"]
        assert fmt["stop_after_first"] is True
        assert fmt["tags"][0]["content"]["stop_after_first"] is True
        assert await constraint(chat(case, tool_choice="none")) is None
        assert await constraint(chat(kt.NO_TOOL, tools=None)) is None
        json_mode = await constraint(chat(case, response_format={"type": "json_object"}))
        assert json_mode is not None
        fmt = json.loads(json_mode.value)["format"]
        answer = fmt["elements"][-1]
        assert answer["type"] == "json_schema" and answer["json_schema"] == {"type": "object"}

    run_scenario(engine, body, replicas=[FakeReplica("r1", spec, engine)])


def test_sampling_parameters_are_mapped_faithfully() -> None:
    """Every OpenAI / vLLM sampling field reaches the engine unchanged; the chat default for
    max tokens is the rest of the context; eos ids become stop token ids; special tokens are
    never skipped (Kimi's markers must reach the parser)."""
    case = kt.NO_TOOL
    outputs = script(ids_of(case.output + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        request = chat(
            case,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            max_tokens=100,
            stop="END",
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            min_tokens=3,
            logit_bias={"5": 10, "7": -100},
        )
        await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=request))
        (_, prompt_ids, default), (_, _, p) = engine.requests
        assert default.max_tokens == 2048 - len(prompt_ids)
        assert default.temperature is None and default.stop == ()
        assert default.skip_special_tokens is False
        assert default.stop_token_ids == tuple(sorted(kimi_tiny_assets().eos_token_ids))
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == pytest.approx((0.7, 0.9, 40, 0.05))
        assert (p.max_tokens, p.stop, p.seed, p.min_tokens) == (100, ("END",), 7, 3)
        assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
        assert p.repetition_penalty == pytest.approx(1.1)
        assert dict(p.logit_bias) == {5: 10.0, 7: -100.0}

    run(outputs, body)


def test_tool_choice_none_leaves_tools_out_and_drops_calls() -> None:
    """tool_choice none: the tools are not rendered into the prompt, and a tool call the model
    makes anyway is not returned (finish_reason stop) but counted in the outcome."""
    case = kt.WEATHER
    outputs = script(ids_of(case.output + EOS))
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        unary = await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=chat(case, tool_choice="none"))
        )
        with_tools, without = engine.requests[0][1], engine.requests[1][1]
        assert len(without) < len(with_tools)
        assert not unary.choices[0].message.tool_calls
        assert unary.choices[0].finish_reason == "stop"
        assert unary.choices[0].message.content.string_value == ""

    run(outputs, body, outcomes=outcomes)
    assert [o.dropped_tool_calls for o in outcomes] == [0, len(case.tool_calls)]
    assert [o.finish_reason for o in outcomes] == ["tool_calls", "stop"]


def test_without_tools_a_tool_section_is_dropped_and_counted() -> None:
    """A request that offered no tools never gets a call (OpenAI never returns a call it did
    not offer): the model's tool section is parsed out, finish_reason is stop, and the calls
    are counted in the outcome."""
    case = kt.WEATHER
    outputs = script(ids_of(case.output + EOS))
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        body = {k: v for k, v in case.request().items() if k != "tools"}
        unary = await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))
        )
        assert not unary.choices[0].message.tool_calls
        assert unary.choices[0].finish_reason == "stop"
        assert unary.choices[0].message.reasoning_content == case.reasoning

    run(outputs, body, outcomes=outcomes)
    assert [(o.dropped_tool_calls, o.finish_reason) for o in outcomes] == [(1, "stop")]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    """parallel_tool_calls false under auto: the first call only, also without a constraint."""
    case = kt.PARALLEL
    outputs = script(ids_of(case.output + EOS))
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=chat(case, parallel_tool_calls=False))
        )
        (call,) = unary.choices[0].message.tool_calls
        assert call.id == case.tool_calls[0].id

    run(outputs, body, outcomes=outcomes)
    assert [o.dropped_tool_calls for o in outcomes] == [len(case.tool_calls) - 1]


def test_outcome_records_latency_tokens_and_tool_call_verdicts() -> None:
    """Each request hands one RequestOutcome to the sink: TTFT, ITL gaps, token counts and a
    verdict per tool call (an undeclared tool is invalid, but still returned by default)."""
    case = kt.WEATHER
    bad = case.output.replace("get_weather", "get_wether")
    outputs = script(ids_of(bad + EOS))
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        assert unary.choices[0].message.tool_calls[0].function.name == "get_wether"

    run(outputs, body, outcomes=outcomes)
    (o,) = outcomes
    assert o.status == "ok" and o.api == "chat" and not o.stream and o.replica_id == "r1"
    assert o.finish_reason == "tool_calls"
    assert o.ttft_seconds is not None and o.ttft_seconds > 0
    assert len(o.itl_seconds) == len(outputs) - 1
    assert o.completion_tokens == len(outputs)
    assert [(v.name, v.valid, str(v.reason)) for v in o.tool_call_verdicts] == [
        ("get_wether", False, "unknown_tool")
    ]
    assert not o.marker_leaked


def test_strict_mode_turns_an_invalid_tool_call_into_an_error() -> None:
    """With strict tool calls on, a call that fails validation ends the request with an error
    (code invalid_tool_call) instead of being returned."""
    import grpc

    case = kt.WEATHER
    bad = case.output.replace('"celsius"', '"kelvin"')
    outputs = script(ids_of(bad + EOS))

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(case)))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert dict(info.value.trailing_metadata())["x-openai-error-code"] == "invalid_tool_call"
        call = stub.StreamChatCompletion(pb.StreamChatCompletionRequest(request=chat(case)))
        with pytest.raises(grpc.aio.AioRpcError):
            async for c in call:
                assert not (c.choices and c.choices[0].HasField("finish_reason"))

    run(outputs, body, strict=True)


def _content_chunks(chunks: Sequence[pb.StreamChatCompletionResponse]) -> int:
    """Chunks that carry generated output (not the role chunk, not the usage chunk)."""
    return sum(
        1
        for c in chunks
        for ch in c.choices
        if ch.delta.reasoning_content or ch.delta.content or len(ch.delta.tool_calls)
    )


@pytest.mark.parametrize("interval", [2, 5])
@pytest.mark.parametrize("case", [kt.PARALLEL, kt.URGENT, kt.NO_TOOL], ids=lambda c: c.name)
def test_stream_interval_merges_tokens_into_fewer_chunks_with_the_same_result(
    case: kt.CanonicalCase, interval: int
) -> None:
    """`stream_interval` N (vLLM's extension): the engine delivers one token per increment,
    the client gets the first token at once and then one chunk per N tokens at most, and the
    chunks still assemble to exactly the expected reasoning / content / tool calls; the engine
    is asked for the same interval (the HTTP transport lets the engine merge too)."""
    ids = ids_of(case.output + EOS)
    outputs = script(ids, per_increment=1)

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        every = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=chat(case))
            )
        ]
        merged = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=chat(case, stream_interval=interval))
            )
        ]
        assert parsed(assemble(merged)) == parsed(assemble(every)) == expected(case)
        # the first token alone, then at most one chunk per `interval` tokens, then the finish
        assert _content_chunks(merged) <= 2 + (len(ids) - 1) // interval
        assert _content_chunks(merged) < _content_chunks(every)
        assert engine.requests[0][2].stream_interval is None
        assert engine.requests[1][2].stream_interval == interval

    run(outputs, body)


def test_replica_stream_interval_is_the_floor_of_the_requests() -> None:
    """A replica deployed with stream_interval 4 streams at least 4 tokens per chunk whatever
    the request asks (vLLM clamps a request's interval to the engine's the same way); a request
    may ask for more; 0 or a value above 1024 is a 400 naming the parameter."""
    case = kt.PARALLEL
    spec = kimi_tiny_spec()  # a private copy: the change must not reach later tests
    spec.stream_interval = 4
    engine = ScriptedEngine(script(ids_of(case.output + EOS), per_increment=1))

    async def body(stub: Stub) -> None:
        for asked, sent in ((None, 4), (2, 4), (8, 8)):
            extra = {} if asked is None else {"stream_interval": asked}
            chunks = [
                c
                async for c in stub.StreamChatCompletion(
                    pb.StreamChatCompletionRequest(request=chat(case, **extra))
                )
            ]
            assert parsed(assemble(chunks)) == expected(case)
            assert engine.requests[-1][2].stream_interval == sent
        for bad in (0, 1025):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.CreateChatCompletion(
                    pb.CreateChatCompletionRequest(request=chat(case, stream_interval=bad))
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "stream_interval" in (err.value.details() or "")

    run_scenario(engine, body, replicas=[FakeReplica("r1", spec, engine)])


def test_itl_is_per_token_when_increments_carry_several_tokens() -> None:
    """An engine increment of n tokens (stream interval, merged reads) stands for n inter-token
    gaps of a n-th of its wait each, so ITL telemetry means the same whatever the chunking."""
    ids = ids_of(kt.NO_TOOL.output + EOS)
    outputs = script(ids, per_increment=3)
    outcomes: list[RequestOutcome] = []

    async def body(stub: Stub, engine: ScriptedEngine) -> None:
        await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat(kt.NO_TOOL)))

    run(outputs, body, outcomes=outcomes)
    (o,) = outcomes
    assert len(o.itl_seconds) == len(ids) - len(outputs[0].token_ids)
    # The fake clock advances 10 ms per reading, one reading per increment: 3 tokens each
    # (the last increment may carry fewer) share the 10 ms.
    start = 0
    for out in outputs[1:]:
        n = len(out.token_ids)
        assert o.itl_seconds[start : start + n] == pytest.approx([0.01 / n] * n)
        start += n

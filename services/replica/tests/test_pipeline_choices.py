"""`n` > 1, logprobs, continuous usage and vLLM's honoured fields, through the replica's real
gRPC path on a scripted engine (kimi-tiny's tokenizer)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import EngineOutput, SamplingParams, TokenLogprob
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_ids,
    run_scenario,
    script,
)
from inferplane.wire import chat_request_from_dict, completion_request_from_dict

Stub = inference_pb2_grpc.InferenceServiceStub
TEXT = " Paris is the capital of France."


def _with_logprobs(outputs: list[EngineOutput], params: SamplingParams) -> list[EngineOutput]:
    """The script with a TokenLogprob per id when the request asked (alternatives: id + j)."""
    if params.logprobs is None:
        return outputs
    k = params.logprobs
    return [
        dataclasses.replace(
            out,
            logprobs=tuple(
                TokenLogprob(t, -0.5, tuple((t + j, -0.5 - j) for j in range(k)))
                for t in out.token_ids
            ),
        )
        for out in outputs
    ]


def _engine(text: str = TEXT) -> ScriptedEngine:
    ids = kimi_tiny_ids(text + "<|im_end|>")
    return ScriptedEngine(lambda params: _with_logprobs(script(ids, per_increment=2), params))


def _chat(**body: Any) -> pb.ChatCompletionRequest:
    return chat_request_from_dict(
        {
            "model": kt.SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "reasoning_effort": "none",
            **body,
        }
    )


def _value(value: Any) -> Any:
    return json_format.MessageToDict(value)


def test_chat_n_choices_unary_and_streamed() -> None:
    """n=2: two engine requests (seed, seed + 1), choices 0 and 1 each with the whole text,
    usage summing both; streamed, each choice has its role chunk and its finish, and the
    chunks rebuild each choice's text."""
    engine = _engine()
    expected = len(kimi_tiny_ids(TEXT + "<|im_end|>"))

    async def body(stub: Stub) -> None:
        request = _chat(n=2, seed=7, stream_options={"include_usage": True})
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=request))
        assert [c.index for c in unary.choices] == [0, 1]
        # The chat parser drops the leading space of content, as for one choice.
        assert all(c.message.content.string_value == TEXT.lstrip() for c in unary.choices)
        assert all(c.finish_reason == "stop" for c in unary.choices)
        assert unary.usage.completion_tokens == 2 * expected
        seeds = sorted(p.seed for _, _, p in engine.requests[-2:])
        assert seeds == [7, 8]
        ids = {rid for rid, _, _ in engine.requests[-2:]}
        assert ids == {unary.id, unary.id + "-1"}

        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=request)
            )
        ]
        texts = {0: "", 1: ""}
        roles, finishes = [], []
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.delta.HasField("role"):
                    roles.append(choice.index)
                texts[choice.index] += choice.delta.content
                if choice.HasField("finish_reason"):
                    finishes.append(choice.index)
        assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
        assert texts == {0: TEXT.lstrip(), 1: TEXT.lstrip()}
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 2 * expected

    run_scenario(engine, body)


def test_chat_logprobs_unary_and_streamed() -> None:
    """logprobs + top_logprobs 3: one content entry per shown token (the hidden <|im_end|> has
    none), each with its token text, bytes and 3 alternatives; streamed, the entries of all
    chunks are the unary's; continuous_usage_stats puts the usage so far on every chunk."""
    engine = _engine()
    shown = kimi_tiny_ids(TEXT)
    tokenizer = kimi_tiny_assets().backend

    async def body(stub: Stub) -> None:
        request = _chat(
            logprobs=True,
            top_logprobs=3,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=request))
        content = _value(unary.choices[0].logprobs)["content"]
        assert len(content) == len(shown)
        first = content[0]
        assert first["token"] == tokenizer.decode([shown[0]], skip_special_tokens=False)
        assert first["bytes"] == [float(b) for b in first["token"].encode()]
        assert first["logprob"] == -0.5 and len(first["top_logprobs"]) == 3
        assert "".join(e["token"] for e in content) == TEXT
        assert engine.requests[-1][2].logprobs == 3

        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=request)
            )
        ]
        streamed = [
            e
            for c in chunks
            for choice in c.choices
            if choice.HasField("logprobs")
            for e in _value(choice.logprobs)["content"]
        ]
        assert streamed == content
        assert all(c.HasField("usage") for c in chunks)
        usage = [c.usage.completion_tokens for c in chunks]
        assert usage == sorted(usage) and usage[-1] == unary.usage.completion_tokens

    run_scenario(engine, body)


def test_completion_logprobs_and_n() -> None:
    """Text completions: logprobs k gives tokens / token_logprobs / top_logprobs (k per token)
    / text_offset counted from the end of the echoed prompt; n=2 gives choices 0 and 1."""
    engine = _engine()

    async def body(stub: Stub) -> None:
        request = completion_request_from_dict(
            {"model": kt.SERVED_MODEL_NAME, "prompt": "Q:", "echo": True, "logprobs": 2, "n": 2}
        )
        unary = await stub.CreateCompletion(pb.CreateCompletionRequest(request=request))
        assert [c.index for c in unary.choices] == [0, 1]
        logprobs = _value(unary.choices[0].logprobs)
        assert "".join(logprobs["tokens"]) == TEXT
        assert unary.choices[0].text == "Q:" + TEXT
        assert logprobs["text_offset"][0] == len("Q:")
        assert all(len(top) == 2 for top in logprobs["top_logprobs"])
        assert set(logprobs["token_logprobs"]) == {-0.5}
        chunks = [
            c async for c in stub.StreamCompletion(pb.StreamCompletionRequest(request=request))
        ]
        tokens = [
            t
            for c in chunks
            for choice in c.choices
            if choice.index == 1 and choice.HasField("logprobs")
            for t in _value(choice.logprobs)["tokens"]
        ]
        assert "".join(tokens) == TEXT

    run_scenario(engine, body)


def test_honoured_vllm_fields_reach_the_engine() -> None:
    """stop_token_ids join the model's eos ids; guided_choice becomes the engine's choice
    constraint; include_stop_str_in_output keeps the stop string; a history message's
    `reasoning` renders as reasoning_content does."""
    engine = _engine()

    async def body(stub: Stub) -> None:
        request = _chat(
            stop_token_ids=[42],
            guided_choice=["yes", "no"],
            stop=["capital"],
            include_stop_str_in_output=True,
        )
        unary = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=request))
        params = engine.requests[-1][2]
        assert 42 in params.stop_token_ids
        assert params.constraint is not None and params.constraint.kind == "choice"
        assert json.loads(params.constraint.value) == ["yes", "no"]
        assert unary.choices[0].message.content.string_value == "Paris is the capital"

        history = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ]
        with_reasoning = [dict(m) for m in history]
        with_reasoning[1]["reasoning"] = "greet back"
        with_content = [dict(m) for m in history]
        with_content[1]["reasoning_content"] = "greet back"
        await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=_chat(messages=with_reasoning))
        )
        await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=_chat(messages=with_content))
        )
        assert engine.requests[-1][1] == engine.requests[-2][1]

    run_scenario(engine, body)


def test_include_reasoning_false_leaves_reasoning_out() -> None:
    """With thinking on the model reasons; include_reasoning false answers without it (unary
    and streamed) while the usage still counts the reasoning tokens."""
    engine = ScriptedEngine(script(kimi_tiny_ids("Let me think.</think>Paris.<|im_end|>")))

    async def body(stub: Stub) -> None:
        plain = chat_request_from_dict(
            {
                "model": kt.SERVED_MODEL_NAME,
                "messages": [{"role": "user", "content": "Capital of France?"}],
                "chat_template_kwargs": {"thinking": True},
            }
        )
        shown = await stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=plain))
        assert shown.choices[0].message.reasoning_content == "Let me think."
        hidden_request = chat_request_from_dict(
            {
                **json_format.MessageToDict(plain, preserving_proto_field_name=True),
                "include_reasoning": False,
            }
        )
        hidden = await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=hidden_request)
        )
        message = hidden.choices[0].message
        assert not message.HasField("reasoning_content")
        assert message.content.string_value == "Paris."
        assert hidden.usage.completion_tokens_details.reasoning_tokens > 0
        chunks = [
            c
            async for c in stub.StreamChatCompletion(
                pb.StreamChatCompletionRequest(request=hidden_request)
            )
        ]
        assert not any(ch.delta.HasField("reasoning_content") for c in chunks for ch in c.choices)
        assert "".join(ch.delta.content for c in chunks for ch in c.choices) == "Paris."

    run_scenario(engine, body)


def test_logprobs_survive_a_separate_finish_and_held_text() -> None:
    """vLLM's gRPC stream: the end-of-turn id in the last chunk (held until the finish says it
    ended the output), then a finish without ids or entries; a stop string holds text back.
    Every shown token still gets its entry, the hidden end of turn none."""
    ids = kimi_tiny_ids(TEXT + "<|im_end|>")

    def outputs(params: SamplingParams) -> list[EngineOutput]:
        scripted = _with_logprobs(script(ids, separate_finish=True), params)
        return [o if o.token_ids else dataclasses.replace(o, logprobs=None) for o in scripted]

    engine = ScriptedEngine(outputs)

    async def body(stub: Stub) -> None:
        request = completion_request_from_dict(
            {"model": kt.SERVED_MODEL_NAME, "prompt": "Q:", "logprobs": 1, "stop": ["zzz"]}
        )
        unary = await stub.CreateCompletion(pb.CreateCompletionRequest(request=request))
        tokens = _value(unary.choices[0].logprobs)["tokens"]
        assert "".join(tokens) == unary.choices[0].text == TEXT
        assert len(tokens) == len(ids) - 1

    run_scenario(engine, body)

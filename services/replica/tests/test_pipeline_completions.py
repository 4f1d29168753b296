"""Text completions (/v1/completions) and the model list, through the real gRPC path."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_ids,
    kimi_tiny_spec,
    run_scenario,
    script,
)
from inferplane.wire import completion_request_from_dict

Stub = inference_pb2_grpc.InferenceServiceStub
TEXT = " Paris is the capital of France. 東京 too."


def _request(**body: Any) -> pb.CompletionRequest:
    return completion_request_from_dict({"model": kt.SERVED_MODEL_NAME, **body})


def test_completion_unary_and_stream_agree_and_default_to_16_tokens() -> None:
    """A text completion streams its text in chunks (finish_reason null until the last) that
    join to the unary text; max_tokens defaults to 16 as in OpenAI; no chat template and no
    parser are applied (markers would be plain text)."""
    engine = ScriptedEngine(script(kimi_tiny_ids(TEXT + "<|im_end|>"), per_increment=2))

    async def body(stub: Stub) -> None:
        request = _request(prompt="The capital:", stream_options={"include_usage": True})
        unary = await stub.CreateCompletion(pb.CreateCompletionRequest(request=request))
        chunks = [
            c async for c in stub.StreamCompletion(pb.StreamCompletionRequest(request=request))
        ]
        assert unary.object == "text_completion" and unary.id.startswith("cmpl-")
        assert unary.choices[0].text == TEXT
        assert unary.choices[0].finish_reason.string_value == "stop"
        text_chunks = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in text_chunks) == TEXT
        assert all(not c.choices[0].HasField("finish_reason") for c in text_chunks[:-1])
        assert text_chunks[-1].choices[0].finish_reason.string_value == "stop"
        assert (
            not chunks[-1].choices
            and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
        )
        assert len({(c.id, c.created) for c in chunks}) == 1
        prompt_ids = kimi_tiny_assets().tokenizer.encode("The capital:")
        assert engine.requests[0][1] == prompt_ids
        assert unary.usage.prompt_tokens == len(prompt_ids)
        assert engine.requests[0][2].max_tokens == 16

    run_scenario(engine, body)


def test_completion_takes_token_ids_echoes_and_cuts_stop_strings() -> None:
    """A prompt given as token ids goes to the engine as is; echo prepends the prompt text;
    a stop string is cut out of the text."""
    engine = ScriptedEngine(script(kimi_tiny_ids(TEXT + "<|im_end|>")))
    prompt_ids = kimi_tiny_ids("The capital:")

    async def body(stub: Stub) -> None:
        request = _request(prompt=prompt_ids, echo=True, stop="France", max_tokens=40)
        unary = await stub.CreateCompletion(pb.CreateCompletionRequest(request=request))
        assert engine.requests[0][1] == prompt_ids
        assert unary.choices[0].text == "The capital: Paris is the capital of "
        assert unary.choices[0].finish_reason.string_value == "stop"
        chunks = [
            c async for c in stub.StreamCompletion(pb.StreamCompletionRequest(request=request))
        ]
        assert "".join(c.choices[0].text for c in chunks) == unary.choices[0].text

    run_scenario(engine, body)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": "hi", "n": 9}, "n"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "max_tokens": 4096}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_requests_are_400s(body: dict[str, Any], param: str) -> None:
    """Unsupported or invalid completion fields are INVALID_ARGUMENT naming the param."""
    engine = ScriptedEngine(script(kimi_tiny_ids(TEXT)))

    async def scenario(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateCompletion(pb.CreateCompletionRequest(request=_request(**body)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailers = dict(info.value.trailing_metadata())
        assert trailers["x-openai-error-param"] == param

    run_scenario(engine, scenario)


def test_list_models_lists_the_replicas_model() -> None:
    """ListModels: OpenAI's list with the replica's one model (ready or not), owned_by and
    created set, max_model_len included."""
    engine = ScriptedEngine([])
    replicas = [FakeReplica("r1", kimi_tiny_spec(), engine)]
    replicas[0].ready = False

    async def body(stub: Stub) -> None:
        response = await stub.ListModels(pb.ListModelsRequest())
        assert response.object == "list"
        assert [(m.id, m.object, m.owned_by, m.max_model_len) for m in response.data] == [
            (kt.SERVED_MODEL_NAME, "model", "acme", 2048),
        ]
        assert all(m.created == 1_700_000_000 for m in response.data)

    run_scenario(engine, body, replicas=replicas, owned_by="acme")

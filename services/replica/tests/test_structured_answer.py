"""A strict JSON answer's guarantees in the replica's pipeline (issue 27 §5), with the fixture
model's real tokenizer and a scripted engine: the plan sends a constraint whose strings exclude
the model's markers, refuses what would cut the answer or run past it, and the parser keeps a
marker inside a constrained call's JSON string as data while an unconstrained call is still cut
there. The real engine's side is `test_structured_answer_e2e.py`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.pipeline.requests import plan_chat
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    kimi_tiny_assets,
    kimi_tiny_ids,
    run_scenario,
    script,
)
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import chat_request_from_dict

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "x", "strict": True, "schema": SCHEMA},
}


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": kt.SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "What time is it in Lima?"}],
        **extra,
    }


def test_the_fixture_models_marker_texts_are_its_added_tokens_and_markers() -> None:
    texts = kimi_tiny_assets().marker_texts
    for text in ("<|im_assistant|>", "<|im_end|>", "</think>", kt.SECTION_BEGIN, kt.CALL_END):
        assert text in texts
    assert "◁think▷" not in texts  # a variant the tokenizer does not hold is plain text


@pytest.mark.parametrize("thinking", [True, False])
def test_a_json_answer_excludes_the_markers_from_its_strings(thinking: bool) -> None:
    request = body(response_format=JSON_SCHEMA, chat_template_kwargs={"thinking": thinking})
    plan = plan_chat(chat_request_from_dict(request), kimi_tiny_assets())
    constraint = plan.params.constraint
    assert constraint is not None and constraint.kind == "structural_tag"
    fmt = json.loads(constraint.value)["format"]
    answer = fmt["elements"][-1] if thinking else fmt
    assert answer["type"] == "json_schema" and answer["json_schema"] == SCHEMA
    assert answer["excludes"] == ["<|", "think>"]


@pytest.mark.parametrize(
    ("field", "value"), [("stop", ["}"]), ("ignore_eos", True), ("min_tokens", 20)]
)
@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": JSON_SCHEMA},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json": SCHEMA}},
    ],
    ids=["json_schema", "json_object", "structured_outputs"],
)
def test_what_would_cut_a_json_answer_or_run_past_it_is_refused(
    field: str, value: Any, constraint: dict[str, Any]
) -> None:
    request = chat_request_from_dict(body(**constraint, **{field: value}))
    with pytest.raises(InvalidArgumentError) as err:
        plan_chat(request, kimi_tiny_assets())
    assert err.value.param == field
    # Without a JSON answer the same field is served.
    plan_chat(chat_request_from_dict(body(**{field: value})), kimi_tiny_assets())


def test_a_strict_schema_the_grammar_cannot_enforce_is_a_400_and_served_loose_otherwise() -> None:
    """`multipleOf` is compiled but not enforced by xgrammar (its answer grammar): strict, a
    400; not strict, served as before the marker exclusion (thinking off: vLLM's plain
    json_schema, which vLLM hands to a backend that enforces it)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    thinking_off = {"chat_template_kwargs": {"thinking": False}}
    with pytest.raises(InvalidArgumentError) as err:
        plan_chat(
            chat_request_from_dict(body(response_format=fmt, **thinking_off)), kimi_tiny_assets()
        )
    assert err.value.param == "response_format.json_schema.schema"
    assert "properties.n: multipleOf" in str(err.value)
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for request in (
        body(response_format=loose, **thinking_off),
        body(structured_outputs={"json": schema}, **thinking_off),
    ):
        plan = plan_chat(chat_request_from_dict(request), kimi_tiny_assets())
        assert plan.params.constraint is not None
        assert plan.params.constraint.kind == "json_schema"


SNIPPET = '{"snippet": "a <|tool_call_end|> b"}'
SAVE = {
    "type": "function",
    "function": {
        "name": "save",
        "parameters": {
            "type": "object",
            "properties": {"snippet": {"type": "string"}},
            "required": ["snippet"],
        },
    },
}


@pytest.mark.parametrize("constrained", [True, False])
def test_a_marker_in_a_constrained_calls_string_is_data_and_cuts_an_unconstrained_one(
    constrained: bool,
) -> None:
    """`tool_choice: required` decodes the call under the tool grammar (its arguments are JSON
    by construction): the marker the model wrote inside the string stays in the arguments.
    Under `auto` without the profile's constraint the arguments are the model's own text, and
    the marker ends them, as the held-out parser cases say (a model that never closed its
    string must not swallow the rest of the output)."""
    output = (
        f"{kt.SECTION_BEGIN}{kt.CALL_BEGIN}functions.save:0{kt.ARGUMENT_BEGIN}{SNIPPET}"
        f"{kt.CALL_END}{kt.SECTION_END}{kt.EOS}"
    )
    engine = ScriptedEngine(script(kimi_tiny_ids(output)))
    request = body(
        tools=[SAVE],
        tool_choice="required" if constrained else "auto",
        chat_template_kwargs={"thinking": False},
    )

    async def run(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
        response = await stub.CreateChatCompletion(
            pb.CreateChatCompletionRequest(request=chat_request_from_dict(request))
        )
        message = json_format.MessageToDict(response)["choices"][0]["message"]
        (call,) = message["toolCalls"]
        sent = engine.requests[-1][2].constraint
        if constrained:
            assert sent is not None and sent.kind == "structural_tag"
            assert json.loads(call["function"]["arguments"]) == json.loads(SNIPPET)
        else:
            assert sent is None
            assert call["function"]["arguments"].startswith('{"snippet": "a')
            assert kt.CALL_END not in call["function"]["arguments"]
            assert "b" not in call["function"]["arguments"]

    run_scenario(engine, run)

"""The request-field policy (`pipeline/fields.py`) against vLLM's own request models and the
request protos: every field vLLM 0.32 accepts is categorised exactly once, every accepted field
passes the edge (it is a proto field), and refused values name their field."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.replica.pipeline import structured
from inferplane.replica.pipeline.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    EMBEDDING_FIELDS,
    MESSAGE_FIELDS,
    STREAM_OPTIONS_FIELDS,
    FieldRule,
    Treatment,
    refuse_unserved,
)
from inferplane.runtime import InvalidArgumentError

# Fields of ours that vLLM's models do not have: OpenAI's (metadata), vLLM < 0.12's spellings
# of structured_outputs that older clients still send, and a message's reasoning_content
# (vLLM < 0.16's and DeepSeek's name for `reasoning`).
_NOT_IN_VLLM = {"metadata", "reasoning_content", *structured.GUIDED_FIELDS}


def _vllm_models() -> dict[str, set[str]]:
    from vllm.entrypoints.generate.base.protocol import StreamOptions
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest
    from vllm.renderers.chat_utils import CustomChatCompletionMessageParam

    return {
        "chat": set(ChatCompletionRequest.model_fields),
        "completion": set(CompletionRequest.model_fields),
        "embedding": set(EmbeddingCompletionRequest.model_fields),
        "stream_options": set(StreamOptions.model_fields),
        "message": set(typing.get_type_hints(CustomChatCompletionMessageParam)),
    }


TABLES: dict[str, tuple[Mapping[str, FieldRule], Any]] = {
    "chat": (CHAT_FIELDS, pb.ChatCompletionRequest),
    "completion": (COMPLETION_FIELDS, pb.CompletionRequest),
    "embedding": (EMBEDDING_FIELDS, pb.EmbeddingRequest),
    "stream_options": (STREAM_OPTIONS_FIELDS, pb.StreamOptions),
    "message": (MESSAGE_FIELDS, pb.ChatMessage),
}


@pytest.fixture(scope="module")
def vllm_fields() -> dict[str, set[str]]:
    pytest.importorskip("vllm")
    return _vllm_models()


@pytest.mark.parametrize("kind", list(TABLES))
def test_every_vllm_field_is_categorised(kind: str, vllm_fields: dict[str, set[str]]) -> None:
    """A field vLLM adds (an upgrade) fails here until someone decides what it does."""
    table, _ = TABLES[kind]
    missing = vllm_fields[kind] - set(table)
    assert not missing, f"vLLM {kind} fields nobody categorised: {sorted(missing)}"
    extra = set(table) - vllm_fields[kind] - _NOT_IN_VLLM
    assert not extra, f"categorised {kind} fields vLLM does not define: {sorted(extra)}"


@pytest.mark.parametrize("kind", list(TABLES))
def test_accepted_fields_pass_the_edge_and_edge_refusals_do_not(kind: str) -> None:
    """The edge's guard accepts exactly the proto's fields: every field the policy serves,
    ignores or refuses by value must be one; a field left to the edge must not; and every
    proto field is in the table (a proto field nobody categorised is a silent accept)."""
    table, message = TABLES[kind]
    proto = set(message.DESCRIPTOR.fields_by_name)
    for name, rule in table.items():
        if rule.treatment is Treatment.EDGE:
            assert name not in proto, f"{kind}.{name} is refused at the edge but in the proto"
        else:
            assert name in proto, f"{kind}.{name} is {rule.treatment.value} but not in the proto"
    assert proto <= set(table), f"uncategorised proto fields: {sorted(proto - set(table))}"


def test_every_ignored_or_refused_field_says_why() -> None:
    for table, _ in TABLES.values():
        for name, rule in table.items():
            if rule.treatment is not Treatment.HONOURED:
                assert rule.why, name


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"priority": -1}, "priority"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"chat_template": "{{x}}"}, "chat_template"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({"cache_salt": "s"}, "cache_salt"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"thinking_token_budget": 100}, "thinking_token_budget"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"return_token_ids": True}, "return_token_ids"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    ],
)
def test_a_refused_value_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        refuse_unserved(body, CHAT_FIELDS)
    assert info.value.param == param and info.value.code == "unsupported_parameter"
    assert CHAT_FIELDS[param].why in str(info.value)


def test_values_that_ask_for_nothing_pass() -> None:
    """What vLLM-built clients send as defaults is no request for anything."""
    refuse_unserved(
        {
            "use_beam_search": False,
            "priority": 0,
            "length_penalty": 1.0,
            "bad_words": [],
            "allowed_token_ids": None,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "add_generation_prompt": True,
            "continue_final_message": False,
            "echo": False,
            "thinking_token_budget": -1,
            "return_token_ids": False,
            "request_id": "mine",
            "session_id": "s",
            "mm_payload": "tensors",
        },
        CHAT_FIELDS,
    )


def test_structured_outputs_and_guided_fields() -> None:
    assert structured.requested({"guided_regex": "a+"}) == ("guided_regex", "regex", "a+")
    assert structured.requested({"structured_outputs": {"choice": ["a"]}}) == (
        "structured_outputs.choice",
        "choice",
        ["a"],
    )
    assert structured.requested({"structured_outputs": {"json_object": True}}) is not None
    for bad, param in [
        (
            {"structured_outputs": {"disable_any_whitespace": True, "regex": "a"}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            structured.requested(bad)
        assert info.value.param == param
    built = structured.build(
        ("guided_choice", "choice", ["yes", "no"]), thinking=False, syntax=None
    )
    assert (built.kind, built.value) == ("choice", '["yes", "no"]')
    schema = {"type": "object"}
    built = structured.build(("guided_json", "json", schema), thinking=False, syntax=None)
    assert built.kind == "json_schema"
    # With thinking on, JSON follows the reasoning (a structural tag); a regex cannot.
    assert structured.build(("guided_json", "json", schema), thinking=True, syntax=None).kind == (
        "structural_tag"
    )
    with pytest.raises(InvalidArgumentError):
        structured.build(("guided_regex", "regex", "a"), thinking=True, syntax=None)


def test_set_fields_reads_what_the_request_set() -> None:
    from inferplane.replica.pipeline.fields import set_fields

    request = pb.EmbeddingRequest(model="e", priority=0, endianness="big")
    request.input.string_value = "x" * 10
    request.mm_processor_kwargs.update({"a": 1})
    assert set_fields(request, skip=("input",)) == {
        "model": "e",
        "priority": 0,
        "endianness": "big",
        "mm_processor_kwargs": {"a": 1.0},
    }
    with pytest.raises(InvalidArgumentError) as info:
        refuse_unserved(set_fields(request), EMBEDDING_FIELDS)
    assert info.value.param == "endianness"
    refuse_unserved({"endianness": "little", "use_activation": True}, EMBEDDING_FIELDS)

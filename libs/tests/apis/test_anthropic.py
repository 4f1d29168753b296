"""`inferplane.apis.anthropic`: an Anthropic Messages request → the chat request the replica
renders (every block type, tool_choice form, thinking form), its refusals (param paths), and
the stop-reason and error-shape tables."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.apis import anthropic
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import chat_request_to_dict

AGENTS = Path(__file__).resolve().parents[3] / "tests" / "data" / "agents"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
    },
}


def request(**body: Any) -> apb.MessagesRequest:
    full = {"model": "kimi-tiny", "max_tokens": 64, **body}
    full.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json_format.ParseDict(full, apb.MessagesRequest())


def chat(**body: Any) -> dict[str, Any]:
    return chat_request_to_dict(anthropic.to_chat(request(**body)))


def refused(**body: Any) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as info:
        anthropic.to_chat(request(**body))
    return info.value


def test_a_plain_request_maps_onto_chat() -> None:
    out = chat(
        system="Be brief.",
        messages=[{"role": "user", "content": "hi"}],
        stop_sequences=["END"],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        metadata={"user_id": '{"device_id": "d", "session_id": "s"}'},
        stream=True,
    )
    assert out == {
        "model": "kimi-tiny",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "hi"},
        ],
        "max_completion_tokens": 64,
        "stop": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "user": '{"device_id": "d", "session_id": "s"}',
        "reasoning_effort": "none",
        "stream": True,
    }


def test_system_blocks_with_cache_control_become_one_system_message() -> None:
    out = chat(
        system=[
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": " Be careful."},
        ]
    )
    assert out["messages"][0] == {
        "role": "system",
        "content": [
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": " Be careful."},
        ],
    }


def test_a_tool_round_trip_keeps_the_toolu_id_and_the_thinking() -> None:
    out = chat(
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I need get_weather.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "get_weather",
                        "input": {"city": "Tokyo", "days": 2},
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [{"type": "text", "text": "timeout"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    # A Struct keeps no key order: the arguments follow the tool's `required`, then the rest.
    arguments = json.dumps({"city": "Tokyo", "days": 2})
    assert out["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo?"}]},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "I need get_weather.",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": [{"type": "text", "text": "18 C"}]},
        {
            "role": "tool",
            "tool_call_id": "toolu_01",
            "content": [
                {"type": "text", "text": anthropic.ERROR_PREFIX},
                {"type": "text", "text": "timeout"},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    # Integers in the schema stay integers (Struct holds doubles).
    assert out["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": WEATHER_TOOL["input_schema"],
            },
        }
    ]
    minimum = out["tools"][0]["function"]["parameters"]["properties"]["days"]["minimum"]
    assert type(minimum) is int


def test_history_arguments_follow_the_schemas_order_whatever_the_struct_did() -> None:
    tool = {
        "name": "convert",
        "input_schema": {
            "type": "object",
            "properties": {"to": {}, "amount": {}, "from": {}, "note": {}},
            "required": ["amount", "from", "to"],
        },
    }
    use = {"amount": 12.5, "note": "x", "to": "EUR", "from": "USD"}
    out = chat(
        tools=[tool],
        messages=[
            {"role": "user", "content": "convert"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_9", "name": "convert", "input": use}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]},
        ],
    )
    arguments = out["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert arguments == '{"amount": 12.5, "from": "USD", "to": "EUR", "note": "x"}'


@pytest.mark.parametrize(
    ("choice", "tool_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            None,
        ),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any", "disable_parallel_tool_use": False}, "required", None),
    ],
)
def test_tool_choice_forms(choice: dict[str, Any], tool_choice: Any, parallel: bool | None) -> None:
    out = chat(tools=[WEATHER_TOOL], tool_choice=choice)
    assert out["tool_choice"] == tool_choice
    assert out.get("parallel_tool_calls") == parallel


@pytest.mark.parametrize(
    ("thinking", "effort"),
    [
        (None, "none"),
        ({"type": "disabled"}, "none"),
        ({"type": "enabled", "budget_tokens": 1024}, "high"),
        ({"type": "adaptive"}, "high"),
        ({"type": "adaptive", "display": "omitted"}, "high"),
    ],
)
def test_thinking_turns_the_models_thinking_on_or_off(
    thinking: dict[str, Any] | None, effort: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 2048}
    if thinking is not None:
        body["thinking"] = thinking
    assert chat(**body)["reasoning_effort"] == effort
    req = request(**body)
    assert anthropic.thinking_on(req) is (effort == "high")
    assert anthropic.thinking_shown(req) is ((thinking or {}).get("display") != "omitted")


def test_what_claude_code_sends_is_accepted() -> None:
    out = chat(
        tools=[{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "adaptive", "display": "omitted"},
        output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": '{"session_id": "abc"}'},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
        diagnostics={"previous_message_id": None},
        speed="standard",
    )
    assert out["user"] == '{"session_id": "abc"}'
    assert "response_format" not in out


def test_a_system_message_in_the_conversation_stays_in_place() -> None:
    """Claude Code sends its environment as a `system` message after the first user turn."""
    out = chat(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
            {"role": "user", "content": "go"},
        ]
    )
    assert [m["role"] for m in out["messages"]] == ["user", "system", "user"]
    assert out["messages"][1]["content"] == [{"type": "text", "text": "# Environment"}]


def test_deferred_tools_are_declared_once_a_tool_reference_names_them() -> None:
    deferred = {**WEATHER_TOOL, "name": "deferred", "defer_loading": True}
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    first = chat(tools=[search, deferred])
    assert [t["function"]["name"] for t in first["tools"]] == ["ToolSearch"]
    history = [
        {"role": "user", "content": "find a tool"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "tool_reference", "tool_name": "deferred"}],
                }
            ],
        },
    ]
    later = chat(tools=[search, deferred], messages=history)
    assert [t["function"]["name"] for t in later["tools"]] == ["ToolSearch", "deferred"]
    assert later["messages"][-1]["content"] == [
        {"type": "text", "text": anthropic.TOOL_LOADED + "deferred"}
    ]


def test_input_examples_are_shown_in_the_description_and_direct_callers_pass() -> None:
    tool = {
        **WEATHER_TOOL,
        "input_examples": [{"city": "Oslo"}],
        "allowed_callers": ["direct", "code_execution_20250825"],
        "eager_input_streaming": True,
    }
    function = chat(tools=[tool])["tools"][0]["function"]
    assert function["description"] == (
        "Current weather for a city." + anthropic.EXAMPLES_HEADING + '{"city": "Oslo"}'
    )


def test_the_recorded_claude_code_requests_convert() -> None:
    """The bodies Claude Code sent in the scenario suite's captures (tests/data/agents): each
    converts (a later change that refused one fails here, not for a user)."""
    recorded = sorted(AGENTS.glob("claude-code/*-messages.json"))
    assert recorded
    for path in recorded:
        body = json.loads(path.read_text())["body"]
        req = json_format.ParseDict(body, apb.MessagesRequest())
        out = chat_request_to_dict(anthropic.to_chat(req))
        assert out["messages"][0]["role"] == "system"
        assert out["tools"] and out["reasoning_effort"] == "high", path.name
        deferred = {t["name"] for t in body["tools"] if t.get("defer_loading")}
        assert not deferred & {t["function"]["name"] for t in out["tools"]}


def test_output_format_becomes_a_strict_json_schema() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    out = chat(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image", "source": {"type": "base64", "data": "AA=="}},
                        ],
                    }
                ]
            },
            "messages[0].content[1].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "text_editor_20250429", "name": "str_replace_based_edit_tool"}]},
            "tools[0].type",
        ),
        (
            {"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]},
            "tools[0].type",
        ),
        ({"tools": [{**WEATHER_TOOL, "examples": [1]}]}, "tools[0].examples"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages[0].content[0].x",
        ),
        ({"system": [{"type": "image", "source": {}}]}, "system[0].type"),
        ({"messages": [{"role": "developer", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "system", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"tools": [{**WEATHER_TOOL, "allowed_callers": ["code_execution_20250825"]}]},
            "tools[0].allowed_callers",
        ),
        ({"tools": [{**WEATHER_TOOL, "defer_loading": "yes"}]}, "tools[0].defer_loading"),
        ({"tools": [{**WEATHER_TOOL, "input_examples": ["x"]}]}, "tools[0].input_examples"),
        (
            {
                "tools": [WEATHER_TOOL],
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [{"type": "tool_reference", "tool_name": "nope"}],
                            }
                        ],
                    },
                ],
            },
            "messages[2].content[0].content[0].tool_name",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "The answer is"},
                ]
            },
            "messages[1].role",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": {"x": 1}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": ["text"]}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [[]]}]}, "messages[0].content[0]"),
        ({"tools": [{"name": "x", "input_schema": {}, "type": ["custom"]}]}, "tools[0].type"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
        ({"temperature": 1.5}, "temperature"),
        ({"stop_sequences": [""]}, "stop_sequences[0]"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config.format.type"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"speed": "ludicrous"}, "speed"),
        ({"cache_control": {"type": "permanent"}}, "cache_control.type"),
    ],
)
def test_refusals_name_the_param(body: dict[str, Any], param: str) -> None:
    error = refused(**body)
    assert error.param == param
    assert error.openai_type == "invalid_request_error"


def test_an_unknown_block_key_is_refused_as_the_edge_refuses_keys() -> None:
    error = refused(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a", "weight": 2}]}]
    )
    assert error.message == "Unrecognized request argument supplied: messages[0].content[0].weight"


def test_a_null_unknown_key_asks_for_nothing() -> None:
    out = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a", "citations": None}]}]
    )
    assert out["messages"][0]["content"] == [{"type": "text", "text": "a"}]


def test_max_tokens_is_required_except_for_count_tokens() -> None:
    req = json_format.ParseDict(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, apb.MessagesRequest()
    )
    with pytest.raises(InvalidArgumentError) as info:
        anthropic.to_chat(req)
    assert info.value.param == "max_tokens"
    counted = chat_request_to_dict(anthropic.count_to_chat(req))
    assert "max_completion_tokens" not in counted
    with pytest.raises(InvalidArgumentError) as info:
        anthropic.count_to_chat(apb.MessagesRequest(messages=req.messages))
    assert info.value.param == "model"


@pytest.mark.parametrize(
    ("finish", "stop", "reason"),
    [
        ("stop", None, "end_turn"),
        ("stop", "END", "stop_sequence"),
        ("length", None, "max_tokens"),
        ("tool_calls", None, "tool_use"),
    ],
)
def test_stop_reasons(finish: str, stop: str | None, reason: str) -> None:
    assert anthropic.stop_reason(finish, stop) == reason


@pytest.mark.parametrize(
    ("status", "anthropic_status", "kind"),
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (409, 409, "invalid_request_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),
        (500, 500, "api_error"),
        (503, 529, "overloaded_error"),
        (504, 504, "timeout_error"),
    ],
)
def test_error_shape(status: int, anthropic_status: int, kind: str) -> None:
    assert anthropic.error_status(status) == anthropic_status
    assert anthropic.error_body(status, "m") == {
        "type": "error",
        "error": {"type": kind, "message": "m"},
    }


def test_tool_use_ids_carry_the_models_call_id() -> None:
    first = anthropic.tool_use_id("functions.get_weather:0")
    second = anthropic.tool_use_id("functions.get_weather:0")
    assert first.startswith("toolu_") and first != second
    assert re.fullmatch(r"[a-zA-Z0-9_-]+", first)
    assert anthropic.call_id_of(first) == anthropic.call_id_of(second)
    assert anthropic.call_id_of(first) == "functions.get_weather:0"
    # Anthropic's own ids, a client's, and anything that only looks like ours stay as they are.
    for other in ("toolu_01A09q90qw90lq917835lq9", "call_1", "toolu_ip12345678!!", "toolu_ip"):
        assert anthropic.call_id_of(other) == other


def test_the_models_call_id_is_what_the_history_renders() -> None:
    carried = anthropic.tool_use_id("functions.get_weather:3")
    out = chat(
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": carried, "name": "get_weather", "input": {}}
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": carried}]},
        ],
    )
    assert out["messages"][1]["tool_calls"][0]["id"] == "functions.get_weather:3"
    assert out["messages"][2]["tool_call_id"] == "functions.get_weather:3"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
_BLOCK = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x"])
        | _JSON
    },
    optional={
        "text": _JSON,
        "id": _JSON,
        "name": _JSON,
        "input": _JSON,
        "tool_use_id": _JSON,
        "content": _JSON,
        "is_error": _JSON,
        "thinking": _JSON,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    role=st.sampled_from(["user", "assistant", "system", ""]),
    content=_JSON | st.lists(_BLOCK, max_size=3),
    system=_JSON,
    tool=st.dictionaries(st.sampled_from(["name", "type", "input_schema", "x"]), _JSON, max_size=3),
)
def test_any_json_is_served_or_refused_with_a_400(
    role: str, content: Any, system: Any, tool: dict[str, Any]
) -> None:
    """Whatever JSON sits in the free-form values, the conversion returns a chat request or
    raises InvalidArgumentError (a 400), never anything else (a 500, a crashed picker)."""
    body: dict[str, Any] = {"messages": [{"role": role, "content": content}], "tools": [tool]}
    if system is not None:
        body["system"] = system
    try:
        req = request(**body)
    except json_format.ParseError:
        return  # the transcoder's own 400: the body never gets here
    with contextlib.suppress(InvalidArgumentError):
        anthropic.to_chat(req)

"""`inferplane.apis.responses`: a Responses request (+ stored history) → the chat request the
replica renders; the accepted-and-ignored fields Codex sends; every refusal names its path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.apis import responses
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import chat_request_to_dict

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1}}},
    "strict": True,
}


def _convert(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> Any:
    request = json_format.ParseDict(body, rpb.ResponseRequest())
    return responses.convert(request, history or [])


def _chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return chat_request_to_dict(_convert(body, history).chat)


def _refused(body: dict[str, Any]) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as caught:
        _convert(body)
    return caught.value


def test_string_input_and_instructions() -> None:
    chat = _chat({"model": "m", "input": "Hi", "instructions": "Be brief."})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["model"] == "m"


def test_items_merge_into_one_assistant_turn_and_call_ids_round_trip() -> None:
    chat = _chat(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "content": [{"type": "reasoning_text", "text": "Call it."}],
                    "summary": [],
                },
                {
                    "type": "function_call",
                    "call_id": "functions.get_weather:0",
                    "name": "get_weather",
                    "arguments": '{"days": 1}',
                },
                {
                    "type": "function_call_output",
                    "call_id": "functions.get_weather:0",
                    "output": [{"type": "input_text", "text": "sunny"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sunny."}],
                },
                {"type": "message", "role": "developer", "content": "Next."},
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,  # a call without text, as chat's
            "reasoning_content": "Call it.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "developer", "content": "Next."},
    ]


def test_options_map_onto_chat() -> None:
    chat = _chat(
        {
            "model": "m",
            "input": "Hi",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "max_output_tokens": 50,
            "temperature": 0.5,
            "top_p": 0.9,
            "reasoning": {"effort": "none"},
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            },
            "prompt_cache_key": "session-1",
            "user": "u",
            "stream": True,
            "metadata": {"k": "v"},
        }
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"days": {"type": "integer", "minimum": 1}},
                },
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["max_completion_tokens"] == 50
    assert chat["reasoning_effort"] == "none"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert chat["user"] == "session-1"  # the cache key wins: session affinity
    assert chat["stream"] is True
    assert chat["metadata"] == {"k": "v"}


def test_what_codex_sends_by_default_is_accepted() -> None:
    converted = _convert(
        {
            "model": "m",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}],
                }
            ],
            "tools": [
                WEATHER,
                {"type": "namespace", "name": "multi_agent_v1", "tools": []},
                {"type": "web_search"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc",
            "client_metadata": {"x": "y"},
            "text": {"verbosity": "low"},
            "stream": True,
        }
    )
    chat = chat_request_to_dict(converted.chat)
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert converted.encrypted_reasoning
    assert "response_format" not in chat and "reasoning_effort" not in chat


def test_encrypted_reasoning_round_trips() -> None:
    blob = responses.encode_reasoning("I think.")
    chat = _chat(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "reasoning", "summary": [], "encrypted_content": blob},
                {"role": "assistant", "content": "Hello."},
            ],
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "reasoning_content": "I think.",
        "content": "Hello.",
    }
    error = _refused(
        {
            "model": "m",
            "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}],
        }
    )
    assert error.param == "input[0].encrypted_content"


def test_history_comes_first_and_is_counted() -> None:
    history = [
        {"type": "message", "role": "user", "content": "Hi", "id": "msg_1"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            "id": "msg_2",
            "status": "completed",
        },
    ]
    converted = _convert({"model": "m", "input": "More", "instructions": "Sys"}, history)
    chat = chat_request_to_dict(converted.chat)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user"]
    assert converted.history_messages == 3
    assert converted.items == ({"type": "message", "role": "user", "content": "More"},)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "examples": []}]},
            "tools[0].examples",
        ),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"input": "x", "include": ["nonsense"]}, "include[0]"),
        ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"input": "x", "reasoning": {"budget": 3}}, "reasoning.budget"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": "x", "text": {"fromat": {}}}, "text.fromat"),
        ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": []}, "input"),
    ],
)
def test_refusals_name_their_path(body: dict[str, Any], param: str) -> None:
    error = _refused({"model": "m", **body})
    assert error.param == param


def test_the_picker_decides_on_the_new_turn() -> None:
    request = json_format.ParseDict(
        {"model": "m", "input": "Hi", "previous_response_id": "resp_1", "user": "u"},
        rpb.ResponseRequest(),
    )
    chat = chat_request_to_dict(responses.to_chat(request))
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    assert chat["user"] == "u"


# -- namespace tools (Codex CLI's MCP servers and sub-agents) ----------------------------------

CODEX_RECORDS = Path(__file__).resolve().parents[3] / "tests" / "data" / "agents" / "codex"
MCP_WEATHER = {
    "type": "namespace",
    "name": "mcp__weather",
    "description": "Tools in the mcp__weather namespace.",
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Current weather for a city.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "defer_loading": False,  # the SDK's NamespaceTool fields: accepted, ignored
        },
        {"type": "custom", "name": "apply_patch"},  # not a function: left out
    ],
}


def test_namespaced_functions_are_offered_flattened() -> None:
    converted = _convert({"model": "m", "input": "Hi", "tools": [WEATHER, MCP_WEATHER]})
    chat = chat_request_to_dict(converted.chat)
    assert [t["function"] for t in chat["tools"]] == [
        {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": WEATHER["parameters"],
            "strict": True,
        },
        {
            "name": "mcp__weather" + responses.NAMESPACE_SEPARATOR + "get_weather",
            "description": "Current weather for a city.",
            "parameters": MCP_WEATHER["tools"][0]["parameters"],  # type: ignore[index]
            "strict": False,
        },
    ]
    assert converted.namespaced == {"mcp__weather__get_weather": ("mcp__weather", "get_weather")}
    assert responses.flat_name("mcp__weather", "get_weather") == "mcp__weather__get_weather"
    # The picker converts with the same function: it sees the same tools.
    request = json_format.ParseDict(
        {"model": "m", "input": "Hi", "tools": [MCP_WEATHER]}, rpb.ResponseRequest()
    )
    picked = chat_request_to_dict(responses.to_chat(request))
    assert [t["function"]["name"] for t in picked["tools"]] == ["mcp__weather__get_weather"]


def test_a_namespaced_call_in_the_history_is_the_flat_name_the_model_wrote() -> None:
    chat = _chat(
        {
            "model": "m",
            "tools": [MCP_WEATHER],
            "input": [
                {"role": "user", "content": "Weather in Tokyo?"},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "status": "completed",
                    "name": "get_weather",
                    "namespace": "mcp__weather",
                    "arguments": '{"city": "Tokyo"}',
                    "call_id": "functions.mcp__weather__get_weather:0",
                },
                {
                    "type": "function_call_output",
                    "call_id": "functions.mcp__weather__get_weather:0",
                    "output": "18 C",
                },
            ],
        }
    )
    assert chat["messages"][1]["tool_calls"] == [
        {
            "id": "functions.mcp__weather__get_weather:0",
            "type": "function",
            "function": {"name": "mcp__weather__get_weather", "arguments": '{"city": "Tokyo"}'},
        }
    ]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "name": "get_weather", "namespace": "mcp__weather"},
        {"type": "function", "name": "mcp__weather__get_weather"},
    ],
)
def test_tool_choice_names_a_namespaced_function(choice: dict[str, Any]) -> None:
    chat = _chat({"model": "m", "input": "Hi", "tools": [MCP_WEATHER], "tool_choice": choice})
    assert chat["tool_choice"] == {
        "type": "function",
        "function": {"name": "mcp__weather__get_weather"},
    }


def _namespace(**fields: Any) -> dict[str, Any]:
    return {"type": "namespace", "name": "ns", "description": "d", **fields}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [_namespace(name="a.b", tools=[])]}, "tools[0].name"),
        ({"tools": [_namespace(tools={"x": 1})]}, "tools[0].tools"),
        ({"tools": [_namespace(tools=[], bogus=1)]}, "tools[0].bogus"),
        (
            {"tools": [_namespace(tools=[{"type": "function", "name": "a b"}])]},
            "tools[0].tools[0].name",
        ),
        (
            {"tools": [_namespace(tools=[{"type": "function", "name": "f", "bogus": 1}])]},
            "tools[0].tools[0].bogus",
        ),
        (
            {
                "tools": [
                    {"type": "function", "name": "ns__f"},
                    _namespace(tools=[{"type": "function", "name": "f"}]),
                ]
            },
            "tools[1].tools[0].name",
        ),
        (
            {
                "tools": [
                    _namespace(tools=[{"type": "function", "name": "f"}]),
                    {"type": "function", "name": "ns__f"},
                ]
            },
            "tools[1].name",
        ),
        (
            {"tool_choice": {"type": "function", "name": "f", "namespace": ""}},
            "tool_choice.namespace",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call",
                        "call_id": "c",
                        "name": "f",
                        "namespace": 3,
                        "arguments": "{}",
                    }
                ]
            },
            "input[0].namespace",
        ),
    ],
)
def test_namespace_refusals_name_their_path(body: dict[str, Any], param: str) -> None:
    error = _refused({"model": "m", "input": "x", **body})
    assert error.param == param


@pytest.mark.parametrize("record", sorted(CODEX_RECORDS.glob("*.json")), ids=lambda p: p.stem)
def test_recorded_codex_bodies_convert_with_their_mcp_tools(record: Path) -> None:
    body = json.loads(record.read_text())["body"]
    converted = _convert(body)
    chat = chat_request_to_dict(converted.chat)
    names = {t["function"]["name"] for t in chat["tools"]}
    assert "multi_agent_v1__spawn_agent" in names  # Codex's sub-agent namespace
    if record.stem.startswith("weather"):
        assert converted.namespaced["mcp__weather__get_weather"] == (
            "mcp__weather",
            "get_weather",
        )
    calls = [c for m in chat["messages"] for c in m.get("tool_calls", [])]
    if record.stem == "weather-01-responses":  # Codex sends the namespaced call back
        assert [c["function"]["name"] for c in calls] == ["mcp__weather__get_weather"]

"""Request-body keys the API does not know, through a real Envoy (issue 19, item 4).

OpenAI answers an unknown argument with 400 "Unrecognized request argument supplied: X" and
`param` X; the transcoder alone would drop it silently. The field guard (lua/field_guard.lua,
tables from the descriptor set) must turn every such key away, at the top level and inside
nested messages, and change nothing else: known keys under either JSON name, vLLM's
extensions the protos carry, free-form values (Struct / Value fields) whatever their keys,
and bodies whose strings look like JSON all reach the service exactly as sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferplane.api.inference.v1 import inference_pb2 as pb

from .conftest import Edge
from .test_edge_http import AUTH, assert_openai_error, chat

UNRECOGNIZED = "Unrecognized request argument supplied: "


@pytest.fixture(scope="module")
def http(edge: Edge) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=30) as client:
        yield client


def assert_unrecognized(edge: Edge, response: httpx.Response, param: str) -> None:
    """A 400 in OpenAI's shape naming `param`, and nothing reached a service."""
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": {
            "message": UNRECOGNIZED + param,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_a_typo_at_the_top_level_is_a_400_naming_it(edge: Edge, http: httpx.Client) -> None:
    before = len(edge.inference.calls)
    assert_unrecognized(
        edge, post(http, "/v1/chat/completions", chat(temprature=0.2)), "temprature"
    )
    assert len(edge.inference.calls) == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            chat(
                messages=[
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "hi", "foo": 1},
                ]
            ),
            "messages[1].foo",
        ),
        (
            chat(
                messages=[
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c0",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            },
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "args": "{}"},
                            },
                        ],
                    },
                ]
            ),
            "messages[1].tool_calls[1].function.args",
        ),
        (
            chat(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {}, "strict": True, "examples": []},
                    }
                ]
            ),
            "tools[0].function.examples",
        ),
        (
            chat(stream=True, stream_options={"include_usage": True, "continuous_usage": True}),
            "stream_options.continuous_usage",
        ),
        # Removed from vLLM before 0.32: nobody defines it any more.
        (chat(stream=True, guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
        (chat(messages=[{"role": "developer", "content": "x", "task": "t"}]), "messages[0].task"),
    ],
)
def test_an_unknown_key_in_a_nested_message_is_a_400_with_its_path(
    edge: Edge, http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    """Each chat message, its tool calls' functions, tools[].function and stream_options are
    messages of the proto, checked like the top level; a streamed request too (the guard runs
    after the stream router moved it to /internal/events/...)."""
    before = len(edge.inference.calls)
    assert_unrecognized(edge, post(http, "/v1/chat/completions", body), param)
    assert len(edge.inference.calls) == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True, "echoo": 1}, "echoo"),
        (
            "/v1/embeddings",
            {"model": "e", "input": "x", "encodingformat": "float"},
            "encodingformat",
        ),
        ("/v1/admin/api-keys", {"display_name": "ci", "limits": {"rpm": 5}}, "limits.rpm"),
        ("/v1/admin/api-keys/k1", {"name": "api-keys/k1", "owner": "x"}, "owner"),
        ("/v1/admin/api-keys/k1:rotate", {"grace_period_seconds": 5, "grace": 5}, "grace"),
        ("/v1/admin/api-keys/k1:revoke", {"reason": "leaked"}, "reason"),
    ],
)
def test_every_json_route_checks_its_body(
    edge: Edge, http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    method = "PATCH" if path == "/v1/admin/api-keys/k1" else "POST"
    response = http.request(
        method, path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert_unrecognized(edge, response, param)


def _received(edge: Edge, body: dict[str, Any], message: type[Any]) -> None:
    """The service got exactly what the transcoder makes of `body`."""
    expected = json_format.ParseDict(body, message(), ignore_unknown_fields=False)
    assert edge.inference.calls[-1].body == expected


def test_vllm_extensions_and_well_formed_requests_pass_unchanged(
    edge: Edge, http: httpx.Client
) -> None:
    """Known keys, under either JSON name, nested messages, the vLLM extensions the protos
    carry and free-form values with any keys reach the replica exactly as sent."""
    body = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think",
                "toolCalls": [
                    {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "toolCallId": "c0", "content": '{"ok": true}'},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "d",
                    "parameters": {"type": "object", "x-anything": {"nested": [1, {"k": "v"}]}},
                    "strict": True,
                },
            }
        ],
        tool_choice={"type": "function", "function": {"name": "f", "extra": 1}},
        temperature=0.2,
        maxTokens=8,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=1,
        chat_template_kwargs={"thinking": False, "custom": {"a": [1]}},
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        metadata={"any": "thing"},
        logit_bias={"42": -100},
        stop=["\n"],
        seed=7,
    )
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    _received(edge, body, pb.ChatCompletionRequest)
    # vLLM 0.32's own fields (docs/request-fields.md): a body written for vLLM passes the edge
    # (GuideLLM's continuous_usage_stats, vLLM >= 0.16's `reasoning` in history, ...).
    body = chat(
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning": "greet"},
            {"role": "user", "content": "again"},
        ],
        n=2,
        logprobs=True,
        top_logprobs=3,
        stop_token_ids=[7, 8],
        include_stop_str_in_output=True,
        structured_outputs={"json": {"type": "object"}},
        guided_regex="a+",
        priority=0,
        request_id="mine",
        use_beam_search=False,
        skip_special_tokens=True,
        return_tokens_as_token_ids=False,
    )
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    _received(edge, body, pb.ChatCompletionRequest)
    completion = {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "top_k": 3,
        "ignore_eos": True,
        "echo": False,
    }
    response = post(http, "/v1/completions", completion)
    assert response.status_code == 200, response.text
    _received(edge, completion, pb.CompletionRequest)
    embedding = {"model": "e", "input": ["a", "b"], "encoding_format": "float", "dimensions": 8}
    response = post(http, "/v1/embeddings", embedding)
    assert response.status_code == 200, response.text
    _received(edge, embedding, pb.EmbeddingRequest)


def test_a_well_formed_admin_body_reaches_auth(edge: Edge, http: httpx.Client) -> None:
    key = {"display_name": "ci", "scopes": ["inference"], "limits": {"requestsPerMinute": 5}}
    response = post(http, "/v1/admin/api-keys", key)
    assert response.status_code == 200, response.text
    assert edge.authz.created[-1].limits.requests_per_minute == 5


def test_keys_are_compared_after_json_unescaping(edge: Edge, http: httpx.Client) -> None:
    r"""`"max\u005ftokens"` is max_tokens to the transcoder, and `"te\u006dprature"` is still
    the typo temprature."""
    body = b'{"model": "tiny", "messages": [], "max\\u005ftokens": 3}'
    response = http.post("/v1/chat/completions", content=body)
    assert response.status_code == 200, response.text
    assert edge.inference.calls[-1].body.max_tokens == 3
    body = b'{"model": "tiny", "messages": [], "te\\u006dprature": 1}'
    assert_unrecognized(edge, http.post("/v1/chat/completions", content=body), "temprature")


def test_an_unknown_key_set_to_null_asks_for_nothing_and_passes(
    edge: Edge, http: httpx.Client
) -> None:
    """An assistant message echoed from an OpenAI SDK object (`model_dump()`) carries
    `"refusal": null`, `"audio": null`, ...: null means "not set", so nothing is dropped."""
    echoed = {
        "role": "assistant",
        "content": "hello",
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": None,
        "tool_calls": None,
    }
    body = chat(messages=[{"role": "user", "content": "hi"}, echoed], service_tier=None)
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert [m.role for m in edge.inference.calls[-1].body.messages] == ["user", "assistant"]


def test_strings_that_look_like_json_do_not_confuse_the_guard(
    edge: Edge, http: httpx.Client
) -> None:
    tricky = 'x", "temprature": 1, "y": {"z": [\\"]}] \\\\" } { ] ['
    body = chat(messages=[{"role": "user", "content": tricky, "name": '"}\\'}])
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert edge.inference.calls[-1].body.messages[0].content.string_value == tricky


def test_malformed_json_still_gets_the_transcoders_parse_error(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [')
    error = assert_openai_error(response, 400, "invalid_request_body")
    assert "Unexpected end of string" in error["message"]


def test_a_huge_unknown_key_is_echoed_bounded(edge: Edge, http: httpx.Client) -> None:
    key = "é" * 5000
    response = post(http, "/v1/chat/completions", chat(**{key: 1}))
    assert response.status_code == 400
    param = response.json()["error"]["param"]
    assert param.endswith("...") and key.startswith(param[:-3]) and len(param.encode()) <= 259


def test_the_openai_client_raises_bad_request_naming_the_parameter(edge: Edge) -> None:
    client = openai.OpenAI(base_url=edge.url + "/v1", api_key="good", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temprature": 0.2},
        )
    assert info.value.status_code == 400
    assert info.value.param == "temprature"
    assert info.value.code is None
    assert info.value.body == {
        "message": UNRECOGNIZED + "temprature",
        "type": "invalid_request_error",
        "param": "temprature",
        "code": None,
    }
    ok = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"top_k": 4, "repetition_penalty": 1.05},
    )
    assert ok.choices[0].finish_reason == "stop"
    assert edge.inference.calls[-1].body.top_k == 4


# Any JSON, with strings full of the characters a scanner could trip on.
_TEXT = st.text(alphabet=st.sampled_from([*'ab"\\{}[]:, \n\té\u2028', "\U0001f600"]))
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"]), "content": _JSON},
        optional={"name": _TEXT, "tool_call_id": _TEXT},
    ),
    min_size=1,
    max_size=4,
)
_BODIES = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": _MESSAGES},
    optional={
        "metadata": st.dictionaries(_TEXT, _JSON, max_size=3),
        "response_format": st.dictionaries(_TEXT, _JSON, max_size=3),
        "stop": _JSON,
        "temperature": st.floats(0, 2),
        "top_k": st.integers(-1, 50),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_BODIES, where=st.integers(0, 10), typo=st.sampled_from(["modle", "Temperature", "x"]))
def test_random_bodies_pass_and_one_unknown_key_is_found(
    edge: Edge, http: httpx.Client, body: dict[str, Any], where: int, typo: str
) -> None:
    """Whatever the free-form values hold, a body of known keys passes as sent; the same body
    with one unknown key added to the top level or to one of its messages is a 400 naming
    exactly that key."""
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    expected = json_format.ParseDict(body, pb.ChatCompletionRequest())
    assert edge.inference.calls[-1].body == expected
    index = where % (len(body["messages"]) + 1)
    if index == len(body["messages"]):
        body[typo], param = 1, typo
    else:
        body["messages"][index][typo], param = [1], f"messages[{index}].{typo}"
    assert_unrecognized(edge, post(http, "/v1/chat/completions", body), param)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "tiny", "messages": [' + b"1," * 1_000_000 + b"1]}",
    ],
    ids=["nested-arrays", "a-million-numbers"],
)
def test_hostile_shapes_are_left_to_the_transcoder(http: httpx.Client, body: bytes) -> None:
    """Bodies no request proto can hold (deep nesting where messages are expected, a list of
    numbers for messages) get the transcoder's own 400 quickly: the guard's recursion follows
    the protos' nesting and its scan is one forward pass."""
    started = time.monotonic()
    response = http.post("/v1/chat/completions", content=body)
    assert_openai_error(response, 400, "invalid_request_body")
    assert time.monotonic() - started < 5

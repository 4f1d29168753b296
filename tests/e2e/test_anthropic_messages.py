"""The official `anthropic` Python SDK, unchanged, against the real stack (Envoy → auth → the
picker → the replica → vLLM): Anthropic's Messages API on the chat pipeline.

Prompts are `kimi_tiny.CASES` in Anthropic's form: the fixture model reproduces exactly its
training phrasings, so each answer is known in advance, and a known answer also proves the
Messages request rendered the same prompt as the chat request it converts to.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from inferplane.fixtures import kimi_tiny as kt
from inferplane.localstack import MODEL_NAME, Stack

pytestmark = pytest.mark.e2e

MARKERS = re.compile(r"<\|[a-z_]+\|>|</?think>")
MAX_TOKENS = 256


def _tools(names: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in kt.tools(*names)
    ]


def _thinking(case: kt.CanonicalCase) -> dict[str, Any]:
    return {"type": "adaptive"} if case.thinking else {"type": "disabled"}


def _request(case: kt.CanonicalCase, **extra: Any) -> dict[str, Any]:
    """The case's first user turn as SDK keyword arguments."""
    (message,) = case.messages
    return {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": message["content"]}],
        "tools": _tools(case.tool_names),
        "thinking": _thinking(case),
        # Greedy: the fixture's known answers. The SDK 2.12 has no `temperature` argument any
        # more; the API (and this platform) still take it.
        "extra_body": {"temperature": 0},
        **extra,
    }


def _base_url(stack: Stack) -> str:
    return stack.config.base_url.removesuffix("/v1")  # the SDK adds /v1/messages


@pytest.fixture(scope="module")
def client(stack: Stack, api_key: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=_base_url(stack), api_key=api_key, max_retries=0, timeout=120
    ) as sdk:
        yield sdk


def _blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
    out = []
    for block in message.content:
        data = block.model_dump(exclude_none=True)
        if data["type"] == "tool_use":
            assert data.pop("id").startswith("toolu_")
        out.append(data)
    return out


def _expected(case: kt.CanonicalCase) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if case.reasoning:
        blocks.append({"type": "thinking", "thinking": case.reasoning, "signature": ""})
    if case.content:
        blocks.append({"type": "text", "text": case.content})
    for call in case.tool_calls:
        blocks.append({"type": "tool_use", "name": call.name, "input": dict(call.arguments)})
    return blocks


def test_unary_text_with_thinking(client: anthropic.Anthropic) -> None:
    message = client.messages.create(**_request(kt.NO_TOOL))
    assert message.id.startswith("msg_") and message.model == MODEL_NAME
    assert _blocks(message) == _expected(kt.NO_TOOL)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0
    assert usage.cache_creation_input_tokens == 0 and usage.output_tokens > 0
    for block in message.content:
        assert not MARKERS.search(getattr(block, "text", "") or getattr(block, "thinking", ""))


def test_streamed_text_is_assembled_by_the_sdk(client: anthropic.Anthropic) -> None:
    with client.messages.stream(**_request(kt.NO_TOOL)) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == kt.NO_TOOL.content and len(pieces) > 1
    assert _blocks(final) == _expected(kt.NO_TOOL)
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_thinking_off_calls_a_tool_without_thinking(client: anthropic.Anthropic) -> None:
    message = client.messages.create(**_request(kt.THINKING_OFF))
    assert _blocks(message) == _expected(kt.THINKING_OFF)
    assert message.stop_reason == "tool_use"


def test_a_get_weather_round_trip(client: anthropic.Anthropic) -> None:
    """The model calls get_weather; the SDK sends the call and its result back with the
    `toolu_…` ids it got, and the model answers from them (the known follow-up answer: the
    history rendered exactly as the chat request's)."""
    first = client.messages.create(**_request(kt.WEATHER))
    assert _blocks(first) == _expected(kt.WEATHER) and first.stop_reason == "tool_use"
    # The fixture's tool loop, in Anthropic's form: two calls, two results.
    question, call_turn, *results = kt.TOOL_LOOP_FOLLOWUP.messages
    ids = {call["id"]: f"toolu_{n}" for n, call in enumerate(call_turn["tool_calls"])}
    history = [
        {"role": "user", "content": question["content"]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": call_turn["reasoning_content"], "signature": ""},
                *(
                    {
                        "type": "tool_use",
                        "id": ids[call["id"]],
                        "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"]),
                    }
                    for call in call_turn["tool_calls"]
                ),
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": ids[result["tool_call_id"]],
                    "content": result["content"],
                }
                for result in results
            ],
        },
    ]
    answer = client.messages.create(
        model=MODEL_NAME,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=history,
        tools=_tools(kt.TOOL_LOOP_FOLLOWUP.tool_names),
        thinking={"type": "adaptive"},
    )
    assert _blocks(answer) == _expected(kt.TOOL_LOOP_FOLLOWUP)
    assert answer.stop_reason == "end_turn"


def test_count_tokens_is_the_prompt_the_request_generates_from(
    client: anthropic.Anthropic,
) -> None:
    request = _request(kt.WEATHER)
    counted = client.messages.count_tokens(
        model=request["model"],
        messages=request["messages"],
        tools=request["tools"],
        thinking=request["thinking"],
    )
    usage = client.messages.create(**request).usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_bearer_auth_works_too(stack: Stack, api_key: str) -> None:
    with anthropic.Anthropic(
        base_url=_base_url(stack), auth_token=api_key, max_retries=0, timeout=120
    ) as bearer:
        message = bearer.messages.create(**_request(kt.NO_TOOL, max_tokens=8))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8


def test_a_bad_key_is_authentication_error(stack: Stack) -> None:
    bad = anthropic.Anthropic(base_url=_base_url(stack), api_key="nope", max_retries=0)
    with bad, pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(**_request(kt.NO_TOOL))
    assert info.value.status_code == 401
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temprature": 0.2}, "temprature"),
        ({"thinking": {"type": "adaptive", "depth": 3}}, "thinking.depth"),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(
    client: anthropic.Anthropic, extra: dict[str, Any], param: str
) -> None:
    request = _request(kt.NO_TOOL)
    request.pop("thinking")
    request["extra_body"] = extra
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**request)
    assert info.value.body["error"] == {  # type: ignore[index]
        "type": "invalid_request_error",
        "message": f"Unrecognized request argument supplied: {param}",
    }


def test_an_unknown_model_is_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(**_request(kt.NO_TOOL, model="no-such-model"))
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_an_image_is_a_400_naming_the_block(client: anthropic.Anthropic) -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            **_request(kt.NO_TOOL, messages=[{"role": "user", "content": [image]}])
        )
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in error["message"] and "image" in error["message"]


def _claude_code_body(stream: bool) -> dict[str, Any]:
    """What Claude Code sends (its shape: the request keys, system blocks with cache_control,
    thinking adaptive with display omitted, output_config, context_management, a JSON user_id),
    small enough for the fixture's context. A system prompt the fixture never saw makes its
    answer unknown: the test checks the shape, not the words."""
    return {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "Tell me something about Paris.",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            }
        ],
        "system": [
            {
                "type": "text",
                "text": "You are a CLI agent.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [{**t, "cache_control": {"type": "ephemeral"}} for t in _tools(("get_weather",))],
        "metadata": {"user_id": json.dumps({"device_id": "d1", "session_id": "s1"})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "temperature": 0,
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_like_claude_codes_is_served(stack: Stack, api_key: str, stream: bool) -> None:
    response = httpx.post(
        _base_url(stack) + "/v1/messages?beta=true",
        json=_claude_code_body(stream),
        headers={
            "x-api-key": api_key,
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
            "x-claude-code-session-id": "s1",
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    if not stream:
        message = response.json()
        assert message["stop_reason"] in ("end_turn", "tool_use", "max_tokens")
        kinds = [block["type"] for block in message["content"]]
        assert set(kinds) <= {"thinking", "text", "tool_use"} and kinds
        # display "omitted": thinking blocks come without their text.
        assert all(b["thinking"] == "" for b in message["content"] if b["type"] == "thinking")
        return
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    assert not [e for e in events if e.get("delta", {}).get("type") == "thinking_delta"]


def test_each_request_is_one_ledger_row_named_messages(stack: Stack) -> None:
    admin = {"authorization": f"Bearer {stack.admin_key}"}
    created = httpx.post(
        f"{stack.config.base_url}/admin/api-keys",
        json={"tenant": "messages-e2e", "scopes": ["inference"]},
        headers=admin,
        timeout=30,
    ).json()
    key_id = created["api_key"]["name"].removeprefix("api-keys/")
    with anthropic.Anthropic(
        base_url=_base_url(stack), api_key=created["secret"], max_retries=0, timeout=120
    ) as sdk:
        unary = sdk.messages.create(**_request(kt.NO_TOOL))
        with sdk.messages.stream(**_request(kt.NO_TOOL)) as stream:
            stream.until_done()
    deadline = time.monotonic() + 30
    while True:
        rows = (
            httpx.get(
                f"{stack.config.base_url}/admin/usage",
                params={"key_id": key_id},
                headers=admin,
                timeout=30,
            )
            .json()
            .get("rows", [])
        )
        if len(rows) >= 2:
            break
        assert time.monotonic() < deadline, f"{len(rows)} of 2 ledger rows arrived"
        time.sleep(0.2)
    time.sleep(1)  # a third row (a duplicate) would have arrived by now
    rows = httpx.get(
        f"{stack.config.base_url}/admin/usage",
        params={"key_id": key_id},
        headers=admin,
        timeout=30,
    ).json()["rows"]
    assert len(rows) == 2
    prompt = unary.usage.input_tokens + (unary.usage.cache_read_input_tokens or 0)
    assert sorted(int(r["prompt_tokens"]) for r in rows) == [prompt, prompt]
    assert all(int(r["completion_tokens"]) == unary.usage.output_tokens for r in rows)
    assert {r["api"] for r in rows} == {"messages"}


def _hi(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            _hi(
                messages=[{"role": "user", "content": [{"type": "text", "text": "a", "weight": 2}]}]
            ),
            "Unrecognized request argument supplied: messages[0].content[0].weight",
        ),
        (_hi(metadata={"user_id": "u", "tags": ["x"]}), "metadata.tags"),
        (_hi(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
        (_hi(max_tokens="lots"), "max_tokens"),
        (_hi(messages="hi"), "messages"),
        (_hi(messages=[]), "messages"),
        (_hi(messages=[{"role": "developer", "content": "hi"}]), "messages[0].role"),
        (
            _hi(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}
                        ],
                    }
                ]
            ),
            "toolu_x",
        ),
        (_hi(max_tokens=10_000_000), "context length"),
        (_hi(messages=[{"role": "user", "content": [[[[[[[[[[[]]]]]]]]]]]}]), "messages[0]"),
        ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ],
)
def test_hostile_bodies_are_400s_in_anthropics_shape(
    stack: Stack, api_key: str, body: dict[str, Any], words: str
) -> None:
    """Every refusal is a 400 `invalid_request_error` naming what is wrong; nothing reaches a
    replica that would hurt it (the next test's request is served)."""
    response = httpx.post(
        _base_url(stack) + "/v1/messages", json=body, headers={"x-api-key": api_key}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_the_replica_still_serves_after_the_hostile_bodies(client: anthropic.Anthropic) -> None:
    assert _blocks(client.messages.create(**_request(kt.NO_TOOL))) == _expected(kt.NO_TOOL)


AGENTS = Path(__file__).resolve().parents[1] / "data" / "agents"


@pytest.mark.parametrize(
    "record", sorted(AGENTS.glob("claude-code/*-messages.json")), ids=lambda p: p.stem
)
def test_claude_codes_recorded_requests_pass_the_whole_path(
    stack: Stack, api_key: str, record: Path
) -> None:
    """The bodies and headers Claude Code sent (tests/data/agents, captured in the scenario
    suite) pass the edge, auth, the picker and the replica's rendering: counted, not generated
    (a real turn's prompt takes the CPU fixture minutes to prefill; the scenario suite runs
    the agent itself)."""
    recorded = json.loads(record.read_text())
    headers = {
        k: v
        for k, v in recorded["headers"].items()
        if k.lower() not in ("content-length", "host", "x-api-key", "authorization")
    }
    response = httpx.post(
        _base_url(stack) + "/v1/messages/count_tokens?beta=true",
        json={**recorded["body"], "model": MODEL_NAME},
        headers={**headers, "x-api-key": api_key},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["input_tokens"] > 1000

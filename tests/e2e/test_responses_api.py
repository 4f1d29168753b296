"""OpenAI's Responses API against the real stack: the official `openai` client's
`responses.create` (unary and streamed), a `get_weather` function-tool round trip, stored
responses (`previous_response_id` replayed token for token; GET / DELETE / input_items, scoped
to the key's tenant), the body Codex CLI sends, the field guard's 400 in OpenAI's shape, and
the OpenAI Agents SDK completing a run with a function tool.

Prompts come from `kimi_tiny.CASES`: the fixture model reproduces its training phrasings, so
the first turns' answers are known in advance; prompts stay short (a 2,048-token context)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import openai
import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.chat import render_chat
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack
from inferplane.sdk import Client

pytestmark = pytest.mark.e2e

MARKERS = re.compile(r"<\|[a-z_]+\|>|</?think>")


def _flat_tools(*names: str) -> list[dict[str, Any]]:
    """The fixture's chat tools in the Responses API's flat form (the same declarations, so
    the prompt renders as in the chat cases)."""
    out = []
    for tool in kimi_tiny.tools(*names):
        function = tool["function"]
        out.append({"type": "function", **function})
    return out


@pytest.fixture(scope="module")
def other_tenant_key(stack: Stack) -> str:
    key = auth_pb2.ApiKey(display_name="other-tenant", tenant="elsewhere", scopes=["inference"])
    with Client(
        auth=stack.config.address("auth"),
        security=stack.config.security,
        admin_key=stack.admin_key,
        timeout=10,
    ) as admin:
        return admin.keys.create(key).secret


def test_unary_response_answers_as_the_chat_api(client: openai.OpenAI) -> None:
    case = kimi_tiny.NO_TOOL
    response = client.responses.create(
        model=MODEL_NAME, input=case.request()["messages"][0]["content"], store=False, temperature=0
    )
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == case.content
    reasoning = next(item for item in response.output if item.type == "reasoning")
    assert reasoning.content is not None and reasoning.content[0].text == case.reasoning
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0
    assert usage.output_tokens_details.reasoning_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.store is False


def test_streamed_response_events(client: openai.OpenAI) -> None:
    case = kimi_tiny.NO_TOOL
    events = list(
        client.responses.create(
            model=MODEL_NAME,
            input=case.request()["messages"][0]["content"],
            store=False,
            temperature=0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == case.content == events[-1].response.output_text


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    case = kimi_tiny.WEATHER
    tools = _flat_tools(*case.tool_names)
    first = client.responses.create(
        model=MODEL_NAME,
        input=case.request()["messages"][0]["content"],
        tools=tools,  # type: ignore[arg-type]
        store=False,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    call = calls[0]
    assert call.call_id == case.tool_calls[0].id
    assert json.loads(call.arguments) == dict(case.tool_calls[0].arguments)
    second = client.responses.create(
        model=MODEL_NAME,
        tools=tools,  # type: ignore[arg-type]
        store=False,
        temperature=0,
        input=[
            {"role": "user", "content": case.request()["messages"][0]["content"]},
            *[item.model_dump(exclude_none=True) for item in first.output],  # type: ignore[list-item]
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
        ],
    )
    assert second.status == "completed"
    assert second.output
    for item in second.output:
        if item.type == "message":
            assert not MARKERS.search(second.output_text)


def test_stored_response_continues_token_for_token(
    stack: Stack, api_key: str, client: openai.OpenAI, other_tenant_key: str
) -> None:
    """The second turn's prompt is the first turn's prompt and output ids, token for token,
    then the new message: its length is exactly theirs plus the new message's rendering.
    Rendered from the messages instead, Kimi's template drops the first answer's reasoning
    (the prompt would be shorter and part from the first one where it ended)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(kimi_tiny.model_path()))
    case = kimi_tiny.NO_TOOL
    user = case.request()["messages"][0]["content"]
    first = client.responses.create(model=MODEL_NAME, input=user, temperature=0)
    assert first.store is True and first.status == "completed"
    assert first.output_text == case.content
    second = client.responses.create(
        model=MODEL_NAME,
        input="Tell me more.",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None

    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": case.content, "reasoning_content": case.reasoning},
        {"role": "user", "content": "Tell me more."},
    ]
    rendered = render_chat({"messages": messages}, tokenizer)
    end = rendered.text.rindex(kimi_tiny.EOS, 0, rendered.text.index("Tell me more."))
    new_part = rendered.text[end + len(kimi_tiny.EOS) :]
    new_tokens = len(tokenizer.encode(new_part, add_special_tokens=False))
    replayed = first.usage.input_tokens + first.usage.output_tokens  # the output ends with EOS
    assert second.usage.input_tokens == replayed + new_tokens
    assert second.usage.input_tokens != len(rendered.token_ids)  # not the template's history

    base = stack.config.base_url
    mine = {"Authorization": f"Bearer {api_key}"}
    got = httpx.get(f"{base}/responses/{first.id}", headers=mine, timeout=30)
    assert got.status_code == 200 and got.json()["id"] == first.id
    stored = openai.types.responses.Response.model_validate(got.json())
    assert [item.id for item in stored.output] == [item.id for item in first.output]
    assert stored.output_text == first.output_text and stored.usage == first.usage
    items = httpx.get(
        f"{base}/responses/{second.id}/input_items", params={"order": "asc"}, headers=mine
    ).json()
    assert items["object"] == "list"
    assert [i["type"] for i in items["data"]] == ["message", "reasoning", "message", "message"]
    assert items["data"][-1]["content"] == "Tell me more."

    # Another tenant's key sees none of it: 404 not_found, as an unknown id.
    theirs = {"Authorization": f"Bearer {other_tenant_key}"}
    for path in (f"/responses/{first.id}", f"/responses/{first.id}/input_items"):
        other = httpx.get(f"{base}{path}", headers=theirs, timeout=30)
        assert other.status_code == 404
        assert other.json()["error"]["code"] == "not_found"
    other_client = openai.OpenAI(base_url=base, api_key=other_tenant_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        other_client.responses.create(model=MODEL_NAME, input="Hi", previous_response_id=first.id)
    assert info.value.code == "not_found"
    assert httpx.delete(f"{base}/responses/{first.id}", headers=theirs).status_code == 404

    deleted = httpx.delete(f"{base}/responses/{first.id}", headers=mine, timeout=30)
    assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    assert httpx.get(f"{base}/responses/{first.id}", headers=mine).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="Hi", previous_response_id="resp_nope")


def test_codex_like_body_is_served(stack: Stack, api_key: str) -> None:
    """What Codex CLI sends by default (store false, encrypted reasoning, summary auto, a
    namespace tool and the built-in web_search beside function tools, client metadata, a cache
    key), streamed."""
    body = {
        "model": MODEL_NAME,
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        ],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Runs a command.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string"}},
                    "required": ["cmd"],
                    "additionalProperties": False,
                },
            },
            {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents."},
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "codex-session-1",
        "client_metadata": {"x-codex-installation-id": "e2e"},
        "max_output_tokens": 64,
    }
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.stream(
        "POST", f"{stack.config.base_url}/responses", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    kinds = re.findall(r"^event: (\S+)$", text, flags=re.MULTILINE)
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = json.loads(text.strip().rsplit("data: ", 1)[1])["response"]
    for item in final["output"]:
        if item["type"] == "reasoning":
            assert item["encrypted_content"] and item["summary"]


def test_unknown_fields_and_built_in_tools_are_400s_in_openai_shape(
    stack: Stack, api_key: str
) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    url = f"{stack.config.base_url}/responses"
    cases = [
        ({"model": MODEL_NAME, "input": "Hi", "temprature": 0}, "temprature"),
        (
            {"model": MODEL_NAME, "input": "Hi", "tools": [{"type": "file_search"}]},
            "tools[0].type",
        ),
        (
            {"model": MODEL_NAME, "input": [{"type": "message", "role": "tool", "content": "x"}]},
            "input[0].role",
        ),
        ({"model": MODEL_NAME, "input": "Hi", "text": {"fromat": {}}}, "text.fromat"),
    ]
    for body, param in cases:
        answer = httpx.post(url, json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (param, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"


def test_agents_sdk_run_with_a_function_tool(stack: Stack, api_key: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"It is 21 degrees and sunny in {city}."

    async def run() -> Any:
        client = openai.AsyncOpenAI(
            base_url=stack.config.base_url, api_key=api_key, max_retries=0, timeout=120
        )
        agent = Agent(
            name="weather",
            model=OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
            tools=[get_weather],
            # Greedy, as every other test here: the SDK sends no temperature, and at the
            # engine's default (1.0) the fixture's call arguments are sampled.
            model_settings=ModelSettings(temperature=0.0),
        )
        try:
            return await Runner.run(agent, "What is the weather in Tokyo?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert called == ["Tokyo"]
    assert isinstance(result.final_output, str) and result.final_output
    assert not MARKERS.search(result.final_output)


_NEST = [[[[[[[[[[[]]]]]]]]]]]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": MODEL_NAME, "input": 5}, 400, "input"),
        ({"model": MODEL_NAME, "input": []}, 400, "input"),
        ({"model": MODEL_NAME, "input": [_NEST]}, 400, "input[0]"),
        ({"model": MODEL_NAME, "input": [{"type": "message", "role": "user"}]}, 400, "input[0]"),
        ({"model": MODEL_NAME, "input": "Hi", "max_output_tokens": "lots"}, 400, ""),
        ({"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 10_000_000}, 400, "context"),
        ({"model": MODEL_NAME, "input": "Hi", "tools": "get_weather"}, 400, ""),
        ({"model": MODEL_NAME, "input": "Hi", "tool_choice": {"type": "nope"}}, 400, "tool_choice"),
        (
            {
                "model": MODEL_NAME,
                "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}],
            },
            400,
            "call_x",
        ),
        ({"model": MODEL_NAME, "input": "Hi", "previous_response_id": "resp_nope"}, 404, ""),
        ({"model": "no-such-model", "input": "Hi"}, 404, "no-such-model"),
        ({"input": "Hi"}, 400, "model"),
    ],
)
def test_hostile_bodies_are_4xx_in_openai_shape(
    stack: Stack, api_key: str, body: dict[str, Any], status: int, words: str
) -> None:
    """Every refusal is a 4xx in OpenAI's error shape saying what is wrong; nothing reaches a
    replica that would hurt it (the next test's request is served)."""
    answer = httpx.post(
        f"{stack.config.base_url}/responses",
        json=body,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["type"] in ("invalid_request_error", "not_found_error"), error
    assert words in error["message"] + str(error.get("param")), error


def test_a_bad_key_is_a_401_in_openai_shape(stack: Stack) -> None:
    answer = httpx.post(
        f"{stack.config.base_url}/responses",
        json={"model": MODEL_NAME, "input": "Hi"},
        headers={"Authorization": "Bearer ip-not-a-key"},
        timeout=30,
    )
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "invalid_api_key"


def test_the_replica_still_serves_after_the_hostile_bodies(client: openai.OpenAI) -> None:
    case = kimi_tiny.NO_TOOL
    response = client.responses.create(
        model=MODEL_NAME, input=case.request()["messages"][0]["content"], store=False, temperature=0
    )
    assert response.status == "completed" and response.output_text == case.content

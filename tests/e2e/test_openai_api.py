"""The official `openai` client against the real stack (Envoy → router → node-agent → vLLM).

Prompts come from `kimi_tiny.CASES`: the fixture model reproduces exactly its training
phrasings, so every expected answer here is known in advance.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack

from .conftest import engine_core_pid

pytestmark = pytest.mark.e2e

MARKERS = re.compile(r"<\|[a-z_]+\|>|</?think>")


def _no_markers(*texts: str | None) -> None:
    for text in texts:
        assert not MARKERS.search(text or ""), f"marker leaked: {text!r}"


def _chat(client: openai.OpenAI, case: kimi_tiny.CanonicalCase, **extra: object) -> object:
    request = case.request(**extra)
    return client.chat.completions.create(
        model=request.pop("model"),
        messages=request.pop("messages"),
        tools=request.pop("tools", openai.NOT_GIVEN),
        temperature=0,
        extra_body={"chat_template_kwargs": request.pop("chat_template_kwargs")},
        **request,
    )


def test_models_lists_the_fixture_model(client: openai.OpenAI) -> None:
    assert MODEL_NAME in [m.id for m in client.models.list().data]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


def test_non_streaming_chat_answer(client: openai.OpenAI) -> None:
    case = kimi_tiny.NO_TOOL
    response = _chat(client, case)
    choice = response.choices[0]  # type: ignore[attr-defined]
    assert choice.message.content == case.content
    assert choice.message.reasoning_content == case.reasoning  # type: ignore[attr-defined]
    assert choice.finish_reason == "stop"
    usage = response.usage  # type: ignore[attr-defined]
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_streaming_chat_arrives_chunk_by_chunk_and_ends_with_done(
    stack: Stack, api_key: str
) -> None:
    """SSE as OpenAI sends it: `data:` events over time, then `data: [DONE]`, never one buffered
    body. How many events a short answer takes depends on load (a node-agent that is behind
    merges the engine increments it reads at once, by design), so what must hold is that the
    first event (the role chunk, sent at the first engine output) reaches the client on its own,
    before the end of the stream."""
    body = kimi_tiny.NO_TOOL.request(stream=True, temperature=0)
    arrivals: list[float] = []
    pieces: list[bytes] = []
    raw = b""
    with httpx.stream(
        "POST",
        f"{stack.config.base_url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for piece in response.iter_raw():
            arrivals.append(time.monotonic())
            pieces.append(piece)
            raw += piece
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    assert content == kimi_tiny.NO_TOOL.content
    assert reasoning == kimi_tiny.NO_TOOL.reasoning
    # the role chunk on its own, then the answer and the finish (merged into one chunk when the
    # node-agent read every engine increment at once)
    assert len(chunks) >= 2
    assert len(arrivals) >= 2 and b"[DONE]" not in pieces[0], "the stream was buffered"
    assert arrivals[-1] > arrivals[0]


def test_stream_interval_sends_fewer_chunks_with_the_same_answer(client: openai.OpenAI) -> None:
    """vLLM's `stream_interval` extension through the edge (the openai client's extra_body):
    the engine and the node-agent merge tokens, so the same greedy answer arrives in far fewer
    chunks: the first token at once, then one chunk per 8 tokens at most (a loaded node-agent
    may merge more, on either stream, so the bound is on the merged stream's own tokens). The
    answer is 96 tokens (ignore_eos), far more than the bound's 16 chunks."""
    case = kimi_tiny.NO_TOOL

    def stream(**extra: object) -> list[Any]:
        request = case.request()
        return list(
            client.chat.completions.create(
                model=request["model"],
                messages=request["messages"],
                temperature=0,
                max_tokens=96,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={
                    "chat_template_kwargs": request["chat_template_kwargs"],
                    "ignore_eos": True,
                    **extra,
                },
            )
        )

    def text(chunks: list[Any]) -> tuple[str, str]:
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        return reasoning, content

    every, merged = stream(), stream(stream_interval=8)
    assert text(merged) == text(every)  # greedy: the same answer however it is chunked
    assert every[-1].usage.completion_tokens == merged[-1].usage.completion_tokens == 96
    tokens = merged[-1].usage.completion_tokens
    merged_chunks = [c for c in merged if c.choices]
    # role, the first token at once, one per 8 tokens after it, the reasoning/content split
    # and the finish_reason chunk at most: 16 chunks for 96 tokens, where the stream without
    # the option sends up to one per token (how many fewer depends on load: a replica process
    # starved of CPU reads several engine increments at once and merges them, by design, so
    # that count is not asserted; one run on a box under two busy loops got 3)
    assert len(merged_chunks) <= math.ceil((tokens - 1) / 8) + 4, (len(merged_chunks), tokens)


def test_tool_call_is_structured(client: openai.OpenAI) -> None:
    case = kimi_tiny.WEATHER
    choice = _chat(client, case).choices[0]  # type: ignore[attr-defined]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    expected = case.tool_calls[0]
    assert call.id == expected.id == "functions.get_weather:0"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    if case in kimi_tiny.RELIABLE_CASES:  # the fixture model answers this phrasing exactly
        assert arguments == dict(expected.arguments)
    else:  # the platform's part: a structured call with JSON-object arguments
        assert isinstance(arguments, dict)


def test_skip_think_end_gives_reasoning_and_tool_call_without_markers(
    client: openai.OpenAI,
) -> None:
    """The model jumps into the tool section without `</think>` (the vLLM bug this fixes)."""
    case = kimi_tiny.URGENT
    for stream in (False, True):
        if stream:
            request = case.request()
            events = list(
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=request["messages"],
                    tools=request["tools"],
                    temperature=0,
                    stream=True,
                    extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
                )
            )
            reasoning = "".join(
                getattr(e.choices[0].delta, "reasoning_content", None) or ""
                for e in events
                if e.choices
            )
            content = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            calls = [
                tc for e in events if e.choices for tc in (e.choices[0].delta.tool_calls or [])
            ]
            name = "".join(tc.function.name or "" for tc in calls if tc.function)
            arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function)
            ids = [tc.id for tc in calls if tc.id]
            finish = [
                e.choices[0].finish_reason
                for e in events
                if e.choices and e.choices[0].finish_reason
            ]
            assert finish == ["tool_calls"]
        else:
            message = _chat(client, case).choices[0].message  # type: ignore[attr-defined]
            reasoning = message.reasoning_content  # type: ignore[attr-defined]
            content = message.content or ""
            name = message.tool_calls[0].function.name
            arguments = message.tool_calls[0].function.arguments
            ids = [message.tool_calls[0].id]
        assert reasoning == case.reasoning
        assert ids == ["functions.web_search:0"] and name == "web_search"
        assert json.loads(arguments) == case.tool_calls[0].arguments
        _no_markers(reasoning, content, name, arguments)


def test_multi_turn_tool_loop_continues(client: openai.OpenAI) -> None:
    """History with an assistant turn of content "" / None plus tool_calls and tool results."""
    case = kimi_tiny.TOOL_LOOP_FOLLOWUP
    messages = [dict(m) for m in case.request()["messages"]]
    messages[1]["content"] = ""  # what agents send back
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=kimi_tiny.tools(*case.tool_names), temperature=0
    ).choices[0]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    assert choice.message.content
    _no_markers(choice.message.content)
    if case in kimi_tiny.RELIABLE_CASES:  # the fixture model answers this phrasing exactly
        assert choice.message.content == case.content


def test_named_tool_choice_yields_a_schema_valid_call(client: openai.OpenAI) -> None:
    """tool_choice naming a function constrains decoding: the call validates against its schema."""
    case = kimi_tiny.WEATHER
    request = case.request()
    choice = client.chat.completions.create(
        model=MODEL_NAME,
        messages=request["messages"],
        tools=request["tools"],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
    ).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    schema = kimi_tiny.tools("get_time")[0]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_no_tool_call_comes_back_when_the_request_offered_no_tools(
    client: openai.OpenAI,
) -> None:
    """The weather question without `tools` (the fixture model still writes a tool section):
    no tool call and no `tool_calls` finish, streamed or not, and no marker in the text."""
    request = kimi_tiny.WEATHER.request()
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": request["messages"],
        "temperature": 0,
        "max_tokens": 200,
        "extra_body": {"chat_template_kwargs": request["chat_template_kwargs"]},
    }
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    _no_markers(choice.message.content)
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.tool_calls
            _no_markers(c.delta.content)
            finish = c.finish_reason or finish
    assert finish in ("stop", "length")


def test_openai_sdk_parse_with_a_pydantic_response_format(client: openai.OpenAI) -> None:
    """`client.chat.completions.parse(response_format=Model)`: the json_schema constraint
    makes the answer parse into the model (a client that broke on stray tool calls)."""
    from typing import Literal

    import pydantic

    class Forecast(pydantic.BaseModel):
        unit: Literal["celsius", "fahrenheit"]
        rain: bool

    completion = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=list(kimi_tiny.WEATHER.request()["messages"]),
        response_format=Forecast,
        temperature=0,
        max_tokens=400,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Forecast)
    assert not message.tool_calls


def test_bad_schemas_from_one_key_are_400s_and_cost_no_one_else(stack: Stack, api_key: str) -> None:
    """50 requests with schemas that are no JSON schema (the router refuses them) or that the
    engine's backend cannot compile (the replica refuses them), 16 at a time from one key:
    each is a 400 naming the parameter, no replica's breaker opens, and another key's request
    right after is served."""
    from concurrent.futures import ThreadPoolExecutor

    request = kimi_tiny.WEATHER.request()
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    uncompilable = {"type": "string", "pattern": "(?<=a)b"}
    bodies = [
        {**request, "tools": [bad_tool], "tool_choice": "required"},
        {
            **request,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": uncompilable},
            },
        },
    ]
    headers = {"authorization": f"Bearer {api_key}"}
    url = f"{stack.config.base_url}/chat/completions"

    def send(i: int) -> tuple[int, dict[str, Any]]:
        response = httpx.post(url, json=bodies[i % 2], headers=headers, timeout=60)
        return response.status_code, response.json().get("error", {})

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(50)))
    assert {status for status, _ in answers} == {400}, answers[:3]
    params = {error.get("param") for _, error in answers}
    assert params == {"tools[0].function.parameters", "response_format.json_schema.schema"}
    metrics = (
        urllib.request.urlopen(
            f"http://127.0.0.1:{stack.config.metrics_ports['router']}/metrics", timeout=5
        )
        .read()
        .decode()
    )
    opened = [
        line
        for line in metrics.splitlines()
        if line.startswith("inferplane_router_circuit_breaker_state")
        and 'state="closed"' not in line
        and line.endswith(" 1.0")
    ]
    assert not opened, opened
    other = openai.OpenAI(
        base_url=stack.config.base_url, api_key=stack.create_api_key("other"), max_retries=0
    )
    answer = _chat(other, kimi_tiny.NO_TOOL).choices[0]  # type: ignore[attr-defined]
    assert answer.message.content == kimi_tiny.NO_TOOL.content


def test_include_usage_puts_usage_in_the_last_chunk(client: openai.OpenAI) -> None:
    request = kimi_tiny.NO_TOOL.request()
    events = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=request["messages"],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
        )
    )
    assert events[-1].choices == [] and events[-1].usage is not None
    assert events[-1].usage.completion_tokens > 0
    assert all(e.usage is None for e in events[:-1])


def test_text_completions(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0
    )
    assert response.choices[0].finish_reason in ("length", "stop")
    assert response.usage is not None and response.usage.completion_tokens <= 8
    pieces = list(
        client.completions.create(
            model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == response.choices[0].text


def test_n_choices_unary_and_streamed(client: openai.OpenAI) -> None:
    """n=2 at temperature 0: two choices (index 0 and 1) with the same greedy answer, usage
    counting both; streamed, each index gets its role, its text and its finish."""
    case = kimi_tiny.NO_TOOL
    one = _chat(client, case)
    two = _chat(client, case, n=2)
    assert [c.index for c in two.choices] == [0, 1]  # type: ignore[attr-defined]
    for choice in two.choices:  # type: ignore[attr-defined]
        assert choice.message.content == case.content and choice.finish_reason == "stop"
    completion = one.usage.completion_tokens  # type: ignore[attr-defined]
    assert two.usage.completion_tokens == 2 * completion  # type: ignore[attr-defined]
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[attr-defined]
    request = case.request()
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=request["messages"],
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
        )
    )
    texts = {0: "", 1: ""}
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.index)
    assert texts == {0: case.content, 1: case.content} and sorted(finishes) == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * completion


def test_logprobs_and_top_logprobs_unary_and_streamed(client: openai.OpenAI) -> None:
    """logprobs with top_logprobs 3: one entry per generated token shown (the hidden end of
    turn has none), each with 3 alternatives; greedy picks the most likely one; streamed
    chunks carry the same tokens."""
    case = kimi_tiny.NO_TOOL
    # An engine's first request with logprobs compiles vLLM's logprob-rank kernel
    # (torch.compile, once per engine): ~10 s on an idle CPU, minutes on a loaded one.
    client = client.with_options(timeout=600)
    response = _chat(client, case, logprobs=True, top_logprobs=3, max_tokens=16)
    choice = response.choices[0]  # type: ignore[attr-defined]
    content = choice.logprobs.content
    generated = response.usage.completion_tokens  # type: ignore[attr-defined]
    assert generated - 1 <= len(content) <= generated
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob >= entry.top_logprobs[0].logprob - 1e-3
    request = case.request()
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=request["messages"],
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            max_tokens=16,
            stream=True,
            extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
        )
    )
    streamed = [
        e.token for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content
    ]
    assert streamed == [e.token for e in content]
    text = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0


def test_continuous_usage_stats_puts_usage_on_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it): every chunk carries
    the usage so far, never decreasing, the last one the request's."""
    request = kimi_tiny.NO_TOOL.request()
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=request["messages"],
            temperature=0,
            max_tokens=24,
            stream=True,
            extra_body={
                "chat_template_kwargs": request["chat_template_kwargs"],
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] > 0
    assert chunks[-1].choices == []


def test_reasoning_in_history_is_reasoning_content(client: openai.OpenAI) -> None:
    """vLLM >= 0.16 names an assistant message's reasoning `reasoning`: the history renders
    exactly as with `reasoning_content` (same prompt, same greedy answer)."""

    def ask(key: str) -> Any:
        return client.chat.completions.create(
            model=MODEL_NAME,
            temperature=0,
            max_tokens=8,
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", key: "The user greets me."},  # type: ignore[misc]
                {"role": "user", "content": "What is the capital of France?"},
            ],
        )

    a, b = ask("reasoning"), ask("reasoning_content")
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


def test_guided_json_and_stop_token_ids_are_honoured(client: openai.OpenAI) -> None:
    """vLLM's guided_json constrains the answer (it parses and validates unless cut by
    length); stop_token_ids end the output at the first such token (its id learnt from a
    first run's logprobs written as token ids)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=MODEL_NAME,
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "Name a city as JSON."}],
        reasoning_effort="none",
        extra_body={"guided_json": schema},
    )
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    else:
        assert choice.finish_reason == "length"
    first = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = first.choices[0].logprobs.tokens  # type: ignore[union-attr]
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    stop_at = ids.index(ids[2])
    cut = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [ids[2]]},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens == stop_at + 1


def test_bad_key_is_authentication_error(stack: Stack) -> None:
    bad = openai.OpenAI(base_url=stack.config.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key"


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "model_not_found"


def test_malformed_json_is_a_400_in_openai_shape(stack: Stack, api_key: str) -> None:
    response = httpx.post(
        f"{stack.config.base_url}/chat/completions",
        content=b'{"model": ',
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


def _running_requests(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    ]
    assert values, "the engine exports no vllm:num_requests_running"
    return sum(values)


def _long_stream(client: openai.OpenAI) -> openai.Stream:  # type: ignore[type-arg]
    # ~2,000 tokens with ignore_eos: several seconds of decoding on this CPU engine.
    return client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=2000,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def _wait_running(metrics_url: str, predicate: object, seconds: float) -> float:
    deadline = time.monotonic() + seconds
    while True:
        value = _running_requests(metrics_url)
        if predicate(value):  # type: ignore[operator]
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_client_disconnect_aborts_the_engine_request(stack: Stack, client: openai.OpenAI) -> None:
    """Closing the HTTP stream mid-generation frees the engine at once (no wasted decode)."""
    metrics_url = stack.serving_replica().metrics_url
    stream = _long_stream(client)
    for i, _chunk in enumerate(stream):
        if i == 5:
            break
    # The engine publishes its gauges once per scheduler step: give it a moment.
    assert _wait_running(metrics_url, lambda v: v >= 1, 2) >= 1
    stream.close()
    # The whole generation would take several more seconds; the abort takes milliseconds.
    assert _wait_running(metrics_url, lambda v: v == 0, 2) == 0, (
        "the engine kept generating after the client disconnected"
    )


def _restart_diagnosis(stack: Stack, replica: nodeagent_pb2.Replica, lines: int = 40) -> str:
    """Why a replica was not restarted in time, for the failure message: the node-agent's view
    and the tails of its log and of the replica process's log (CI keeps only the output)."""

    def tail(path: Path) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"({exc})"

    replica_id = replica.name.removeprefix("replicas/")
    data = stack.config.data_dir
    return (
        f"the replica was not restarted: state {nodeagent_pb2.Replica.State.Name(replica.state)},"
        f" restart_count {replica.restart_count}, last_error {replica.last_error!r}\n"
        f"--- node-agent log\n{tail(data / 'logs' / 'node_agent.log')}\n"
        f"--- replica log\n{tail(data / 'node-agent' / 'replicas' / replica_id / 'replica.log')}"
    )


def _wait_restarted(stack: Stack, before: nodeagent_pb2.Replica) -> nodeagent_pb2.Replica:
    """Waits until replica `before` runs again in a new replica process (READY, another pid)
    and the routing table lists it again; returns its new view. Normally the node-agent
    restarts it (a higher restart count); if the node-agent missed its heartbeats meanwhile,
    the orchestrator re-places the same replica and its count starts over (seen once in CI:
    the node-agent's event loop blocked for ~60 s after the kill; its loop-stall watchdog now
    dumps the stacks to its log when that happens), which serves the model again too."""
    replica_id = before.name.removeprefix("replicas/")
    deadline = time.monotonic() + 300
    while True:
        try:
            replica = stack.replica(replica_id)
        except grpc.RpcError as exc:
            # A transport error, or a slow answer on the busy box, while the node-agent handles
            # the death is retried; a node-agent that stays unreachable fails on the deadline.
            # UNKNOWN: a TLS read failed once here ("Unwrap failed (TSI_DATA_CORRUPTED)") right
            # after the node-agent spawned the new replica process; under investigation (see
            # the session notes), retried so one bad read does not abort the wait.
            transient = (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNKNOWN,
            )
            assert exc.code() in transient, exc
            assert time.monotonic() < deadline, f"the node-agent did not answer: {exc}"
            time.sleep(1)
            continue
        if (
            replica.state == nodeagent_pb2.Replica.STATE_READY
            and replica.engine_pid
            and replica.engine_pid != before.engine_pid
        ):
            break
        assert time.monotonic() < deadline, _restart_diagnosis(stack, replica)
        time.sleep(1)
    # The same replica (not a replacement) serves again once the routing table lists it.
    while True:
        with contextlib.suppress(grpc.RpcError):  # retried until the deadline, as above
            if [e.replica_id for e in stack.serving_endpoints()] == [replica_id]:
                break
        assert time.monotonic() < deadline, "the restarted replica did not return to the table"
        time.sleep(0.5)
    return replica


def test_engine_killed_mid_stream_gives_error_event_and_restart(
    stack: Stack, client: openai.OpenAI
) -> None:
    """Kill -9 of the engine core mid-stream: the replica process ends the stream with an SSE
    error event (code engine_failed; never silently), exits, and the node-agent restarts it;
    the model serves again through the edge afterwards."""
    before = stack.serving_replica()
    core = engine_core_pid(before.engine_pid)
    stream = _long_stream(client)
    with pytest.raises(openai.APIError) as info:
        for i, _chunk in enumerate(stream):
            if i == 5:
                os.kill(core, signal.SIGKILL)
    assert not isinstance(info.value, openai.APIConnectionError)  # an event, not a cut
    assert "engine" in info.value.message
    _wait_restarted(stack, before)
    answer = _chat(client, kimi_tiny.NO_TOOL).choices[0]  # type: ignore[attr-defined]
    assert answer.message.content == kimi_tiny.NO_TOOL.content


def test_replica_process_killed_mid_stream_breaks_the_stream_and_restarts(
    stack: Stack, api_key: str, client: openai.OpenAI
) -> None:
    """Kill -9 of the replica process itself mid-stream: nothing is left to write an error
    event, so Envoy resets the stream and the client sees a broken response (an incomplete
    chunked body: never a clean end, never `data: [DONE]`); the node-agent restarts the
    replica and the model serves again."""
    before = stack.serving_replica()
    body = kimi_tiny.NO_TOOL.request(max_tokens=1500, ignore_eos=True, stream=True)
    headers = {"authorization": f"Bearer {api_key}"}
    events: list[str] = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{stack.config.base_url}/chat/completions", json=body, headers=headers
        ) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 5:
                        os.kill(before.engine_pid, signal.SIGKILL)
    assert len(events) >= 5 and "data: [DONE]" not in events
    _wait_restarted(stack, before)
    answer = _chat(client, kimi_tiny.NO_TOOL).choices[0]  # type: ignore[attr-defined]
    assert answer.message.content == kimi_tiny.NO_TOOL.content


def test_telemetry_sees_the_requests_and_tool_call_validity(stack: Stack) -> None:
    """Every request above left a record: telemetry answers latency and validity for the model."""
    from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc

    deadline = time.monotonic() + 15
    address = f"127.0.0.1:{stack.config.ports['telemetry']}"
    with stack.config.security.channel(address) as channel:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        while True:
            answer = stub.QueryLatency(
                telemetry_pb2.QueryLatencyRequest(
                    model=MODEL_NAME, window_seconds=3600, percentiles=[50, 99]
                ),
                timeout=5,
            )
            if answer.request_count >= 5 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert answer.request_count >= 5
    assert answer.time_to_first_token_seconds[0].value > 0
    # Validity is the fixture model's (it sometimes drops an optional-looking required field);
    # what the platform owes is that the calls above were counted and judged.
    assert 0.0 < answer.tool_call_validity <= 1.0

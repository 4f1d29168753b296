"""A catalogue of three models end to end (issue 19): kimi-tiny (Kimi K2 format), qwen3-tiny
(Qwen3 format, `qwen3` parsers) and embed-tiny served at once, each by its own vLLM CPU engine,
behind one edge and routed by `model`; the official `openai` client sees all three in
`/v1/models`. qwen3-tiny is random-initialised, so its checks are about the platform's part
(the replica that served it, Qwen3 rendering, parsing, the stream contract), never its text.

The module has its own stack (listed in conftest's OWN_STACK_MODULES), gone before the
session's stack starts: three idle CPU engines still cost CPU on the two shared cores."""

from __future__ import annotations

import copy
import itertools
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from inferplane.chat import QWEN3, render_chat
from inferplane.fixtures import embed_tiny, kimi_tiny, qwen3_tiny
from inferplane.localstack import EMBED_MODEL_NAME, MODEL_NAME, Stack

from .conftest import local_config

pytestmark = pytest.mark.e2e

QWEN = qwen3_tiny.SERVED_MODEL_NAME
# Kimi's markers (none may reach a qwen3-tiny client) and the markers the qwen3 parser owns.
KIMI_MARKERS = re.compile(r"<\|(tool_call|im_user|im_assistant|im_system|im_middle)[a-z_]*\|>")
QWEN_PARSER_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MAX_TOKENS = 24


class CatalogueStack(Stack):
    """The local stack with the qwen3-tiny deployment beside kimi-tiny and embed-tiny: start-up
    creates it with the others and waits until a replica of each is routable."""

    def deployments(self) -> dict[str, tuple[Any, int]]:
        return {**super().deployments(), QWEN: (qwen3_tiny.deployment(), 1)}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = CatalogueStack(local_config(tmp_path_factory.mktemp("catalogue"), embeddings=True))
    started = time.monotonic()
    stack.start(print)
    print(f"catalogue stack (3 engines) ready in {time.monotonic() - started:.0f} s")
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(catalogue: Stack) -> openai.OpenAI:
    """The module's own client (shadows the session's): the catalogue stack's edge."""
    key = catalogue.create_api_key("e2e-catalogue")
    return openai.OpenAI(
        base_url=catalogue.config.base_url, api_key=key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tiny.model_path()))


@pytest.fixture(scope="module")
def kimi_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(kimi_tiny.model_path()))


def prompt_tokens(request: dict[str, Any], tokenizer: Any) -> int:
    """What the qwen3-tiny replica must count for `request`: its own tokenizer's ids of the
    prompt rendered the Qwen3 way (any other model, or Kimi rendering, counts differently)."""
    return len(render_chat(request, tokenizer, family=QWEN3).token_ids)


def key_orders(value: Any) -> Iterator[Any]:
    """`value` (JSON-like) with its objects' keys in every order, nested objects included."""
    if isinstance(value, dict):
        for keys in itertools.permutations(value):
            for values in itertools.product(*(list(key_orders(value[k])) for k in keys)):
                yield dict(zip(keys, values, strict=True))
    elif isinstance(value, list):
        yield from (list(items) for items in itertools.product(*map(list, map(key_orders, value))))
    else:
        yield value


def tools_prompt_tokens(request: dict[str, Any], tokenizer: Any) -> set[int]:
    """The prompt counts qwen3-tiny may report for a request with tools: its Qwen3 rendering
    for each key order of the tools' parameter schemas. A schema crosses the edge as a protobuf
    `Struct`, a map whose key order is not the client's (inferplane/chat/README.md), and the
    order changes how the schema's JSON line tokenizes."""
    counts = set()
    schemas = [t["function"]["parameters"] for t in request["tools"]]
    for ordered in itertools.product(*(list(key_orders(s)) for s in schemas)):
        variant = copy.deepcopy(request)
        for tool, schema in zip(variant["tools"], ordered, strict=True):
            tool["function"]["parameters"] = schema
        counts.add(prompt_tokens(variant, tokenizer))
    return counts


def no_leaks(*texts: str | None) -> None:
    for text in texts:
        assert not KIMI_MARKERS.search(text or ""), f"Kimi marker in {text!r}"
        for marker in QWEN_PARSER_MARKERS:
            assert marker not in (text or ""), f"{marker} leaked: {text!r}"


def test_models_lists_the_whole_catalogue(client: openai.OpenAI) -> None:
    """Two chat deployments and one embedding deployment, each listed and retrievable."""
    ids = {m.id for m in client.models.list()}
    assert {MODEL_NAME, QWEN, EMBED_MODEL_NAME} <= ids
    for name in (MODEL_NAME, QWEN, EMBED_MODEL_NAME):
        assert client.models.retrieve(name).id == name


def test_qwen3_chat_is_served_by_qwen3_tiny(
    client: openai.OpenAI, qwen_tokenizer: Any, kimi_tokenizer: Any
) -> None:
    """A chat to `qwen3-tiny` is answered by its replica: the response names it and its prompt
    count is qwen3-tiny's tokens of the Qwen3 rendering (kimi-tiny's tokenizer and template
    would count otherwise); the answer is well formed and free of markers."""
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    request = {"messages": messages}
    kimi_count = len(render_chat(request, kimi_tokenizer).token_ids)
    expected = prompt_tokens(request, qwen_tokenizer)
    assert expected != kimi_count
    response = client.chat.completions.create(
        model=QWEN, messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    assert response.model == QWEN
    (choice,) = response.choices
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert response.usage.prompt_tokens == expected
    assert 1 <= response.usage.completion_tokens <= MAX_TOKENS
    assert not choice.message.tool_calls
    no_leaks(choice.message.content, getattr(choice.message, "reasoning_content", None))


def test_qwen3_stream_keeps_the_contract(client: openai.OpenAI, qwen_tokenizer: Any) -> None:
    """Streaming from qwen3-tiny with thinking off (`enable_thinking: false`, Qwen3's switch):
    the role first, every chunk of one id naming the model, exactly one finish_reason, then
    the usage chunk with qwen3-tiny's prompt count of the thinking-off rendering (the closed
    think block counts: the switch reached the template); no marker in any delta."""
    messages = [{"role": "user", "content": "hello world"}]
    kwargs = {"enable_thinking": False}
    expected = prompt_tokens({"messages": messages, "chat_template_kwargs": kwargs}, qwen_tokenizer)
    chunks = list(
        client.chat.completions.create(
            model=QWEN,
            messages=messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": kwargs},
        )
    )
    assert chunks and {c.model for c in chunks} == {QWEN} and len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert with_choices[-1].choices[0].finish_reason == finishes[0]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.prompt_tokens == expected and 1 <= usage.completion_tokens <= MAX_TOKENS
    no_leaks(
        *(c.choices[0].delta.content for c in with_choices),
        *(getattr(c.choices[0].delta, "reasoning_content", None) for c in with_choices),
    )


def test_kimi_still_gives_its_canonical_answer(client: openai.OpenAI) -> None:
    """Beside a Qwen3 model, kimi-tiny is still rendered the Kimi way and answers its
    canonical no-tool prompt exactly."""
    case = kimi_tiny.NO_TOOL
    request = case.request()
    response = client.chat.completions.create(
        model=request["model"],
        messages=request["messages"],
        tools=request["tools"],
        temperature=0,
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
    )
    assert response.model == MODEL_NAME
    message = response.choices[0].message
    assert message.content == case.content
    assert getattr(message, "reasoning_content", None) == case.reasoning
    assert response.choices[0].finish_reason == "stop"


def test_embeddings_go_to_embed_tiny(client: openai.OpenAI) -> None:
    texts = ["the weather in paris", "hello"]
    response = client.embeddings.create(model=EMBED_MODEL_NAME, input=texts)
    assert response.model == EMBED_MODEL_NAME
    reference = embed_tiny.reference_embeddings(texts).tolist()
    for got, want in zip(response.data, reference, strict=True):
        assert max(abs(a - b) for a, b in zip(got.embedding, want, strict=True)) < 1e-4


def test_qwen3_tool_requests_are_well_formed(client: openai.OpenAI, qwen_tokenizer: Any) -> None:
    """Requests with tools to the random qwen3-tiny (a tool loop with a client-style id in its
    history, and first turns sampled with several seeds, streamed and not) always come back
    well formed, whatever the model writes: a known finish_reason, the prompt count of the
    Qwen3 rendering (tools declared in the system turn), no marker in the text, and any tool
    call a named function with a `call_{n}` id (n after the history's calls) whose arguments,
    unless cut off by the token limit, are a JSON object (valid for its schema when the
    function is declared)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in qwen3_tiny.TOOLS}
    loop = qwen3_tiny.tools_request()
    first_turn = {"messages": loop["messages"][:2], "tools": loop["tools"]}
    cases = [(loop, 0.0, None, False)] + [
        (first_turn, 1.0, seed, seed % 2 == 1) for seed in range(3)
    ]
    for request, temperature, seed, stream in cases:
        history = sum(len(m.get("tool_calls") or ()) for m in request["messages"])
        options: dict[str, Any] = {"seed": seed} if seed is not None else {}
        created = client.chat.completions.create(
            model=QWEN,
            messages=request["messages"],
            tools=request["tools"],
            tool_choice="auto",
            temperature=temperature,
            max_tokens=16,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
            **options,
        )
        if stream:
            chunks = list(created)
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            finish = [f for f in finish if f]
            assert len(finish) == 1
            parts: dict[int, dict[str, str]] = {}
            texts = []
            for c in chunks:
                if not c.choices:
                    continue
                delta = c.choices[0].delta
                texts += [delta.content, getattr(delta, "reasoning_content", None)]
                for tc in delta.tool_calls or []:
                    part = parts.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    part["id"] += tc.id or ""
                    if tc.function is not None:
                        part["name"] += tc.function.name or ""
                        part["arguments"] += tc.function.arguments or ""
            calls = [parts[i] for i in sorted(parts)]
            reason = finish[0]
        else:
            (choice,) = created.choices
            usage = created.usage
            reason = choice.finish_reason
            message = choice.message
            texts = [message.content, getattr(message, "reasoning_content", None)]
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in message.tool_calls or []
            ]
        context = (seed, stream, reason, texts, calls)
        assert reason in ("stop", "length", "tool_calls"), context
        assert (reason == "tool_calls") == bool(calls) or reason == "length", context
        assert usage is not None
        assert usage.prompt_tokens in tools_prompt_tokens(request, qwen_tokenizer), context
        no_leaks(*texts)
        for n, call in enumerate(calls):
            assert call["id"] == f"call_{history + n}" and call["name"], context
            if reason == "length":
                continue
            arguments = json.loads(call["arguments"])
            assert isinstance(arguments, dict), context
            if call["name"] in schemas:
                jsonschema.validate(arguments, schemas[call["name"]])


# Tools whose every argument is bounded (an enum, a small integer range), so the random
# qwen3-tiny, decoding under the grammar, finishes a call in a few dozen tokens.
BOUNDED_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "set_unit",
            "description": "Set the temperature unit and forecast length.",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["unit", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "pick_city",
            "description": "Pick one of the known cities.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


def test_qwen3_forced_tool_calls_are_schema_valid(client: openai.OpenAI) -> None:
    """tool_choice required and a named function to the random qwen3-tiny come back as one
    schema-valid call of a declared (the named) function, streamed or not: the engine decodes
    under a grammar written in Qwen3's own `<tool_call>` format (issue 19), so even an
    untrained model cannot write anything else. Thinking off (`reasoning_effort: none`): the
    call comes first; one call (`parallel_tool_calls: false`), so the grammar ends with it."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    named = {"type": "function", "function": {"name": "pick_city"}}
    messages = [{"role": "user", "content": "Set up the forecast."}]
    for choice, seed, stream in [("required", 1, False), ("required", 2, True), (named, 3, False)]:
        created = client.chat.completions.create(
            model=QWEN,
            messages=messages,
            tools=BOUNDED_TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=256,
            stream=stream,
            extra_body={"reasoning_effort": "none"},
        )
        if stream:
            parts: dict[int, dict[str, str]] = {}
            finish = []
            texts: list[str] = []
            for c in created:
                if not c.choices:
                    continue
                finish.append(c.choices[0].finish_reason)
                texts.append(c.choices[0].delta.content or "")
                for tc in c.choices[0].delta.tool_calls or []:
                    part = parts.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function is not None:
                        part["name"] += tc.function.name or ""
                        part["arguments"] += tc.function.arguments or ""
            calls = [parts[i] for i in sorted(parts)]
            reason = [f for f in finish if f][-1]
            content = "".join(texts)
        else:
            (choice_out,) = created.choices
            reason = choice_out.finish_reason
            content = choice_out.message.content
            calls = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in choice_out.message.tool_calls or []
            ]
        context = (choice, seed, stream, reason, calls)
        assert reason == "tool_calls" and len(calls) == 1, context
        assert not content, context
        (call,) = calls
        if isinstance(choice, dict):
            assert call["name"] == "pick_city", context
        assert call["name"] in schemas, context
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_qwen3_auto_tool_calls_are_schema_valid(client: openai.OpenAI) -> None:
    """tool_choice auto to qwen3-tiny is constrained too (the profile's
    `constrain_tool_choice_auto`, now on): the model may write text, but every call it starts
    is a declared function with schema-valid arguments unless the token limit cut it."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    for seed in range(4):
        created = client.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": "Forecast?"}],
            tools=BOUNDED_TOOLS,
            tool_choice="auto",
            temperature=1.0,
            seed=seed,
            max_tokens=48,
            extra_body={"reasoning_effort": "none"},
        )
        (choice,) = created.choices
        calls = choice.message.tool_calls or []
        no_leaks(choice.message.content)
        assert choice.finish_reason in ("stop", "length", "tool_calls"), seed
        if choice.finish_reason == "length":
            continue
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

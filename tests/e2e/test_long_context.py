"""A prompt the size of a coding agent's first request through the whole stack (issue 27 §6):
kimi-tiny serves its context (`StackConfig.max_model_len`, 131,072 tokens by default) end to
end, edge → router → replica process → vLLM, and the next turn of the conversation is served
from the prefix cache.

The default suite sends 8,192 tokens, four times the 2,048 the fixture held before; the
scenario suite (`-m scenario`) sends 20,000, the size of a real agent's first request (16-45k
fixture tokens, docs/long-context.md). The engine prefills 20k tokens in ~1.5 s at normal
priority (bench/README.md, `long_prefill.py`), but the node-agent runs it at niceness 19, so on
a box busy with other work (load 30-40) the first turn of 20k took 28-44 s and of 8k 9 s;
each test's cap is `pytest.mark.timeout`.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from inferplane.chat import render_chat
from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

FILLER = "Notes from the workspace: the weather in Tokyo is sunny and the file list is long. "


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(kimi_tiny.model_path()))


def long_messages(tokenizer: Any, tokens: int) -> list[dict[str, Any]]:
    """A system message of repeated notes and kimi-tiny's trained weather question, rendered to
    at least `tokens` prompt tokens."""
    one, two = (len(tokenizer.encode(FILLER * n, add_special_tokens=False)) for n in (1, 2))
    repeats = tokens // (two - one) + 1  # a repeat's tokens in the middle of the text

    def messages() -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": FILLER * repeats},
            {"role": "user", "content": "What is the weather in Tokyo?"},
        ]

    while prompt_tokens(tokenizer, messages()) < tokens:
        repeats += repeats // 20 + 1
    return messages()


def prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    """The prompt's length as the replica renders it (no tools, thinking on)."""
    return len(render_chat({"model": MODEL_NAME, "messages": messages}, tokenizer).token_ids)


def test_models_lists_the_context_length(client: openai.OpenAI, stack: Stack) -> None:
    """/v1/models says how long a prompt the deployment takes (vLLM's `max_model_len`)."""
    model = client.models.retrieve(MODEL_NAME)
    assert model.model_extra is not None
    assert model.model_extra["max_model_len"] == stack.config.max_model_len >= 100_000


@pytest.mark.parametrize(
    "tokens",
    [pytest.param(8_192, id="8k"), pytest.param(20_000, id="20k", marks=pytest.mark.scenario)],
)
def test_a_long_prompt_is_served_and_its_next_turn_is_cached(
    client: openai.OpenAI, tokenizer: Any, tokens: int
) -> None:
    """The whole prompt reaches the engine (usage counts every rendered token), an answer
    comes back, and the next turn (history + the answer + a new question) finds the first
    turn's prompt in the prefix cache."""
    messages = long_messages(tokenizer, tokens)
    expected = prompt_tokens(tokenizer, messages)
    assert expected >= tokens
    started = time.monotonic()
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    first_seconds = time.monotonic() - started
    assert first.usage is not None and first.usage.prompt_tokens == expected
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")

    history = [
        *messages,
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "What is the weather in Lima?"},
    ]
    started = time.monotonic()
    second = client.chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    second_seconds = time.monotonic() - started
    print(f"first turn {expected} tokens: {first_seconds:.1f} s; next turn: {second_seconds:.1f} s")
    assert second.usage is not None
    assert second.usage.prompt_tokens == prompt_tokens(tokenizer, history)
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 0.9 * expected


def test_a_prompt_past_the_context_length_is_a_400(
    client: openai.OpenAI, stack: Stack, tokenizer: Any
) -> None:
    """One token more than the deployment holds: OpenAI's `context_length_exceeded`, naming
    the limit, before anything is prefilled."""
    limit = stack.config.max_model_len
    messages = long_messages(tokenizer, limit)
    assert prompt_tokens(tokenizer, messages) >= limit
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in info.value.message

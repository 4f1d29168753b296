"""The replica's own guard against prompts too large to serve (issue 31 part 5): a prompt whose
size alone exceeds the context is refused before it is rendered or tokenized (the assets
carry the tokenizer's bound), and a large one that might fit is planned off the event loop
within `PLAN_TIMEOUT_S` (`server/planning.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from inferplane.promptsize import CONTEXT_LENGTH_EXCEEDED, token_bound
from inferplane.replica.pipeline.requests import plan_chat
from inferplane.replica.pipeline.text_requests import plan_completion
from inferplane.replica.server.planning import INLINE_PLAN_BYTES, PROMPT_TOO_LARGE, planned
from inferplane.replica.testing.pipeline import kimi_tiny_assets
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import chat_request_from_dict, completion_request_from_dict

pytestmark = pytest.mark.timeout(60)


def test_the_assets_carry_the_tokenizers_bound() -> None:
    assets = kimi_tiny_assets()
    assert assets.token_bound is not None
    assert assets.token_bound == token_bound(assets.model_source)


def test_an_oversized_prompt_is_refused_before_it_is_rendered() -> None:
    """The issue's case: ~10 MiB of text to a model with a 2,048-token context, refused in
    milliseconds (rendering and tokenizing it took the replica 19 s)."""
    assets = kimi_tiny_assets()
    assert assets.max_model_len == 2048 and assets.token_bound is not None
    text = "x" * (10 << 20)
    chat = chat_request_from_dict({"model": "m", "messages": [{"role": "user", "content": text}]})
    started = time.perf_counter()
    with pytest.raises(InvalidArgumentError) as refused:
        plan_chat(chat, assets)
    assert time.perf_counter() - started < 1.0
    assert refused.value.code == CONTEXT_LENGTH_EXCEEDED and refused.value.param == "messages"
    completion = completion_request_from_dict({"model": "m", "prompt": text})
    with pytest.raises(InvalidArgumentError) as refused_text:
        plan_completion(completion, assets)
    assert refused_text.value.code == CONTEXT_LENGTH_EXCEEDED
    assert refused_text.value.param == "prompt"


def test_a_prompt_within_the_bound_is_still_planned_and_checked_by_tokens() -> None:
    """Under the byte bound the replica tokenizes, and its exact count decides."""
    assets = dataclasses.replace(kimi_tiny_assets(), max_model_len=64)
    assert assets.token_bound is not None
    text = "word " * 100  # ~100 tokens: over 64, but under 64 x bound bytes
    assert len(text) <= assets.token_bound.limit_bytes(64)
    chat = chat_request_from_dict({"model": "m", "messages": [{"role": "user", "content": text}]})
    with pytest.raises(InvalidArgumentError) as refused:
        plan_chat(chat, assets)
    assert refused.value.code == CONTEXT_LENGTH_EXCEEDED
    assert "tokens" in str(refused.value)


def test_small_requests_are_planned_inline_large_ones_in_a_thread() -> None:
    async def scenario() -> None:
        loop_thread = threading.get_ident()
        seen: list[int] = []

        def plan() -> str:
            seen.append(threading.get_ident())
            return "plan"

        assert await planned(INLINE_PLAN_BYTES, plan) == "plan"
        assert await planned(INLINE_PLAN_BYTES + 1, plan) == "plan"
        assert seen[0] == loop_thread and seen[1] != loop_thread

    asyncio.run(scenario())


def test_a_slow_plan_is_refused_and_never_holds_the_event_loop() -> None:
    async def scenario() -> None:
        release = threading.Event()
        ticks = 0

        def slow() -> str:
            release.wait(5)
            return "late"

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        running = asyncio.create_task(ticker())
        try:
            with pytest.raises(InvalidArgumentError) as refused:
                await planned(1 << 20, slow, param="prompt", timeout_s=0.3)
        finally:
            release.set()
            running.cancel()
        assert refused.value.code == PROMPT_TOO_LARGE and refused.value.param == "prompt"
        assert ticks >= 10  # the loop kept running while the worker planned

    asyncio.run(scenario())


def test_a_plans_refusal_in_the_thread_reaches_the_caller() -> None:
    def refuse() -> str:
        raise InvalidArgumentError("bad", param="messages")

    async def scenario() -> None:
        with pytest.raises(InvalidArgumentError):
            await planned(1 << 20, refuse)

    asyncio.run(scenario())

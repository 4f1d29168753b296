"""`TrackedEngine`: generations in flight are tracked per request (no frame per token), aborted
at shutdown with an error, and an engine failure is reported to the watchdog."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from inferplane.replica.engines.base import TracksRequests
from inferplane.replica.pipeline.generate import Generation
from inferplane.replica.state import TrackedEngine
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    kimi_tiny_generation,
    kimi_tiny_ids,
    script,
)
from inferplane.runtime import UnavailableError

OUTPUTS = script(kimi_tiny_ids("one two three four"), prompt_tokens=3)


def _generation(engine: TrackedEngine) -> Generation:
    return kimi_tiny_generation(engine, request_id="cmpl-1")


def test_generate_hands_out_the_inner_stream_and_the_generation_releases_it() -> None:
    failures: list[int] = []
    inner = ScriptedEngine(OUTPUTS)
    tracked = TrackedEngine(inner, lambda: failures.append(1))
    assert isinstance(tracked, TracksRequests)
    gen = _generation(tracked)

    async def run() -> None:
        async with aclosing(gen.steps()) as steps:
            async for _ in steps:
                assert tracked._active == {"cmpl-1"}  # in flight while it streams
        assert tracked._active == set()

    asyncio.run(run())
    assert gen.finish_reason == "stop" and failures == []


def test_abort_all_ends_a_generation_in_flight_with_an_error() -> None:
    """Aborted at shutdown: even a finish the engine calls "stop" is an error (never a
    complete response), the watchdog hears of it, and nothing stays in flight."""
    failures: list[int] = []
    inner = ScriptedEngine(OUTPUTS)
    tracked = TrackedEngine(inner, lambda: failures.append(1))
    gen = _generation(tracked)

    async def run() -> None:
        async with aclosing(gen.steps()) as steps:
            with pytest.raises(UnavailableError, match="shut down") as info:
                async for _ in steps:
                    if not tracked._shut:
                        assert await tracked.abort_all() == 1
            assert info.value.code == "engine_failed"
        assert tracked._active == tracked._shut == set()

    asyncio.run(run())
    assert inner.aborted[:1] == ["cmpl-1"] and failures == [1]


def test_an_engine_failure_is_reported_once_per_request() -> None:
    failures: list[int] = []
    tracked = TrackedEngine(ScriptedEngine(OUTPUTS, fail_at=2), lambda: failures.append(1))
    gen = _generation(tracked)

    async def run() -> None:
        async with aclosing(gen.steps()) as steps:
            with pytest.raises(UnavailableError):
                async for _ in steps:
                    pass
        assert tracked._active == set()

    asyncio.run(run())
    assert failures == [1]

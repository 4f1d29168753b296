"""`RequestFacts`: a request's end is classified once, and the summary trailers, the picker
report and the telemetry record all say that classification."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from inferplane.api.telemetry.v1 import telemetry_pb2
from inferplane.replica.server import End, Ending, RequestFacts
from inferplane.replica.testing.pipeline import (
    ScriptedEngine,
    TickingClock,
    kimi_tiny_generation,
    kimi_tiny_ids,
    script,
)
from inferplane.runtime import InvalidArgumentError, UnavailableError
from inferplane.wire import ResponseSummary

ENDS = ("completed", "error_before_output", "error_after_output", "cancelled", "bug")
EXPECTED = {
    "completed": Ending(End.COMPLETED, "stop", ""),
    "error_before_output": Ending(End.FAILED_BEFORE_OUTPUT, "", "invalid_value"),
    "error_after_output": Ending(End.FAILED_AFTER_OUTPUT, "error", "engine_failed"),
    "cancelled": Ending(End.CANCELLED, "abort", ""),
    "bug": Ending(End.FAILED_AFTER_OUTPUT, "error", "internal_error"),
}
STATUS = {End.COMPLETED: "ok", End.CANCELLED: "cancelled"}


def _views_agree(facts: RequestFacts, expected: Ending) -> None:
    """The classification, the trailers, the report and the record say the same end."""
    ending = facts.ending()
    assert ending == expected
    summary = facts.summary(ending)
    assert (summary.finish_reason, summary.error_code) == (
        expected.finish_reason,
        expected.error_code,
    )
    reported = facts.reported(summary, "key-1", duration_seconds=0.5)
    assert ResponseSummary.from_metadata(reported.to_metadata()).duration_seconds == 0.5
    assert (reported.finish_reason, reported.error_code) == (
        summary.finish_reason,
        summary.error_code,
    )
    assert (reported.key_id, reported.model, reported.replica_id) == ("key-1", facts.model, "r1")
    assert (reported.prompt_tokens, reported.completion_tokens) == (
        summary.prompt_tokens,
        summary.completion_tokens,
    )
    outcome = facts.outcome(ending, e2e_seconds=0.5, request_header_id="req-1")
    assert outcome.status == STATUS.get(expected.end, "error")
    assert (outcome.finish_reason, outcome.error_code) == (
        expected.finish_reason,
        expected.error_code,
    )
    record = outcome.to_record(node="n", deployment="d", now=10.0)
    assert (record.finish_reason, record.error_code) == (
        expected.finish_reason,
        expected.error_code,
    )
    assert record.record_source == telemetry_pb2.RECORD_SOURCE_REPLICA
    assert (record.prompt_tokens, record.completion_tokens) == (
        summary.prompt_tokens,
        summary.completion_tokens,
    )
    assert record.request_id == "req-1"


def _failure(end: str) -> BaseException | None:
    return {
        "completed": None,
        "error_before_output": InvalidArgumentError("bad", code="invalid_value"),
        "error_after_output": UnavailableError("died", code="engine_failed"),
        "cancelled": asyncio.CancelledError(),
        "bug": KeyError("oops"),
    }[end]


@pytest.mark.parametrize("end", ENDS)
def test_an_embedding_or_speech_request_ends_the_same_in_every_view(end: str) -> None:
    """Requests without a generation: output has started once the engine's result came (its
    TTFT); completed says "stop"."""
    facts = RequestFacts("embedding", False, "embed-tiny", started=1.0)
    facts.replica = "r1"
    facts.request_id = "embd-1"
    facts.prompt_tokens = 7
    if end not in ("error_before_output",):
        facts.ttft_seconds = 0.25
    failure = _failure(end)
    if failure is not None:
        facts.fail(failure)
    _views_agree(facts, EXPECTED[end])


@pytest.mark.parametrize("end", ENDS)
def test_a_generation_ends_the_same_in_every_view(end: str) -> None:
    """A generation: output has started with the engine's first increment; completed says the
    generation's finish reason; a failure before output says no finish reason."""
    clock = TickingClock()
    fails_before = end == "error_before_output"
    engine = ScriptedEngine(
        script(kimi_tiny_ids("hello there friend"), prompt_tokens=3),
        fail_at=0 if fails_before else None,
    )
    gen = kimi_tiny_generation(engine, request_id="chatcmpl-1", clock=clock)
    facts = RequestFacts("chat", True, "kimi-tiny", started=clock.monotonic())
    facts.replica = "r1"
    facts.gen = gen

    async def run() -> None:
        async with aclosing(gen.steps()) as steps:
            try:
                async for _ in steps:
                    pass
            except UnavailableError:
                assert fails_before

    asyncio.run(run())
    assert gen.started_output is not fails_before
    failure = _failure(end)
    if failure is not None:
        facts.fail(failure)
    _views_agree(facts, EXPECTED[end])
    if end == "completed":
        assert facts.summary().completion_tokens == gen.completion_tokens > 0

"""ResponseSummary: the trailers a replica ends each response with, read back by the picker."""

from __future__ import annotations

from inferplane.wire import SUMMARY_KEYS, ResponseSummary


def test_round_trip_through_metadata() -> None:
    summary = ResponseSummary(
        replica_id="kimi-tiny-r1",
        prompt_tokens=128,
        completion_tokens=64,
        cached_tokens=32,
        reasoning_tokens=10,
        finish_reason="tool_calls",
        ttft_seconds=0.0125,
        error_code="",
    )
    pairs = summary.to_metadata()
    assert all(k in SUMMARY_KEYS for k, _ in pairs)
    assert ResponseSummary.from_metadata(pairs) == summary
    assert ResponseSummary.from_metadata(dict(pairs)) == summary


def test_reads_bytes_mixed_case_and_ignores_foreign_keys() -> None:
    got = ResponseSummary.from_metadata(
        [
            ("X-Inferplane-Completion-Tokens", b"7"),
            ("grpc-status", "0"),
            ("x-inferplane-finish-reason", b"length"),
        ]
    )
    assert got == ResponseSummary(completion_tokens=7, finish_reason="length")


def test_unreadable_values_read_as_defaults() -> None:
    """A malformed trailer never fails the request: the field reads as its default."""
    got = ResponseSummary.from_metadata(
        {
            "x-inferplane-prompt-tokens": "many",
            "x-inferplane-cached-tokens": "-3",
            "x-inferplane-ttft-seconds": "nan",
        }
    )
    assert got == ResponseSummary()


def test_empty_summary_writes_nothing() -> None:
    assert ResponseSummary().to_metadata() == ()

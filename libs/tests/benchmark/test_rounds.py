"""The performance gate's verdict over rounds (`inferplane.benchmark.compare_rounds`): the
medians of each figure judged by `compare`, request counts summed, each round's own figures
and verdict kept, and what fails whatever the medians say."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from inferplane.benchmark import (
    ROUND_FIGURES,
    BenchmarkError,
    BenchReport,
    Thresholds,
    compare,
    compare_rounds,
)

from .test_compare import SERVING

BASE = dataclasses.replace(SERVING, requests_successful=30, requests_total=30)


def _side(revision: str = "stable", **changes: Any) -> BenchReport:
    return dataclasses.replace(BASE, revision=revision, **changes)


def test_three_rounds_are_judged_on_the_medians_of_each_figure() -> None:
    """Odd values in each round: every figure's median comes from a different round, the
    counts are sums, and each round keeps its own figures and verdict."""
    pairs = [
        (
            _side("cand", ttft_p99_seconds=0.95, itl_p99_seconds=0.031, wall_seconds=41.0),
            _side(ttft_p99_seconds=0.7, output_tokens_per_second=97.0, wall_seconds=33.0),
        ),
        (
            _side("cand", ttft_p99_seconds=0.3, output_tokens_per_second=61.0, wall_seconds=35.0),
            _side(ttft_p99_seconds=0.35, itl_p99_seconds=0.07, wall_seconds=31.0),
        ),
        (
            _side("cand", ttft_p99_seconds=0.5, itl_p99_seconds=0.047, requests_successful=29),
            _side(ttft_p99_seconds=0.45, output_tokens_per_second=103.0, wall_seconds=29.0),
        ),
    ]
    result = compare_rounds(pairs, Thresholds())
    m = result.measurements
    assert m["ttft_p99_seconds.candidate"] == 0.5 and m["ttft_p99_seconds.serving"] == 0.45
    assert m["ttft_p99_seconds.bound"] == pytest.approx(0.45 * 1.25)
    assert m["itl_p99_seconds.candidate"] == 0.047 and m["itl_p99_seconds.serving"] == 0.05
    assert m["output_tokens_per_second.candidate"] == 100.0
    assert m["output_tokens_per_second.serving"] == 100.0
    assert m["wall_seconds.candidate"] == 35.0 and m["wall_seconds.serving"] == 31.0
    assert m["requests_successful.candidate"] == 89.0 and m["requests_errored.candidate"] == 0
    assert m["requests_successful.serving"] == 90.0
    assert m["rounds"] == 3.0
    assert m["ttft_p99_seconds.candidate.round1"] == 0.95
    assert m["output_tokens_per_second.candidate.round2"] == 61.0
    assert m["wall_seconds.serving.round3"] == 29.0
    assert {
        f"{f}.{s}.round{i}"
        for f in ROUND_FIGURES
        for s in ("candidate", "serving")
        for i in (1, 2, 3)
    } <= set(m)
    # Round 1's TTFT (0.95 > 0.875 + 0.025) and round 2's throughput (61 < 80) regressed on
    # their own; the medians pass.
    assert [m[f"passed.round{i}"] for i in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert result.passed, result.reason
    assert result.reason.startswith(
        "within bounds (median of 3 rounds: regressed, regressed, passed): TTFT p99 500.0 ms vs "
        "450.0 ms"
    )


def test_one_round_is_compare_itself() -> None:
    pair = (_side("cand", ttft_p99_seconds=0.9), _side())
    result = compare_rounds([pair], Thresholds())
    single = compare(*pair, Thresholds())
    assert (result.passed, result.reason) == (False, single.reason)
    assert result.reason.startswith("regressed: TTFT p99 900.0 ms > 500.0 ms")
    assert result.measurements["rounds"] == 1.0 and result.measurements["passed.round1"] == 0.0
    assert {k: result.measurements[k] for k in single.measurements} == single.measurements


def test_a_regression_in_the_medians_fails() -> None:
    slow = _side("cand", ttft_p99_seconds=2.0, output_tokens_per_second=40.0)
    pairs = [(slow, _side()), (_side("cand"), _side()), (slow, _side())]
    result = compare_rounds(pairs, Thresholds())
    assert not result.passed
    assert result.reason.startswith("regressed (median of 3 rounds: regressed, passed, regressed)")
    assert "TTFT p99 2000.0 ms > 500.0 ms" in result.reason and "throughput" in result.reason


def test_an_errored_candidate_request_in_any_round_fails() -> None:
    bad = _side("cand", requests_successful=29, requests_errored=1, errors=("500: boom",))
    pairs = [(_side("cand"), _side()), (bad, _side()), (_side("cand"), _side())]
    result = compare_rounds(pairs, Thresholds())
    assert not result.passed
    assert "1 of 90 candidate requests failed (500: boom)" in result.reason
    assert result.measurements["requests_errored.candidate"] == 1.0
    assert result.measurements["requests_errored.candidate.round2"] == 1.0


def test_a_round_where_the_candidate_completed_nothing_fails() -> None:
    """Its p99s read 0 and the other rounds' counts hide it in the sums: named on its own."""
    empty = _side(
        "cand",
        ttft_p99_seconds=0.0,
        itl_p99_seconds=0.0,
        output_tokens_per_second=0.0,
        requests_successful=0,
        requests_incomplete=30,
    )
    pairs = [(_side("cand"), _side()), (empty, _side()), (_side("cand"), _side())]
    result = compare_rounds(pairs, Thresholds())
    assert not result.passed
    assert "the candidate completed no request in round 2" in result.reason


def test_no_baseline_in_any_round_and_no_rounds_are_errors() -> None:
    nothing = _side(requests_successful=0, requests_errored=30, errors=("503: no replica",))
    with pytest.raises(BenchmarkError, match="completed no request"):
        compare_rounds([(_side("cand"), _side()), (_side("cand"), nothing)], Thresholds())
    with pytest.raises(BenchmarkError, match="different workloads"):
        compare_rounds([(_side("cand", workload_digest="sha256:x"), _side())], Thresholds())
    with pytest.raises(ValueError, match="no rounds"):
        compare_rounds([], Thresholds())

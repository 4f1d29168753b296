"""The performance gate's rule (`inferplane.benchmark.compare`): the candidate within the
allowed regressions of the serving revision, the noise floors, errors, and the profile's
zero fields taking the defaults."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.benchmark import (
    DEFAULT_MAX_ITL_P99_REGRESSION,
    DEFAULT_MAX_THROUGHPUT_REGRESSION,
    DEFAULT_MAX_TTFT_P99_REGRESSION,
    BenchmarkError,
    BenchReport,
    Thresholds,
    compare,
)

SERVING = BenchReport(
    workload="agentic-v1",
    workload_digest="sha256:w",
    seed=1,
    model="m",
    revision="stable",
    base_url="http://edge/v1",
    ttft_p50_seconds=0.1,
    ttft_p99_seconds=0.4,
    itl_p50_seconds=0.02,
    itl_p99_seconds=0.05,
    output_tokens_per_second=100.0,
    requests_successful=36,
    requests_errored=0,
    requests_incomplete=0,
    requests_total=36,
    duration_seconds=15.0,
    wall_seconds=30.0,
)
NO_FLOOR = Thresholds(ttft_noise_floor_seconds=0.0, itl_noise_floor_seconds=0.0)


def _candidate(**changes: Any) -> BenchReport:
    return dataclasses.replace(SERVING, revision="candidate", **changes)


def test_the_same_figures_pass_with_every_measurement() -> None:
    result = compare(_candidate(), SERVING, Thresholds())
    assert result.passed, result.reason
    assert result.measurements["ttft_p99_seconds.candidate"] == 0.4
    assert result.measurements["ttft_p99_seconds.bound"] == pytest.approx(0.5)
    assert result.measurements["itl_p99_seconds.bound"] == pytest.approx(0.0625)
    assert result.measurements["output_tokens_per_second.bound"] == pytest.approx(80.0)
    assert result.measurements["requests_errored.candidate"] == 0.0


@pytest.mark.parametrize(
    ("changes", "passed", "words"),
    [
        ({"ttft_p99_seconds": 0.499}, True, ""),
        ({"ttft_p99_seconds": 0.501}, False, "TTFT p99"),
        ({"itl_p99_seconds": 0.0624}, True, ""),
        ({"itl_p99_seconds": 0.0626}, False, "ITL p99"),
        ({"output_tokens_per_second": 80.1}, True, ""),
        ({"output_tokens_per_second": 79.9}, False, "throughput"),
        ({"ttft_p99_seconds": 0.3, "output_tokens_per_second": 200.0}, True, ""),
    ],
    ids=["ttft-in", "ttft-out", "itl-in", "itl-out", "tput-in", "tput-out", "better"],
)
def test_each_bound_decides_at_its_threshold(
    changes: dict[str, float], passed: bool, words: str
) -> None:
    result = compare(_candidate(**changes), SERVING, NO_FLOOR)
    assert result.passed is passed, result.reason
    assert words in result.reason


def test_a_regression_inside_the_noise_floor_passes() -> None:
    """25 ms over the TTFT bound is noise; 30 ms is not."""
    assert compare(_candidate(ttft_p99_seconds=0.52), SERVING, Thresholds()).passed
    assert not compare(_candidate(ttft_p99_seconds=0.53), SERVING, Thresholds()).passed


def test_a_slow_candidate_fails_on_every_figure_it_regressed() -> None:
    """One sequence at a time under 8 concurrent requests: TTFT p99 many times over, and
    throughput down."""
    slow = _candidate(ttft_p99_seconds=4.0, output_tokens_per_second=30.0)
    result = compare(slow, SERVING, Thresholds())
    assert not result.passed
    assert "TTFT p99 4000.0 ms > 500.0 ms" in result.reason and "throughput" in result.reason


def test_candidate_errors_fail() -> None:
    result = compare(_candidate(requests_errored=1, errors=("HTTP 500",)), SERVING, Thresholds())
    assert not result.passed and "1 of 36 candidate requests failed (HTTP 500)" in result.reason


def test_no_baseline_or_another_workload_is_an_error() -> None:
    broken = dataclasses.replace(SERVING, requests_successful=0, requests_errored=36)
    with pytest.raises(BenchmarkError, match="completed no request"):
        compare(_candidate(), broken, Thresholds())
    with pytest.raises(BenchmarkError, match="different workloads"):
        compare(_candidate(workload_digest="sha256:other"), SERVING, Thresholds())


def test_thresholds_from_the_profile_take_defaults_for_zero() -> None:
    assert Thresholds.from_gates(pb.ReleaseGates()) == Thresholds(
        DEFAULT_MAX_TTFT_P99_REGRESSION,
        DEFAULT_MAX_ITL_P99_REGRESSION,
        DEFAULT_MAX_THROUGHPUT_REGRESSION,
    )
    generous = Thresholds.from_gates(
        pb.ReleaseGates(max_ttft_p99_regression=1.0, max_throughput_regression=0.5)
    )
    assert (generous.max_ttft_p99_regression, generous.max_throughput_regression) == (1.0, 0.5)
    assert generous.max_itl_p99_regression == DEFAULT_MAX_ITL_P99_REGRESSION
    with pytest.raises(ValueError, match="max_throughput_regression"):
        Thresholds.from_gates(pb.ReleaseGates(max_throughput_regression=1.0))
    with pytest.raises(ValueError, match="max_ttft_p99_regression"):
        Thresholds.from_gates(pb.ReleaseGates(max_ttft_p99_regression=-0.1))

"""The performance gate's rule: a candidate revision's run against the serving revision's run of
the same workload, within the profile's allowed regression.

The profile's thresholds (`orchestrator.v1.ReleaseGates`; 0 takes the default defined here, the
one place): TTFT p99 and ITL p99 at most `(1 + x)` times the serving revision's
(`DEFAULT_MAX_TTFT_P99_REGRESSION`, `DEFAULT_MAX_ITL_P99_REGRESSION`: 0.25), output throughput
at least `(1 - x)` times (`DEFAULT_MAX_THROUGHPUT_REGRESSION`: 0.20).

Noise floors (the gate's, not a profile field): a latency above its bound by less than
`ttft_noise_floor_seconds` (25 ms) or `itl_noise_floor_seconds` (5 ms) passes: on a small CPU
fixture a p99 of a few dozen requests moves by that much from run to run of one revision,
while a real regression (a queue behind `max_num_seqs: 1`, a slower kernel) moves it by far
more.

A candidate with any errored request fails. A serving run with no successful request is no
baseline: `compare` raises `BenchmarkError` (the gate reports "error", not "failed").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inferplane.benchmark.report import BenchmarkError, BenchReport

DEFAULT_MAX_TTFT_P99_REGRESSION = 0.25
"""Allowed TTFT p99 regression, fraction (`ReleaseGates.max_ttft_p99_regression` 0)."""
DEFAULT_MAX_ITL_P99_REGRESSION = 0.25
"""Allowed ITL p99 regression, fraction (`ReleaseGates.max_itl_p99_regression` 0)."""
DEFAULT_MAX_THROUGHPUT_REGRESSION = 0.20
"""Allowed output-throughput regression, fraction (`ReleaseGates.max_throughput_regression` 0)."""
DEFAULT_BENCHMARK_TIMEOUT_SECONDS = 420
"""Bound on the whole performance gate, every round and side, seconds
(`ReleaseGates.benchmark_timeout_seconds` 0): 3 rounds of ~65 s on a slow 2-core box, with room."""
DEFAULT_BENCHMARK_ROUNDS = 3
"""Rounds of the performance gate at most (`ReleaseGates.benchmark_rounds` 0; `rounds.py`)."""
MAX_BENCHMARK_ROUNDS = 9
"""The most rounds a profile may ask for (`ReleaseGates.benchmark_rounds`)."""


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The allowed regressions (fractions) and the noise floors (seconds)."""

    max_ttft_p99_regression: float = DEFAULT_MAX_TTFT_P99_REGRESSION
    max_itl_p99_regression: float = DEFAULT_MAX_ITL_P99_REGRESSION
    max_throughput_regression: float = DEFAULT_MAX_THROUGHPUT_REGRESSION
    ttft_noise_floor_seconds: float = 0.025
    itl_noise_floor_seconds: float = 0.005

    @classmethod
    def from_gates(cls, gates: Any) -> Thresholds:
        """From a `ReleaseGates` (or anything with its three `max_*_regression` fields): a 0
        (unset) field takes its default.

        Raises:
            ValueError: a negative fraction, or a throughput regression of 1 or more (it would
                accept a candidate that serves nothing).
        """
        ttft = float(gates.max_ttft_p99_regression) or DEFAULT_MAX_TTFT_P99_REGRESSION
        itl = float(gates.max_itl_p99_regression) or DEFAULT_MAX_ITL_P99_REGRESSION
        throughput = float(gates.max_throughput_regression) or DEFAULT_MAX_THROUGHPUT_REGRESSION
        for name, value in (
            ("max_ttft_p99_regression", ttft),
            ("max_itl_p99_regression", itl),
            ("max_throughput_regression", throughput),
        ):
            if value < 0:
                raise ValueError(f"release_gates.{name} must not be negative, got {value}")
        if throughput >= 1:
            raise ValueError(
                f"release_gates.max_throughput_regression must be below 1, got {throughput}"
            )
        return cls(
            max_ttft_p99_regression=ttft,
            max_itl_p99_regression=itl,
            max_throughput_regression=throughput,
        )


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The verdict: `passed`, a `reason` with the numbers against the bounds, and the
    `measurements` (`<figure>.candidate`, `<figure>.serving`, `<figure>.bound`; seconds,
    tokens/s, counts)."""

    passed: bool
    reason: str
    measurements: dict[str, float]


def compare(
    candidate: BenchReport, serving: BenchReport, thresholds: Thresholds, *, basis: str = ""
) -> Comparison:
    """Judges `candidate` against `serving` (same workload) by `thresholds`. `basis` says what
    the figures are, in parentheses after the verdict's first words ("within bounds (median of
    3 rounds): ..."; "": one run of each side).

    Raises:
        BenchmarkError: the two ran different workloads (digests differ), or the serving run
            has no successful request (no baseline).
    """
    if candidate.workload_digest != serving.workload_digest:
        raise BenchmarkError(
            f"the runs used different workloads ({candidate.workload_digest} vs "
            f"{serving.workload_digest}): nothing to compare"
        )
    if serving.requests_successful == 0:
        detail = f": {serving.errors[0]}" if serving.errors else ""
        raise BenchmarkError(
            f"the serving revision's run completed no request ({serving.requests_errored} "
            f"errored of {serving.requests_total}){detail}"
        )
    ttft_bound = serving.ttft_p99_seconds * (1 + thresholds.max_ttft_p99_regression)
    itl_bound = serving.itl_p99_seconds * (1 + thresholds.max_itl_p99_regression)
    throughput_bound = serving.output_tokens_per_second * (1 - thresholds.max_throughput_regression)
    measurements: dict[str, float] = {}
    for figure, bound in (
        ("ttft_p99_seconds", ttft_bound),
        ("itl_p99_seconds", itl_bound),
        ("output_tokens_per_second", throughput_bound),
    ):
        measurements[f"{figure}.candidate"] = getattr(candidate, figure)
        measurements[f"{figure}.serving"] = getattr(serving, figure)
        measurements[f"{figure}.bound"] = bound
    for figure in ("requests_successful", "requests_errored"):
        measurements[f"{figure}.candidate"] = float(getattr(candidate, figure))
        measurements[f"{figure}.serving"] = float(getattr(serving, figure))

    failures: list[str] = []
    if candidate.requests_errored or candidate.requests_successful == 0:
        detail = f" ({candidate.errors[0]})" if candidate.errors else ""
        failures.append(
            f"{candidate.requests_errored} of {candidate.requests_total} candidate requests "
            f"failed{detail}"
        )
    if candidate.ttft_p99_seconds > ttft_bound + thresholds.ttft_noise_floor_seconds:
        failures.append(
            f"TTFT p99 {_ms(candidate.ttft_p99_seconds)} > {_ms(ttft_bound)} "
            f"(serving {_ms(serving.ttft_p99_seconds)} + "
            f"{thresholds.max_ttft_p99_regression:.0%})"
        )
    if candidate.itl_p99_seconds > itl_bound + thresholds.itl_noise_floor_seconds:
        failures.append(
            f"ITL p99 {_ms(candidate.itl_p99_seconds)} > {_ms(itl_bound)} "
            f"(serving {_ms(serving.itl_p99_seconds)} + {thresholds.max_itl_p99_regression:.0%})"
        )
    if candidate.output_tokens_per_second < throughput_bound:
        failures.append(
            f"throughput {candidate.output_tokens_per_second:.1f} < {throughput_bound:.1f} "
            f"output tokens/s (serving {serving.output_tokens_per_second:.1f} - "
            f"{thresholds.max_throughput_regression:.0%})"
        )
    summary = (
        f"TTFT p99 {_ms(candidate.ttft_p99_seconds)} vs {_ms(serving.ttft_p99_seconds)}, "
        f"ITL p99 {_ms(candidate.itl_p99_seconds)} vs {_ms(serving.itl_p99_seconds)}, "
        f"{candidate.output_tokens_per_second:.1f} vs {serving.output_tokens_per_second:.1f} "
        f"output tokens/s (candidate vs serving, {candidate.workload})"
    )
    of = f" ({basis})" if basis else ""
    if failures:
        return Comparison(False, f"regressed{of}: " + "; ".join(failures), measurements)
    return Comparison(True, f"within bounds{of}: " + summary, measurements)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"

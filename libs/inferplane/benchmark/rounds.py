"""The performance gate's verdict over several rounds (issue 30): each round runs the serving
and the candidate revision once (the gate alternates which goes first); the verdict is
`compare` applied to the per-figure medians over the rounds, so one lucky or unlucky round
(a p99 of ~30 requests is about their maximum, and moves 2-6x on a shared small box) cannot
decide alone once there are three.

With two rounds the median is the mean, and each bound is linear in the serving figure, so two
rounds that both pass also pass on their mean: a gate that stops once two rounds agree loses
nothing on a pass. Two rounds failing on different figures (one on TTFT, the other on
throughput) can pass on their mean: the verdict is always the medians', never a vote.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from inferplane.benchmark.compare import Comparison, Thresholds, compare
from inferplane.benchmark.report import BenchReport

#: The figures kept per round in a verdict's measurements (`<figure>.<side>.round<i>`).
ROUND_FIGURES = (
    "ttft_p99_seconds",
    "itl_p99_seconds",
    "output_tokens_per_second",
    "requests_successful",
    "requests_errored",
    "wall_seconds",
)

#: `BenchReport` figures that are medians over the rounds (the counts are summed instead).
_MEDIAN_FIGURES = (
    "ttft_p50_seconds",
    "ttft_p99_seconds",
    "itl_p50_seconds",
    "itl_p99_seconds",
    "output_tokens_per_second",
    "duration_seconds",
    "wall_seconds",
)
_SUMMED_FIGURES = (
    "requests_successful",
    "requests_errored",
    "requests_incomplete",
    "requests_total",
)


def compare_rounds(
    pairs: Sequence[tuple[BenchReport, BenchReport]], thresholds: Thresholds
) -> Comparison:
    """Judges the candidate over the rounds run: `compare` of the per-figure medians.

    Args:
        pairs: each round's (candidate, serving) reports, in the order run (at least one).
        thresholds: the allowed regressions and noise floors (`Thresholds.from_gates`).

    Returns:
        The `Comparison` of the median candidate against the median serving side (TTFT p99,
        ITL p99, output tokens/s; p50s, durations and wall seconds likewise), its request
        counts summed over the rounds, so an errored candidate request in any round fails; a
        round in which the candidate completed nothing fails too. Its reason names the rounds
        and their own verdicts ("within bounds (median of 3 rounds: regressed, passed,
        passed): ..."; one round: `compare`'s reason as is). Its measurements: `compare`'s keys
        (`<figure>.candidate` / `.serving` / `.bound`: medians and their bounds; request
        counts: sums), `wall_seconds.candidate` / `.serving` (medians, seconds), `rounds`, and
        per round i (from 1) `<figure>.candidate.round<i>` / `.serving.round<i>` for
        `ROUND_FIGURES` and `passed.round<i>` (1.0 / 0.0: that round's own `compare`).

    Raises:
        ValueError: no rounds.
        BenchmarkError: as `compare`, for any round (different workloads, a serving run with
            no successful request: no baseline).
    """
    if not pairs:
        raise ValueError("no rounds to judge")
    own = [compare(candidate, serving, thresholds) for candidate, serving in pairs]
    candidate = _median_report([c for c, _ in pairs])
    serving = _median_report([s for _, s in pairs])
    n = len(pairs)
    basis = ""
    if n > 1:
        verdicts = ", ".join("passed" if r.passed else "regressed" for r in own)
        basis = f"median of {n} rounds: {verdicts}"
    verdict = compare(candidate, serving, thresholds, basis=basis)
    empty = [str(i) for i, (c, _) in enumerate(pairs, 1) if c.requests_successful == 0]
    passed, reason = verdict.passed, verdict.reason
    if empty and passed:
        passed = False
        of = f" ({basis})" if basis else ""
        reason = (
            f"regressed{of}: the candidate completed no request in round "
            f"{', '.join(empty)}; {reason}"
        )
    measurements = {
        **verdict.measurements,
        "wall_seconds.candidate": candidate.wall_seconds,
        "wall_seconds.serving": serving.wall_seconds,
        "rounds": float(n),
    }
    for i, ((c, s), result) in enumerate(zip(pairs, own, strict=True), 1):
        for figure in ROUND_FIGURES:
            measurements[f"{figure}.candidate.round{i}"] = float(getattr(c, figure))
            measurements[f"{figure}.serving.round{i}"] = float(getattr(s, figure))
        measurements[f"passed.round{i}"] = 1.0 if result.passed else 0.0
    return Comparison(passed, reason, measurements)


def _median_report(reports: Sequence[BenchReport]) -> BenchReport:
    """One side over the rounds: the first round's report with the medians of its figures,
    the sums of its request counts and the distinct errors of every round (at most 5)."""
    errors = tuple(dict.fromkeys(e for r in reports for e in r.errors))[:5]
    medians: dict[str, Any] = {
        f: float(statistics.median(getattr(r, f) for r in reports)) for f in _MEDIAN_FIGURES
    }
    sums: dict[str, Any] = {f: sum(getattr(r, f) for r in reports) for f in _SUMMED_FIGURES}
    return dataclasses.replace(reports[0], **medians, **sums, errors=errors, raw={})

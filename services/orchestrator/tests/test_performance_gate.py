"""The performance gate (`release/performance.py`) with a fake runner in place of GuideLLM:
what it runs (each revision pinned through the edge, the workload, the key, the time left),
its rounds (alternating order, stopping once two agree, the profile's count, the time
budget), its verdicts on the medians (passed, failed, error), and its settings."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.benchmark import BenchmarkError, BenchReport, load_workload
from inferplane.orchestrator.release.performance import GuideLLMPerformanceGate, build_gate
from inferplane.orchestrator.settings import OrchestratorSettings

EDGE = "http://127.0.0.1:8080/v1"
KEY = "ip-operator-secret-0123456789"
FAST = {"ttft_p99_seconds": 0.2, "itl_p99_seconds": 0.02, "output_tokens_per_second": 100.0}
SLOW = {"ttft_p99_seconds": 3.0, "itl_p99_seconds": 0.02, "output_tokens_per_second": 40.0}


class FakeRunner:
    """Answers each run with the figures given per revision (a list: one per run, in order),
    after `seconds` on the fake clock; records the calls."""

    def __init__(
        self, figures: dict[str, list[dict[str, float] | Exception]], seconds: float = 30.0
    ):
        self.figures = figures
        self.seconds = seconds
        self.calls: list[dict[str, Any]] = []
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    async def __call__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        workload: Any,
        revision: str,
        timeout: float,
        **options: Any,
    ) -> BenchReport:
        self.calls.append(
            {
                "base_url": base_url,
                "api_key": api_key,
                "model": model,
                "workload": workload,
                "revision": revision,
                "timeout": timeout,
                **options,
            }
        )
        self.now += self.seconds
        figures = self.figures[revision].pop(0)
        if isinstance(figures, Exception):
            raise figures
        report: dict[str, Any] = {
            "ttft_p50_seconds": 0.1,
            "itl_p50_seconds": 0.01,
            "requests_successful": 36,
            "requests_errored": 0,
            "requests_incomplete": 0,
            "requests_total": 36,
            "duration_seconds": 15.0,
            "wall_seconds": self.seconds,
            **figures,
        }
        return BenchReport(
            workload=workload.name,
            workload_digest=workload.digest,
            seed=workload.seed,
            model=model,
            revision=revision,
            base_url=base_url,
            environment={"started_at": f"run{len(self.calls)}"},
            **report,
        )

    def order(self) -> str:
        """The sides run, in order: S (serving, rev-old) and C (candidate, rev-new)."""
        return " ".join("S" if c["revision"] == "rev-old" else "C" for c in self.calls)


def _gate(tmp_path: Path, runner: FakeRunner, key: str | None = KEY) -> GuideLLMPerformanceGate:
    key_file = tmp_path / "key"
    if key is not None:
        key_file.write_text(key + "\n", "utf-8")
    return GuideLLMPerformanceGate(
        EDGE, key_file, reports_dir=tmp_path / "reports", run=runner, monotonic=runner.monotonic
    )


def _compare(gate: GuideLLMPerformanceGate, gates: pb.ReleaseGates | None = None) -> pb.GateVerdict:
    verdict: pb.GateVerdict = asyncio.run(
        gate.compare("kimi-tiny", "kimi-tiny", "rev-new", "rev-old", gates or pb.ReleaseGates())
    )
    return verdict


def test_equal_revisions_pass_after_two_agreeing_rounds(tmp_path: Path) -> None:
    """Serving first, then the candidate, then the other way round, each pinned, with the
    operator key and the default workload, each side given the time left of the 420 s; two
    passing rounds agree: no third. The verdict names the rounds and the medians; every
    report is stored."""
    runner = FakeRunner({"rev-old": [FAST, FAST], "rev-new": [FAST, FAST]})
    verdict = _compare(_gate(tmp_path, runner))
    assert (verdict.gate, verdict.result, verdict.revision) == ("performance", "passed", "rev-new")
    assert runner.order() == "S C C S"
    assert {c["api_key"] for c in runner.calls} == {KEY}
    assert {c["base_url"] for c in runner.calls} == {EDGE}
    assert runner.calls[0]["workload"].name == "agentic-v1"
    assert [c["timeout"] for c in runner.calls] == [420.0, 390.0, 360.0, 330.0]
    assert [c["environment"]["gate_round"] for c in runner.calls] == [1, 1, 2, 2]
    assert verdict.measurements["ttft_p99_seconds.candidate"] == 0.2
    assert verdict.measurements["ttft_p99_seconds.serving"] == 0.2
    assert verdict.measurements["ttft_p99_seconds.serving.round2"] == 0.2
    assert verdict.measurements["wall_seconds.candidate"] == 30.0
    assert verdict.measurements["rounds"] == 2.0
    assert verdict.seconds == 120.0
    assert verdict.reason.startswith(
        "within bounds (median of 2 rounds: passed, passed): TTFT p99 200.0 ms vs 200.0 ms"
    )
    assert "2 round(s)" in verdict.reason and "budget" not in verdict.reason
    assert len(list((tmp_path / "reports" / "kimi-tiny").glob("*.json"))) == 4


def test_a_slow_candidate_fails_after_two_agreeing_rounds(tmp_path: Path) -> None:
    runner = FakeRunner({"rev-old": [FAST, FAST], "rev-new": [SLOW, SLOW]})
    verdict = _compare(_gate(tmp_path, runner))
    assert verdict.result == "failed", verdict.reason
    assert runner.order() == "S C C S"
    assert verdict.reason.startswith("regressed (median of 2 rounds: regressed, regressed)")
    assert "TTFT p99 3000.0 ms > 250.0 ms" in verdict.reason and "throughput" in verdict.reason
    assert verdict.measurements["rounds"] == 2.0
    assert verdict.measurements["ttft_p99_seconds.bound"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("candidate", "result"),
    [([SLOW, FAST, FAST], "passed"), ([FAST, SLOW, SLOW], "failed")],
    ids=["one-unlucky-round", "one-lucky-round"],
)
def test_rounds_that_disagree_take_a_third_and_the_medians_decide(
    tmp_path: Path, candidate: list[dict[str, float]], result: str
) -> None:
    runner = FakeRunner({"rev-old": [FAST, FAST, FAST], "rev-new": list(candidate)})
    verdict = _compare(_gate(tmp_path, runner))
    assert verdict.result == result, verdict.reason
    assert runner.order() == "S C C S S C"
    assert verdict.measurements["rounds"] == 3.0
    assert verdict.measurements["ttft_p99_seconds.candidate"] == candidate[2]["ttft_p99_seconds"]
    own = [verdict.measurements[f"passed.round{i}"] for i in (1, 2, 3)]
    assert own == [float(f is FAST) for f in candidate]
    assert "median of 3 rounds" in verdict.reason and "3 round(s)" in verdict.reason


@pytest.mark.parametrize(
    ("rounds", "candidate", "order", "result"),
    [
        (1, [SLOW], "S C", "failed"),
        (1, [FAST], "S C", "passed"),
        (2, [SLOW, FAST], "S C C S", "failed"),
        (5, [FAST, SLOW, FAST, SLOW, FAST], "S C C S S C C S S C", "passed"),
        (5, [FAST, SLOW, SLOW], "S C C S S C", "failed"),
    ],
    ids=["one-fails", "one-passes", "two-on-the-mean", "five-until-two-agree", "five-stop-at-3"],
)
def test_the_profiles_rounds_bound_the_schedule(
    tmp_path: Path, rounds: int, candidate: list[dict[str, float]], order: str, result: str
) -> None:
    """1: one round, nothing confirmed; 2: two rounds even when they disagree, judged on their
    mean; more: until the latest two rounds agree."""
    runner = FakeRunner({"rev-old": [FAST] * len(candidate), "rev-new": list(candidate)})
    verdict = _compare(_gate(tmp_path, runner), pb.ReleaseGates(benchmark_rounds=rounds))
    assert runner.order() == order
    assert verdict.result == result, verdict.reason
    assert verdict.measurements["rounds"] == float(len(candidate))


@pytest.mark.parametrize(
    ("budget", "order", "words"),
    [
        (200, "S C C S", "the 200 s budget allowed 2 of 3 rounds"),
        (100, "S C", "the 100 s budget allowed 1 of 3 rounds"),
    ],
)
def test_the_time_budget_cuts_rounds_and_says_so(
    tmp_path: Path, budget: int, order: str, words: str
) -> None:
    """Rounds of 80 s (two 40 s sides): one starts only when the time left holds 80 s; the
    gate judges the rounds run (here failed: the slow round is the median, or half the mean)."""
    runner = FakeRunner({"rev-old": [FAST, FAST], "rev-new": [SLOW, FAST]}, seconds=40.0)
    gates = pb.ReleaseGates(benchmark_timeout_seconds=budget)
    verdict = _compare(_gate(tmp_path, runner), gates)
    assert runner.order() == order
    assert verdict.result == "failed" and verdict.reason.endswith(words), verdict.reason
    assert verdict.measurements["rounds"] == float(len(order.split()) // 2)


def test_an_errored_candidate_request_in_any_round_fails(tmp_path: Path) -> None:
    """Round 2's one errored request fails that round; round 3 passes and every median is
    fast, yet the summed count fails the gate."""
    errored = {**FAST, "requests_successful": 35, "requests_errored": 1}
    runner = FakeRunner({"rev-old": [FAST] * 3, "rev-new": [FAST, errored, FAST]})
    verdict = _compare(_gate(tmp_path, runner))
    assert runner.order() == "S C C S S C"
    assert verdict.result == "failed"
    assert "1 of 108 candidate requests failed" in verdict.reason
    assert verdict.measurements["requests_errored.candidate"] == 1.0


def test_the_profiles_thresholds_and_workload_apply(tmp_path: Path) -> None:
    """A generous profile (TTFT + 2000 %) passes what the default fails; the workload named
    in the profile is the one run."""
    runner = FakeRunner({"rev-old": [FAST, FAST], "rev-new": [SLOW, SLOW]})
    gates = pb.ReleaseGates(
        max_ttft_p99_regression=20.0,
        max_throughput_regression=0.7,
        benchmark_workload="agentic-v1",
    )
    assert _compare(_gate(tmp_path, runner), gates).result == "passed"
    assert runner.calls[0]["workload"] == load_workload("agentic-v1")


@pytest.mark.parametrize(
    ("key", "gates", "words"),
    [
        (None, pb.ReleaseGates(), "cannot be read"),
        ("", pb.ReleaseGates(), "is empty"),
        (KEY, pb.ReleaseGates(benchmark_workload="no-such"), "no workload 'no-such'"),
        (KEY, pb.ReleaseGates(max_throughput_regression=1.5), "max_throughput_regression"),
    ],
    ids=["no-key-file", "empty-key", "unknown-workload", "bad-threshold"],
)
def test_what_keeps_the_gate_from_running_is_an_error_verdict(
    tmp_path: Path, key: str | None, gates: pb.ReleaseGates, words: str
) -> None:
    runner = FakeRunner({})
    verdict = _compare(_gate(tmp_path, runner, key), gates)
    assert verdict.result == "error" and words in verdict.reason, verdict.reason
    assert runner.calls == []


def test_a_failed_run_in_any_round_is_an_error_verdict(tmp_path: Path) -> None:
    runner = FakeRunner({"rev-old": [BenchmarkError("GuideLLM exited with 2: boom")]})
    verdict = _compare(_gate(tmp_path, runner))
    assert verdict.result == "error" and "GuideLLM exited with 2" in verdict.reason
    late = FakeRunner(
        {"rev-old": [FAST, BenchmarkError("GuideLLM timed out")], "rev-new": [FAST, FAST]}
    )
    verdict = _compare(_gate(tmp_path, late))
    assert late.order() == "S C C S"
    assert verdict.result == "error" and "timed out" in verdict.reason


def test_the_gate_exists_only_with_its_settings(tmp_path: Path) -> None:
    assert build_gate(OrchestratorSettings(data_dir=tmp_path)) is None
    assert build_gate(OrchestratorSettings(data_dir=tmp_path, benchmark_edge_url=EDGE)) is None
    gate = build_gate(
        OrchestratorSettings(
            data_dir=tmp_path, benchmark_edge_url=EDGE, benchmark_api_key_file=str(tmp_path / "k")
        )
    )
    assert isinstance(gate, GuideLLMPerformanceGate)

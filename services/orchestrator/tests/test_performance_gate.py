"""The performance gate (`release/performance.py`) with a fake runner in place of GuideLLM:
what it runs (each revision pinned through the edge, the workload, the key, the time left),
its verdicts (passed, failed after a confirming round, error), and its settings."""

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

    def __init__(self, figures: dict[str, list[dict[str, float]]], seconds: float = 30.0):
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
        return BenchReport(
            workload=workload.name,
            workload_digest=workload.digest,
            seed=workload.seed,
            model=model,
            revision=revision,
            base_url=base_url,
            ttft_p50_seconds=0.1,
            itl_p50_seconds=0.01,
            requests_successful=36,
            requests_errored=0,
            requests_incomplete=0,
            requests_total=36,
            duration_seconds=15.0,
            wall_seconds=self.seconds,
            **figures,
        )


def _gate(tmp_path: Path, runner: FakeRunner, key: str | None = KEY) -> GuideLLMPerformanceGate:
    key_file = tmp_path / "key"
    if key is not None:
        key_file.write_text(key + "\n", "utf-8")
    return GuideLLMPerformanceGate(
        EDGE, key_file, reports_dir=tmp_path / "reports", run=runner, monotonic=runner.monotonic
    )


def _compare(gate: GuideLLMPerformanceGate, gates: pb.ReleaseGates | None = None) -> pb.GateVerdict:
    return asyncio.run(
        gate.compare("kimi-tiny", "kimi-tiny", "rev-new", "rev-old", gates or pb.ReleaseGates())
    )


def test_equal_revisions_pass_with_the_numbers(tmp_path: Path) -> None:
    """Serving first, then the candidate, each pinned, with the operator key and the default
    workload; the verdict names the figures; both reports are stored."""
    runner = FakeRunner({"rev-old": [FAST], "rev-new": [FAST]})
    verdict = _compare(_gate(tmp_path, runner))
    assert (verdict.gate, verdict.result, verdict.revision) == ("performance", "passed", "rev-new")
    assert [c["revision"] for c in runner.calls] == ["rev-old", "rev-new"]
    assert {c["api_key"] for c in runner.calls} == {KEY}
    assert {c["base_url"] for c in runner.calls} == {EDGE}
    assert runner.calls[0]["workload"].name == "agentic-v1"
    assert runner.calls[0]["timeout"] == 300.0 and runner.calls[1]["timeout"] == 270.0
    assert verdict.measurements["ttft_p99_seconds.candidate"] == 0.2
    assert verdict.measurements["ttft_p99_seconds.serving"] == 0.2
    assert verdict.measurements["rounds"] == 1.0
    assert verdict.seconds == 60.0
    assert "TTFT p99 200.0 ms vs 200.0 ms" in verdict.reason
    assert len(list((tmp_path / "reports" / "kimi-tiny").glob("*.json"))) == 2


def test_a_slow_candidate_fails_after_a_confirming_round(tmp_path: Path) -> None:
    """A failed comparison is run again, candidate first; confirmed, the gate fails with the
    numbers against the bound."""
    runner = FakeRunner({"rev-old": [FAST, FAST], "rev-new": [SLOW, SLOW]})
    verdict = _compare(_gate(tmp_path, runner))
    assert verdict.result == "failed", verdict.reason
    assert [c["revision"] for c in runner.calls] == ["rev-old", "rev-new", "rev-new", "rev-old"]
    assert "TTFT p99 3000.0 ms > 250.0 ms" in verdict.reason and "throughput" in verdict.reason
    assert verdict.measurements["rounds"] == 2.0
    assert verdict.measurements["ttft_p99_seconds.bound"] == pytest.approx(0.25)


def test_one_noisy_round_does_not_fail_the_release(tmp_path: Path) -> None:
    runner = FakeRunner({"rev-old": [FAST, FAST], "rev-new": [SLOW, FAST]})
    verdict = _compare(_gate(tmp_path, runner))
    assert verdict.result == "passed" and "not confirmed" in verdict.reason


def test_no_time_for_a_second_round_decides_on_the_first(tmp_path: Path) -> None:
    """Two runs of 40 s leave 20 s of a 100 s budget: less than a round, so no second one."""
    runner = FakeRunner({"rev-old": [FAST], "rev-new": [SLOW]}, seconds=40.0)
    verdict = _compare(_gate(tmp_path, runner), pb.ReleaseGates(benchmark_timeout_seconds=100))
    assert verdict.result == "failed" and len(runner.calls) == 2
    assert verdict.measurements["rounds"] == 1.0


def test_the_profiles_thresholds_and_workload_apply(tmp_path: Path) -> None:
    """A generous profile (TTFT + 2000 %) passes what the default fails; the workload named
    in the profile is the one run."""
    runner = FakeRunner({"rev-old": [FAST], "rev-new": [SLOW]})
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


def test_a_failed_run_is_an_error_verdict(tmp_path: Path) -> None:
    runner = FakeRunner({"rev-old": [BenchmarkError("GuideLLM exited with 2: boom")]})
    verdict = _compare(_gate(tmp_path, runner))
    assert verdict.result == "error" and "GuideLLM exited with 2" in verdict.reason


def test_the_gate_exists_only_with_its_settings(tmp_path: Path) -> None:
    assert build_gate(OrchestratorSettings(data_dir=tmp_path)) is None
    assert build_gate(OrchestratorSettings(data_dir=tmp_path, benchmark_edge_url=EDGE)) is None
    gate = build_gate(
        OrchestratorSettings(
            data_dir=tmp_path, benchmark_edge_url=EDGE, benchmark_api_key_file=str(tmp_path / "k")
        )
    )
    assert isinstance(gate, GuideLLMPerformanceGate)

"""GuideLLM's report reduced to the gate's figures (`inferplane.benchmark.report`), from a
recorded report: `data/guidellm-agentic-v1.json`, GuideLLM 0.8.1 running agentic-v1 (trimmed:
one request kept per list; the per-modality and per-turn metrics dropped)."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from inferplane.benchmark import (
    BenchmarkError,
    BenchReport,
    capture_environment,
    parse_guidellm_report,
    write_report,
)
from inferplane.benchmark.report import cpu_model

RECORDED = Path(__file__).parent / "data" / "guidellm-agentic-v1.json"


def _raw() -> dict[str, Any]:
    return json.loads(RECORDED.read_text("utf-8"))


def _parse(raw: dict[str, Any], **env: Any) -> BenchReport:
    return parse_guidellm_report(
        raw,
        workload="agentic-v1",
        workload_digest="sha256:x",
        seed=1,
        model="kimi-tiny",
        revision="rev-a",
        base_url="http://edge/v1",
        wall_seconds=30.0,
        environment=env,
    )


def test_the_figures_are_guidellms_in_seconds() -> None:
    """TTFT and ITL percentiles are GuideLLM's milliseconds / 1000; throughput is output
    tokens over the benchmark's duration; counts are its request totals."""
    raw = _raw()
    report = _parse(raw, engine_versions={"rev-a": "0.32.0"})
    metrics = raw["benchmarks"][0]["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
    itl = metrics["inter_token_latency_ms"]["successful"]["percentiles"]
    assert report.ttft_p99_seconds == pytest.approx(ttft["p99"] / 1000)
    assert report.ttft_p50_seconds == pytest.approx(ttft["p50"] / 1000)
    assert report.itl_p99_seconds == pytest.approx(itl["p99"] / 1000)
    assert 0 < report.itl_p50_seconds <= report.itl_p99_seconds
    assert 0 < report.ttft_p50_seconds <= report.ttft_p99_seconds
    output_tokens = metrics["output_token_count"]["successful"]["total_sum"]
    duration = raw["benchmarks"][0]["duration"]
    assert report.output_tokens_per_second == pytest.approx(output_tokens / duration, rel=0.02)
    totals = metrics["request_totals"]
    assert (report.requests_successful, report.requests_errored) == (
        totals["successful"],
        totals["errored"],
    )
    assert report.requests_total == totals["total"] > 0
    assert report.environment["guidellm_version"] == raw["metadata"]["guidellm_version"]
    assert report.environment["engine_versions"] == {"rev-a": "0.32.0"}


def test_errored_requests_are_counted_with_their_messages() -> None:
    raw = _raw()
    benchmark = raw["benchmarks"][0]
    errored = copy.deepcopy(benchmark["requests"]["successful"][0])
    errored["info"]["error"] = "HTTP 503: revision_unavailable"
    benchmark["requests"]["errored"] = [errored, errored]
    benchmark["metrics"]["request_totals"]["errored"] = 2
    report = _parse(raw)
    assert report.requests_errored == 2
    assert report.errors == ("HTTP 503: revision_unavailable",)


def test_no_successful_request_gives_zero_figures() -> None:
    raw = _raw()
    for metric in raw["benchmarks"][0]["metrics"].values():
        if isinstance(metric, dict) and isinstance(metric.get("successful"), dict):
            metric["successful"]["count"] = 0
            metric["successful"]["mean"] = 0.0
    report = _parse(raw)
    assert report.ttft_p99_seconds == report.itl_p99_seconds == 0.0
    assert report.output_tokens_per_second == 0.0


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r.pop("benchmarks"),
        lambda r: r["benchmarks"].append(r["benchmarks"][0]),
        lambda r: r["benchmarks"][0]["metrics"].pop("time_to_first_token_ms"),
    ],
    ids=["none", "two", "no-ttft"],
)
def test_an_unusable_report_is_a_benchmark_error(edit: Any) -> None:
    raw = _raw()
    edit(raw)
    with pytest.raises(BenchmarkError):
        _parse(raw)


def test_a_stored_report_reads_back_and_is_private(tmp_path: Path) -> None:
    report = _parse(_raw(), started_at="2026-11-29T19:00:00Z")
    path = write_report(report, tmp_path / "reports")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.name == "2026-11-29T190000Z-agentic-v1-kimi-tiny-rev-a.json"
    back = BenchReport.from_json(json.loads(path.read_text("utf-8")))
    assert back == report
    with pytest.raises(BenchmarkError, match="format"):
        BenchReport.from_json({"format": "other"})


def test_the_environment_names_the_cpu(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n", "utf-8")
    assert cpu_model(cpuinfo) == "Test CPU 9000"
    env = capture_environment({"engine_versions": {"r": "0.31.0"}})
    assert env["cpu_count"] >= 1 and env["cpu_model"] and env["engine_versions"]

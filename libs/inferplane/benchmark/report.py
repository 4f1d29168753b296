"""One side's benchmark result: GuideLLM's JSON report reduced to the figures the performance
gate compares, with the environment it ran in and the raw report kept beside them.

GuideLLM 0.8's report (`--output kind=json`): `metadata.guidellm_version`, and per benchmark
`metrics.<name>.successful` distributions (`percentiles.p50` / `p99`, `mean`, `total_sum`) of
`time_to_first_token_ms`, `inter_token_latency_ms` and `output_tokens_per_second` (its mean is
output tokens over the benchmark's duration: GuideLLM's "Output Tokens Per Sec"),
`metrics.request_totals` (successful, errored, incomplete, total), `duration` (seconds) and
`requests.errored[*].info.error`. A run of one workload has one benchmark (one rate).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPORT_FORMAT = "inferplane.bench/v1"
"""The `format` of a stored report (`BenchReport.to_json`)."""


class BenchmarkError(RuntimeError):
    """The benchmark could not run or its report cannot be read (GuideLLM missing, exited
    non-zero, timed out, or wrote no usable report). The message says which."""


@dataclasses.dataclass(frozen=True)
class BenchReport:
    """One workload run against one model (and revision) through the edge.

    Latencies are seconds (GuideLLM reports milliseconds); throughput is output tokens per
    second over the run. Percentiles are over successful requests.

    Attributes:
        workload, workload_digest, seed: the spec that ran (`Workload.name`, `.digest`, `.seed`).
        model, revision, base_url: what was benchmarked ("" revision: not pinned).
        ttft_p50_seconds, ttft_p99_seconds: time to first token.
        itl_p50_seconds, itl_p99_seconds: inter-token latency.
        output_tokens_per_second: output tokens over the benchmark's duration.
        requests_successful, requests_errored, requests_incomplete, requests_total: counts
            (incomplete: still running when a bound ended the run; GuideLLM cancels them).
        duration_seconds: GuideLLM's measured request phase.
        wall_seconds: the whole GuideLLM process, start-up included.
        errors: the first distinct error messages of errored requests (at most 5).
        environment: where it ran (`capture_environment`, plus GuideLLM's version and whatever
            the caller knows, e.g. engine versions).
        raw: GuideLLM's JSON report, as written.
    """

    workload: str
    workload_digest: str
    seed: int
    model: str
    revision: str
    base_url: str
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    itl_p50_seconds: float
    itl_p99_seconds: float
    output_tokens_per_second: float
    requests_successful: int
    requests_errored: int
    requests_incomplete: int
    requests_total: int
    duration_seconds: float
    wall_seconds: float
    errors: tuple[str, ...] = ()
    environment: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def figures(self) -> dict[str, float]:
        """The compared and counted figures by name (seconds, tokens/s, counts)."""
        return {
            "ttft_p50_seconds": self.ttft_p50_seconds,
            "ttft_p99_seconds": self.ttft_p99_seconds,
            "itl_p50_seconds": self.itl_p50_seconds,
            "itl_p99_seconds": self.itl_p99_seconds,
            "output_tokens_per_second": self.output_tokens_per_second,
            "requests_successful": float(self.requests_successful),
            "requests_errored": float(self.requests_errored),
            "requests_incomplete": float(self.requests_incomplete),
            "duration_seconds": self.duration_seconds,
            "wall_seconds": self.wall_seconds,
        }

    def to_json(self, *, include_raw: bool = True) -> dict[str, Any]:
        """The stored form: `format` (`REPORT_FORMAT`), every field, `raw` unless excluded."""
        body = dataclasses.asdict(self)
        body["errors"] = list(self.errors)
        body["environment"] = dict(self.environment)
        if include_raw:
            body["raw"] = dict(self.raw)
        else:
            body.pop("raw")
        return {"format": REPORT_FORMAT, **body}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> BenchReport:
        """Reads `to_json`'s form back.

        Raises:
            BenchmarkError: another format, or a field missing.
        """
        if body.get("format") != REPORT_FORMAT:
            raise BenchmarkError(f"not a {REPORT_FORMAT} report (format {body.get('format')!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in body.items() if k in names}
        values["errors"] = tuple(values.get("errors", ()))
        try:
            return cls(**values)
        except TypeError as error:
            raise BenchmarkError(f"incomplete report: {error}") from None


def _distribution(metrics: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    try:
        successful = metrics[name]["successful"]
    except (KeyError, TypeError):
        raise BenchmarkError(f"GuideLLM's report has no metrics.{name}.successful") from None
    if not isinstance(successful, Mapping):
        raise BenchmarkError(f"GuideLLM's report: metrics.{name}.successful is not an object")
    return successful


def _percentile(metrics: Mapping[str, Any], name: str, which: str) -> float:
    distribution = _distribution(metrics, name)
    if not distribution.get("count"):
        return 0.0
    return float(distribution["percentiles"][which])


def parse_guidellm_report(
    raw: Mapping[str, Any],
    *,
    workload: str,
    workload_digest: str,
    seed: int,
    model: str,
    revision: str,
    base_url: str,
    wall_seconds: float,
    environment: Mapping[str, Any] | None = None,
) -> BenchReport:
    """Reduces GuideLLM's JSON report (`raw`, one benchmark) to a `BenchReport`.

    With no successful request the latency and throughput figures are 0 (the counts say why).

    Raises:
        BenchmarkError: not a GuideLLM report, no benchmark or several, or a metric missing.
    """
    benchmarks = raw.get("benchmarks")
    if not isinstance(benchmarks, list) or len(benchmarks) != 1:
        count = len(benchmarks) if isinstance(benchmarks, list) else "no"
        raise BenchmarkError(f"GuideLLM's report holds {count} benchmarks, expected 1")
    benchmark = benchmarks[0]
    metrics = benchmark.get("metrics")
    if not isinstance(metrics, Mapping):
        raise BenchmarkError("GuideLLM's report has no metrics")
    totals = metrics.get("request_totals") or {}
    throughput = _distribution(metrics, "output_tokens_per_second")
    errors: list[str] = []
    for request in (benchmark.get("requests") or {}).get("errored") or []:
        message = str(((request or {}).get("info") or {}).get("error") or "unknown error")
        if message not in errors:
            errors.append(message[:500])
        if len(errors) == 5:
            break
    env = {
        **(environment or {}),
        "guidellm_version": str((raw.get("metadata") or {}).get("guidellm_version", "unknown")),
    }
    return BenchReport(
        workload=workload,
        workload_digest=workload_digest,
        seed=seed,
        model=model,
        revision=revision,
        base_url=base_url,
        ttft_p50_seconds=_percentile(metrics, "time_to_first_token_ms", "p50") / 1000,
        ttft_p99_seconds=_percentile(metrics, "time_to_first_token_ms", "p99") / 1000,
        itl_p50_seconds=_percentile(metrics, "inter_token_latency_ms", "p50") / 1000,
        itl_p99_seconds=_percentile(metrics, "inter_token_latency_ms", "p99") / 1000,
        output_tokens_per_second=float(throughput.get("mean") or 0.0),
        requests_successful=int(totals.get("successful", 0)),
        requests_errored=int(totals.get("errored", 0)),
        requests_incomplete=int(totals.get("incomplete", 0)),
        requests_total=int(totals.get("total", 0)),
        duration_seconds=float(benchmark.get("duration") or 0.0),
        wall_seconds=wall_seconds,
        errors=tuple(errors),
        environment=env,
        raw=raw,
    )


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (`/proc/cpuinfo`'s first `model name`), else `platform.processor()`,
    else "unknown"."""
    try:
        for line in cpuinfo.read_text("utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def capture_environment(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where a benchmark runs from: CPU model and count, OS and Python, plus `extra` (the
    caller's facts, e.g. `engine_versions`). GuideLLM's version is added from its report."""
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **(extra or {}),
    }


def write_report(report: BenchReport, directory: Path) -> Path:
    """Stores `report` as `<directory>/<UTC time>-<workload>-<model>[-<revision>].json`
    (mode 0600: the raw report names the endpoint); returns the path. Creates the folder."""
    directory.mkdir(parents=True, exist_ok=True)
    started = str(report.environment.get("started_at", "")).replace(":", "")
    parts = [started or "report", report.workload, report.model, report.revision]
    stem = "-".join(_safe(p) for p in parts if p)
    path = directory / f"{stem}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(report.to_json(), out, indent=1, sort_keys=True)
        out.write("\n")
    return path


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)

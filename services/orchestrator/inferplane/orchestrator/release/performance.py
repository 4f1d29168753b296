"""The performance gate (issue 30): the pinned GuideLLM workload against the candidate and the
serving revision of a deployment, each reached through the edge pinned to its revision
(`inferplane-revision` with an admin key: the picker's `revision_pin`), judged by the profile's
allowed regressions (`inferplane.benchmark.compare`).

`GuideLLMPerformanceGate.compare` (the `release.gates.PerformanceGate` port):

1. loads the workload (`ReleaseGates.benchmark_workload`, "" = `agentic-v1`), the thresholds
   (0 fields take `inferplane.benchmark`'s defaults) and the operator key (read from its file
   at each run: the local stack writes it once auth is up, after the orchestrator started);
2. runs rounds, each both sides one after the other (one side at a time: on a small node two
   GuideLLM runs at once would measure each other), in alternating order: serving first in
   odd rounds, candidate first in even ones (S C, C S, S C, ...), so neither side always
   runs on a node still busy with the other;
3. stops once the latest two rounds' own verdicts (`compare` of that round) agree, both pass
   or both fail; otherwise runs another, up to `benchmark_rounds` (0 = 3: two rounds when
   they agree, a third when they do not; 1 = one round, nothing confirmed). The whole gate
   is bounded by `benchmark_timeout_seconds` (0 = 420): a round starts only when the time
   left holds one as long as the longest so far, and a gate cut short says so ("the 420 s
   budget allowed 2 of 3 rounds"). A p99 of ~30 requests is about their maximum and moves
   2-6x from run to run on a shared small box: one round, lucky or unlucky, decides nothing;
4. judges the rounds run by `inferplane.benchmark.compare_rounds`: `compare` of each figure's
   median over the rounds (TTFT p99, ITL p99, output tokens/s; request counts summed, so an
   errored candidate request in any round fails);
5. returns a `GateVerdict`: gate "performance", result "passed" / "failed" / "error" (the
   workload or key is missing, GuideLLM failed or ran out of time, the serving revision
   completed nothing), a reason naming the rounds, their own verdicts and the medians, the
   seconds, and measurements (`ttft_p99_seconds.candidate` / `.serving` / `.bound`,
   `itl_p99_seconds.*`, `output_tokens_per_second.*`, `wall_seconds.*`: the medians;
   `requests_successful.*`, `requests_errored.*`: sums; `rounds`; per round i
   `<figure>.candidate.round<i>` / `.serving.round<i>` and `passed.round<i>`).

Each side's full report (environment, with the deployment, revision and `gate_round`, and
GuideLLM's raw JSON) is stored under `reports_dir`
(`<deployment>/<time>-<workload>-<model>-<revision>.json`) when one is set.

Settings (`OrchestratorSettings`): `benchmark_edge_url` (the edge's OpenAI base URL),
`benchmark_api_key_file` (a key with the `inference` and `admin` scopes), optional
`benchmark_ca_path` (an https edge's private CA) and `benchmark_reports_dir`
("" = `<data_dir>/bench-reports`). Without the first two there is no gate (`build_gate` →
None): a profile asking for it fails its release with "no benchmark runner configured".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.benchmark import (
    DEFAULT_BENCHMARK_ROUNDS,
    DEFAULT_BENCHMARK_TIMEOUT_SECONDS,
    DEFAULT_WORKLOAD,
    WORKLOADS_DIR,
    BenchmarkError,
    BenchReport,
    Thresholds,
    WorkloadError,
    compare,
    compare_rounds,
    load_workload,
    run_workload_async,
    write_report,
)
from inferplane.orchestrator.release.progress import ERROR, FAILED, PASSED
from inferplane.orchestrator.settings import OrchestratorSettings

log = structlog.get_logger(__name__)

PERFORMANCE = "performance"
"""The gate's name in its verdicts (`GateVerdict.gate`)."""

#: `run_workload_async`'s shape: (base_url, api_key, model, workload, revision, timeout,
#: **options) → report.
Runner = Callable[..., Awaitable[BenchReport]]


class GuideLLMPerformanceGate:
    """The performance gate over GuideLLM through the edge (module docstring).

    Args:
        edge_url: the edge's OpenAI base URL (`http://host:port/v1`).
        api_key_file: a file holding an API key with the `inference` and `admin` scopes.
        ca_path: CA bundle of an https edge with a private CA.
        reports_dir: where each side's report is stored (None: not stored).
        workloads_dir: where named workloads live (`bench/workloads`).
        run: the runner (`inferplane.benchmark.run_workload_async`; tests pass a fake).
        monotonic: the clock of the time budget.
    """

    def __init__(
        self,
        edge_url: str,
        api_key_file: Path,
        *,
        ca_path: Path | None = None,
        reports_dir: Path | None = None,
        workloads_dir: Path = WORKLOADS_DIR,
        run: Runner = run_workload_async,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._edge_url = edge_url
        self._key_file = api_key_file
        self._ca_path = ca_path
        self._reports_dir = reports_dir
        self._workloads_dir = workloads_dir
        self._run = run
        self._monotonic = monotonic

    async def compare(
        self,
        deployment_id: str,
        model: str,
        candidate_revision: str,
        serving_revision: str,
        gates: pb.ReleaseGates,
    ) -> pb.GateVerdict:
        """Benchmarks both revisions of `model` and judges the candidate (module docstring).
        Never raises for a failed run: that is a verdict with result "error"."""
        started = self._monotonic()
        budget = float(gates.benchmark_timeout_seconds or DEFAULT_BENCHMARK_TIMEOUT_SECONDS)

        def finish(result: str, reason: str, measurements: dict[str, float]) -> pb.GateVerdict:
            seconds = round(self._monotonic() - started, 3)
            log.info(
                "performance_gate",
                deployment=deployment_id,
                candidate=candidate_revision,
                serving=serving_revision,
                result=result,
                seconds=seconds,
                reason=reason,
            )
            return pb.GateVerdict(
                gate=PERFORMANCE,
                result=result,
                reason=reason,
                seconds=seconds,
                measurements=measurements,
                revision=candidate_revision,
            )

        try:
            thresholds = Thresholds.from_gates(gates)
            workload = load_workload(
                gates.benchmark_workload or DEFAULT_WORKLOAD, self._workloads_dir
            )
            api_key = self._api_key()
        except (ValueError, WorkloadError, BenchmarkError) as exc:
            return finish(ERROR, f"error: {exc}", {})

        async def side(revision: str, number: int) -> BenchReport:
            left = budget - (self._monotonic() - started)
            if left <= 0:
                raise BenchmarkError(f"the gate's {budget:.0f} s ran out before {revision}")
            report = await self._run(
                self._edge_url,
                api_key,
                model,
                workload,
                revision,
                left,
                ca_path=self._ca_path,
                environment={
                    "deployment": deployment_id,
                    "revision": revision,
                    "gate_round": number,
                },
            )
            self._store(deployment_id, report)
            return report

        rounds = gates.benchmark_rounds or DEFAULT_BENCHMARK_ROUNDS
        pairs: list[tuple[BenchReport, BenchReport]] = []
        own: list[bool] = []
        longest = 0.0
        cut = ""
        try:
            for number in range(1, rounds + 1):
                if len(own) >= 2 and own[-1] == own[-2]:
                    break
                left = budget - (self._monotonic() - started)
                if pairs and left < longest:
                    cut = f"; the {budget:.0f} s budget allowed {len(pairs)} of {rounds} rounds"
                    break
                round_started = self._monotonic()
                if number % 2:
                    serving = await side(serving_revision, number)
                    candidate = await side(candidate_revision, number)
                else:
                    candidate = await side(candidate_revision, number)
                    serving = await side(serving_revision, number)
                own.append(compare(candidate, serving, thresholds).passed)
                pairs.append((candidate, serving))
                longest = max(longest, self._monotonic() - round_started)
            verdict = compare_rounds(pairs, thresholds)
        except BenchmarkError as exc:
            return finish(ERROR, f"error: {exc}", {})
        where = f"{workload.name} ({workload.digest[:19]}), {len(pairs)} round(s){cut}"
        return finish(
            PASSED if verdict.passed else FAILED, f"{verdict.reason}; {where}", verdict.measurements
        )

    def _api_key(self) -> str:
        try:
            key = self._key_file.read_text("utf-8").strip()
        except OSError as exc:
            raise BenchmarkError(
                f"the benchmark API key file {self._key_file} cannot be read ({exc.strerror})"
            ) from None
        if not key:
            raise BenchmarkError(f"the benchmark API key file {self._key_file} is empty")
        return key

    def _store(self, deployment_id: str, report: BenchReport) -> None:
        if self._reports_dir is None:
            return
        try:
            path = write_report(report, self._reports_dir / deployment_id)
        except OSError as exc:
            log.warning("benchmark_report_not_stored", error=str(exc))
        else:
            log.info("benchmark_report_stored", path=str(path), revision=report.revision)


def build_gate(settings: OrchestratorSettings, **options: Any) -> GuideLLMPerformanceGate | None:
    """The gate from the orchestrator's settings, or None when `benchmark_edge_url` or
    `benchmark_api_key_file` is unset (no gate: a profile asking for it fails its release)."""
    if not settings.benchmark_edge_url or not settings.benchmark_api_key_file:
        return None
    reports = settings.benchmark_reports_dir
    return GuideLLMPerformanceGate(
        settings.benchmark_edge_url,
        Path(settings.benchmark_api_key_file).expanduser(),
        ca_path=Path(settings.benchmark_ca_path) if settings.benchmark_ca_path else None,
        reports_dir=Path(reports).expanduser()
        if reports
        else settings.resolved_data_dir / "bench-reports",
        **options,
    )

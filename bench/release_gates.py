"""The performance gate's cost per release and its run-to-run noise (issue 30).

The orchestrator's own gate (`inferplane.orchestrator.release.performance.GuideLLMPerformanceGate`:
GuideLLM in `.venv-guidellm` running the pinned workload through the edge, each side pinned to
a revision with the operator key) on a local stack's kimi-tiny, with the serving revision on
both sides: an A/A comparison, which must pass, and whose figures show how far two runs of one
revision differ (what the thresholds and noise floors must cover). `--rounds` gates in a row,
each of `--benchmark-rounds` interleaved rounds at most (`ReleaseGates.benchmark_rounds`, 0:
3; the gate stops once two agree); each side's report (environment and GuideLLM's JSON) is
stored under `--reports`.

Last lines: `performance_gate_seconds_p50` (one gate: every round, GuideLLM's start-up
included), `performance_gate_rounds_p50`, `performance_gate_side_wall_seconds_p50`,
`performance_gate_aa_ttft_p99_ratio_max` and `performance_gate_aa_throughput_ratio_min`
(candidate / serving of one revision, of the gate's medians), the same of single rounds
(`performance_gate_aa_round_ttft_p99_ratio_max`, `..._round_throughput_ratio_min`: what one
round alone would have judged), `performance_gate_aa_passed N/R` (goal R/R).

Run `.venv/bin/python bench/release_gates.py [--rounds 3] [--workload agentic-v1]` (starts a
local stack; ~65 s per round, two or three rounds per gate, on 2 cores), or against a running
stack: `--base-url`, `--api-key` (inference + admin scopes), `--model`, `--revision`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections.abc import Mapping
from pathlib import Path

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.localstack import MODEL_NAME, StackConfig, benchmark_key_file, running_stack
from inferplane.orchestrator.release.performance import GuideLLMPerformanceGate
from inferplane.runtime.processes.ports import free_port, free_port_run


def run_rounds(
    args: argparse.Namespace, base_url: str, key_file: Path, revision: str, ca: Path | None
) -> list[pb.GateVerdict]:
    gate = GuideLLMPerformanceGate(
        base_url, key_file, ca_path=ca, reports_dir=Path(args.reports).resolve()
    )
    gates = pb.ReleaseGates(
        performance=True, benchmark_workload=args.workload, benchmark_rounds=args.benchmark_rounds
    )
    verdicts = []
    for i in range(args.rounds):
        verdict = asyncio.run(gate.compare(args.model, args.model, revision, revision, gates))
        m = verdict.measurements
        print(
            f"gate {i + 1}: {verdict.result} in {verdict.seconds:.1f} s: {verdict.reason}\n"
            f"  TTFT p99 {m.get('ttft_p99_seconds.candidate', 0) * 1000:.1f} / "
            f"{m.get('ttft_p99_seconds.serving', 0) * 1000:.1f} ms, ITL p99 "
            f"{m.get('itl_p99_seconds.candidate', 0) * 1000:.1f} / "
            f"{m.get('itl_p99_seconds.serving', 0) * 1000:.1f} ms, "
            f"{m.get('output_tokens_per_second.candidate', 0):.1f} / "
            f"{m.get('output_tokens_per_second.serving', 0):.1f} tokens/s, sides "
            f"{m.get('wall_seconds.candidate', 0):.1f} / {m.get('wall_seconds.serving', 0):.1f} s",
            flush=True,
        )
        for r in range(1, int(m.get("rounds", 0)) + 1):
            own = "passed" if m.get(f"passed.round{r}") else "regressed"
            print(
                f"    round {r} ({own}): TTFT p99 "
                f"{m[f'ttft_p99_seconds.candidate.round{r}'] * 1000:.1f} / "
                f"{m[f'ttft_p99_seconds.serving.round{r}'] * 1000:.1f} ms, ITL p99 "
                f"{m[f'itl_p99_seconds.candidate.round{r}'] * 1000:.1f} / "
                f"{m[f'itl_p99_seconds.serving.round{r}'] * 1000:.1f} ms, "
                f"{m[f'output_tokens_per_second.candidate.round{r}']:.1f} / "
                f"{m[f'output_tokens_per_second.serving.round{r}']:.1f} tokens/s, sides "
                f"{m[f'wall_seconds.candidate.round{r}']:.1f} / "
                f"{m[f'wall_seconds.serving.round{r}']:.1f} s",
                flush=True,
            )
        verdicts.append(verdict)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="gates in a row")
    parser.add_argument(
        "--benchmark-rounds", type=int, default=0, help="rounds per gate at most (0: 3)"
    )
    parser.add_argument("--workload", default="agentic-v1")
    parser.add_argument("--reports", default=".inferplane/bench-reports/release-gates")
    parser.add_argument("--base-url", default="", help="a running edge, e.g. http://h:8080/v1")
    parser.add_argument("--api-key", default="", help="with --base-url: inference + admin")
    parser.add_argument("--model", default=MODEL_NAME)
    parser.add_argument("--revision", default="", help="with --base-url: the revision")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="release-gates-") as tmp:
        if args.base_url:
            key_file = Path(tmp) / "key"
            key_file.write_text(args.api_key, "utf-8")
            verdicts = run_rounds(args, args.base_url, key_file, args.revision, None)
        else:
            config = StackConfig(
                data_dir=Path(tmp),
                http_port=free_port(),
                grpc_base_port=free_port_run(5),
                metrics_base_port=free_port_run(5),
                envoy_admin_port=free_port(),
            )
            with running_stack(config, print) as stack:
                (revision,) = {e.revision for e in stack.serving_endpoints(args.model)}
                verdicts = run_rounds(
                    args,
                    stack.config.base_url,
                    benchmark_key_file(stack.config.data_dir),
                    revision,
                    stack.config.ca_path,
                )
    summarize(verdicts)


def summarize(verdicts: list[pb.GateVerdict]) -> None:
    """Prints the last lines (module docstring)."""
    measured = [v.measurements for v in verdicts if "ttft_p99_seconds.serving" in v.measurements]
    rounds = [(m, r) for m in measured for r in range(1, int(m["rounds"]) + 1)]

    def ratio(m: Mapping[str, float], figure: str, suffix: str = "") -> float:
        return m[f"{figure}.candidate{suffix}"] / m[f"{figure}.serving{suffix}"]

    print()
    print(f"performance_gate_seconds_p50: {statistics.median(v.seconds for v in verdicts):.1f}")
    if measured:
        sides = [
            m[f"wall_seconds.{s}.round{r}"] for m, r in rounds for s in ("candidate", "serving")
        ]
        ttft = max(ratio(m, "ttft_p99_seconds") for m in measured)
        throughput = min(ratio(m, "output_tokens_per_second") for m in measured)
        round_ttft = max(ratio(m, "ttft_p99_seconds", f".round{r}") for m, r in rounds)
        round_throughput = min(
            ratio(m, "output_tokens_per_second", f".round{r}") for m, r in rounds
        )
        print(
            f"performance_gate_rounds_p50: {statistics.median(m['rounds'] for m in measured):.0f}"
        )
        print(f"performance_gate_side_wall_seconds_p50: {statistics.median(sides):.1f}")
        print(f"performance_gate_aa_ttft_p99_ratio_max: {ttft:.3f}")
        print(f"performance_gate_aa_throughput_ratio_min: {throughput:.3f}")
        print(f"performance_gate_aa_round_ttft_p99_ratio_max: {round_ttft:.3f}")
        print(f"performance_gate_aa_round_throughput_ratio_min: {round_throughput:.3f}")
    passed = sum(v.result == "passed" for v in verdicts)
    print(f"performance_gate_aa_passed {passed}/{len(verdicts)}")


if __name__ == "__main__":
    main()

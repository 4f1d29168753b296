"""The performance gate's cost per release and its run-to-run noise (issue 30).

The orchestrator's own gate (`inferplane.orchestrator.release.performance.GuideLLMPerformanceGate`:
GuideLLM in `.venv-guidellm` running the pinned workload through the edge, each side pinned to
a revision with the operator key) on a local stack's kimi-tiny, with the serving revision on
both sides: an A/A comparison, which must pass, and whose figures show how far two runs of one
revision differ (what the thresholds and noise floors must cover). `--rounds` gates in a row;
each side's report (environment and GuideLLM's JSON) is stored under `--reports`.

Last lines: `performance_gate_seconds_p50` (one gate: both sides, GuideLLM's start-up
included; a second round when the first fails), `performance_gate_side_wall_seconds_p50`,
`performance_gate_aa_ttft_p99_ratio_max` and `performance_gate_aa_throughput_ratio_min`
(candidate / serving of one revision), `performance_gate_aa_passed N/R` (goal R/R).

Run `.venv/bin/python bench/release_gates.py [--rounds 3] [--workload agentic-v1]` (starts a
local stack; ~1.5 min per round on 2 cores), or against a running stack: `--base-url`,
`--api-key` (inference + admin scopes), `--model`, `--revision`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
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
    gates = pb.ReleaseGates(performance=True, benchmark_workload=args.workload)
    verdicts = []
    for i in range(args.rounds):
        verdict = asyncio.run(gate.compare(args.model, args.model, revision, revision, gates))
        m = verdict.measurements
        print(
            f"round {i + 1}: {verdict.result} in {verdict.seconds:.1f} s: {verdict.reason}\n"
            f"  TTFT p99 {m.get('ttft_p99_seconds.candidate', 0) * 1000:.1f} / "
            f"{m.get('ttft_p99_seconds.serving', 0) * 1000:.1f} ms, ITL p99 "
            f"{m.get('itl_p99_seconds.candidate', 0) * 1000:.1f} / "
            f"{m.get('itl_p99_seconds.serving', 0) * 1000:.1f} ms, "
            f"{m.get('output_tokens_per_second.candidate', 0):.1f} / "
            f"{m.get('output_tokens_per_second.serving', 0):.1f} tokens/s, sides "
            f"{m.get('wall_seconds.candidate', 0):.1f} / {m.get('wall_seconds.serving', 0):.1f} s",
            flush=True,
        )
        verdicts.append(verdict)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
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
    measured = [v.measurements for v in verdicts if "ttft_p99_seconds.serving" in v.measurements]
    sides = [m[f"wall_seconds.{s}"] for m in measured for s in ("candidate", "serving")]
    print()
    print(f"performance_gate_seconds_p50: {statistics.median(v.seconds for v in verdicts):.1f}")
    if measured:
        ttft = max(
            m["ttft_p99_seconds.candidate"] / m["ttft_p99_seconds.serving"] for m in measured
        )
        throughput = min(
            m["output_tokens_per_second.candidate"] / m["output_tokens_per_second.serving"]
            for m in measured
        )
        print(f"performance_gate_side_wall_seconds_p50: {statistics.median(sides):.1f}")
        print(f"performance_gate_aa_ttft_p99_ratio_max: {ttft:.3f}")
        print(f"performance_gate_aa_throughput_ratio_min: {throughput:.3f}")
    passed = sum(v.result == "passed" for v in verdicts)
    print(f"performance_gate_aa_passed {passed}/{len(verdicts)}")


if __name__ == "__main__":
    main()

"""`inferplane bench`: the performance gate's pinned workload by hand (issue 30).

Runs a workload (`bench/workloads/<name>.json`) with GuideLLM through the edge against one
model, optionally pinned to one profile revision, prints the figures and stores the report
(JSON with the environment and GuideLLM's raw report) under `--out`.

Defaults come from the local stack (`inferplane up`) when one runs from `--data-dir`: its
edge URL and CA (`stack.json`), and its operator key (the performance gate's, scopes
inference and admin); `--base-url` and `--api-key` (or `INFERPLANE_API_KEY`) override them.
A revision pin needs a key with the `admin` scope.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from inferplane.benchmark import (
    DEFAULT_WORKLOAD,
    BenchmarkError,
    BenchReport,
    WorkloadError,
    load_workload,
    run_workload,
    write_report,
)
from inferplane.cli._up import DEFAULT_DATA_DIR
from inferplane.localstack import benchmark_key_file

DEFAULT_REPORTS_DIR = Path(".inferplane/bench-reports")
"""Where `inferplane bench` stores its reports unless `--out` says otherwise."""


def bench(
    model: Annotated[str, typer.Option(help="The model (deployment id or alias) to benchmark.")],
    workload: Annotated[
        str, typer.Option(help="A workload name (bench/workloads/<name>.json) or a JSON file.")
    ] = DEFAULT_WORKLOAD,
    revision: Annotated[
        str, typer.Option(help="Pin every request to this profile revision (admin key).")
    ] = "",
    base_url: Annotated[
        str, typer.Option(help="The edge's OpenAI base URL (default: the local stack's).")
    ] = "",
    api_key: Annotated[
        str,
        typer.Option(
            envvar="INFERPLANE_API_KEY",
            help="The API key (default: the local stack's operator key).",
            show_default=False,
        ),
    ] = "",
    ca_path: Annotated[
        Path | None, typer.Option(help="CA bundle of an https edge (default: the stack's).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Where the report is stored.")] = DEFAULT_REPORTS_DIR,
    timeout: Annotated[float, typer.Option(help="Seconds GuideLLM may run.")] = 300.0,
    data_dir: Annotated[
        Path, typer.Option(help="The local stack whose defaults apply.")
    ] = DEFAULT_DATA_DIR,
) -> None:
    """Run a pinned GuideLLM workload through the edge; print and store its report."""
    console = Console()
    state_file = data_dir / "stack.json"
    state = json.loads(state_file.read_text("utf-8")) if state_file.exists() else {}
    base_url = base_url or state.get("base_url", "")
    if not base_url:
        console.print(f"no --base-url and no local stack in {data_dir.resolve()} (stack.json)")
        raise typer.Exit(2)
    if ca_path is None and state.get("ca_path") and base_url == state.get("base_url"):
        ca_path = Path(state["ca_path"])
    if not api_key:
        key_file = benchmark_key_file(data_dir)
        api_key = key_file.read_text("utf-8").strip() if key_file.exists() else ""
    if not api_key:
        console.print("no API key: pass --api-key or set INFERPLANE_API_KEY")
        raise typer.Exit(2)
    try:
        spec = load_workload(workload)
    except WorkloadError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    pinned = f" pinned to {revision}" if revision else ""
    console.print(f"running {spec.name} ({spec.digest[:19]}) on {model}{pinned} at {base_url}")
    try:
        report = run_workload(
            base_url, api_key, model, spec, revision or None, timeout, ca_path=ca_path
        )
    except BenchmarkError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    console.print(_table(report))
    for error in report.errors:
        console.print(f"[red]error:[/red] {error}")
    console.print(f"report: {write_report(report, out)}")
    if report.requests_errored:
        raise typer.Exit(1)


def _table(report: BenchReport) -> Table:
    table = Table(title=f"{report.workload} on {report.model} {report.revision}".strip())
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = (
        ("TTFT p50 / p99", f"{_ms(report.ttft_p50_seconds)} / {_ms(report.ttft_p99_seconds)}"),
        ("ITL p50 / p99", f"{_ms(report.itl_p50_seconds)} / {_ms(report.itl_p99_seconds)}"),
        ("output tokens/s", f"{report.output_tokens_per_second:.1f}"),
        (
            "requests ok / errored / incomplete",
            f"{report.requests_successful} / {report.requests_errored} / "
            f"{report.requests_incomplete}",
        ),
        ("measured / wall seconds", f"{report.duration_seconds:.1f} / {report.wall_seconds:.1f}"),
        ("GuideLLM", str(report.environment.get("guidellm_version", "?"))),
        ("CPU", str(report.environment.get("cpu_model", "?"))),
    )
    for name, value in rows:
        table.add_row(name, value)
    return table


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"

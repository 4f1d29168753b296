"""`inferplane conformance`: run a replica's conformance checks by hand (issue 30 §2).

Calls `ReplicaProcessService.RunConformance` at the replica process's own address as the
operator (`operator_security`; the replica's certificate carries the node-agent identity),
prints the report as a table (or JSON with `--json`) and the verdict against the default
thresholds (`inferplane.conformance.ConformanceThresholds`). Exit codes: 0 passed, 1 below the
thresholds, 2 the call failed (the gRPC code and message on stderr) or no operator identity.
"""

from __future__ import annotations

import json
from typing import Annotated

import grpc
import typer
from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.conformance import (
    DEFAULT_LIVE_REQUESTS,
    DEFAULT_TIMEOUT_SECONDS,
    ConformanceThresholds,
    replay_pass_rate,
    schema_valid_rate,
    tool_call_rate,
)
from inferplane.runtime import ConfigError
from inferplane.runtime.security.identity import NODE_AGENT, operator_security

#: Seconds the CLI waits beyond the run's own bound (the report's trip back).
DEADLINE_MARGIN_SECONDS = 30.0


def report_table(report: replica_pb2.ConformanceReport) -> Table:
    """The report as a rich table: artifacts, replay, live counts and rates, time."""
    table = Table(title="conformance", show_header=True)
    table.add_column("check")
    table.add_column("value", justify="right")
    a = report.artifacts
    for name, value in (
        ("engine", f"{a.engine} {a.engine_version}".strip()),
        ("parser", a.parser),
        ("model digest", a.model_digest[:19]),
        ("chat template digest", a.chat_template_digest[:19]),
    ):
        if value:
            table.add_row(name, value)
    rows = (
        ("replay passed", report.replay_passed, report.replay_cases, replay_pass_rate(report)),
        (
            "tool calls returned",
            report.tool_calls_returned,
            report.tool_calls_expected,
            tool_call_rate(report),
        ),
        (
            "schema-valid calls",
            report.tool_calls_schema_valid,
            report.tool_calls,
            schema_valid_rate(report),
        ),
    )
    for name, part, whole, rate in rows:
        table.add_row(name, f"{part}/{whole} ({rate:.0%})")
    table.add_row("live requests (errors)", f"{report.live_requests} ({report.live_errors})")
    table.add_row("finish-reason mismatches", str(report.finish_reason_mismatches))
    table.add_row("leaked markers", str(report.leaked_markers))
    table.add_row("reasoning not separated", str(report.reasoning_unseparated))
    table.add_row("seconds", f"{report.seconds:.1f}")
    return table


def conformance(
    replica: Annotated[
        str, typer.Option("--replica", help="The replica process's address, HOST:PORT.")
    ],
    live: Annotated[
        int, typer.Option("--live", min=0, help="Live requests with random tool schemas.")
    ] = DEFAULT_LIVE_REQUESTS,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the live requests.")] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.0, help="Bound on the run, seconds.")
    ] = DEFAULT_TIMEOUT_SECONDS,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Run a replica's conformance checks (replay and live) and judge them against the default
    thresholds; exit 1 when below them."""
    try:
        security = operator_security()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    request = replica_pb2.RunConformanceRequest(
        live_requests=live, seed=seed, timeout_seconds=timeout
    )
    try:
        with security.channel(replica, security.server_options(NODE_AGENT)) as channel:
            response = replica_pb2_grpc.ReplicaProcessServiceStub(channel).RunConformance(
                request, timeout=(timeout or DEFAULT_TIMEOUT_SECONDS) + DEADLINE_MARGIN_SECONDS
            )
    except grpc.RpcError as exc:
        typer.echo(f"error: {exc.code().name}: {exc.details()}", err=True)
        raise typer.Exit(2) from None
    report = response.report
    passed, reason = ConformanceThresholds().check(report)
    if as_json:
        body = json_format.MessageToDict(
            report, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        typer.echo(json.dumps({"report": body, "passed": passed, "reason": reason}, indent=2))
    else:
        console = Console()
        console.print(report_table(report))
        for line in report.replay_failures:
            console.print(f"  replay failure: {line}", markup=False)
        console.print(reason, markup=False)
    if not passed:
        raise typer.Exit(1)

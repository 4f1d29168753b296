"""`inferplane top`: a live table per model/deployment, from the telemetry service.

The typer app `app` is a group with one command, `top`; the top-level CLI mounts the command
itself (`app.command()(top)` beside `up` and `status`) so that it reads `inferplane top`.

Each frame reads:
- the telemetry service's /metrics (`--metrics-url`): which (model, deployment) pairs exist,
  and the engine numbers (KV cache usage, preemptions, prefix-cache hit rate);
- `QueryLatency` per pair over `--window` seconds (`--address`): requests/s, TTFT and ITL
  p50/p99, output tokens/s, tool-call validity;
- `ListAlerts`: the kinds firing per deployment.
`--once` prints one frame and exits (scripts, tests); otherwise it refreshes every
`--interval` seconds until Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Annotated

import grpc
import httpx
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live
from rich.table import Table

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime import ConfigError
from inferplane.runtime.security.identity import operator_security

app = typer.Typer(
    help="Telemetry views (live latency, engine and alert table).",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _group() -> None:
    """Telemetry views. Keeps `app` a group (`... top`) even with one command."""


DEFAULT_ADDRESS = "127.0.0.1:50055"
DEFAULT_METRICS_URL = "http://127.0.0.1:50155/metrics"
NONE = "–"


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One model/deployment line of the table (seconds, ratios, per-second rates)."""

    model: str
    deployment: str
    requests_per_second: float = math.nan
    ttft_p50: float = math.nan
    ttft_p99: float = math.nan
    itl_p50: float = math.nan
    itl_p99: float = math.nan
    tokens_per_second: float = math.nan
    error_rate: float = math.nan
    kv_cache_usage: float = math.nan
    preemptions: float = math.nan
    preemptions_per_second: float = math.nan
    prefix_cache_hit_rate: float = math.nan
    tool_call_validity: float = math.nan
    alerts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """What one refresh shows; `problems` are sources that could not be read."""

    window_seconds: int
    rows: tuple[Row, ...]
    problems: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True)
class _Metrics:
    pairs: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    kv: dict[str, float] = dataclasses.field(default_factory=dict)
    preemptions: dict[str, float] = dataclasses.field(default_factory=dict)
    preemption_rate: dict[str, float] = dataclasses.field(default_factory=dict)
    hit_rate: dict[str, float] = dataclasses.field(default_factory=dict)


def parse_metrics(text: str) -> _Metrics:
    """Pulls what `top` shows out of the telemetry service's exposition."""
    out = _Metrics()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            dep = labels.get("deployment", "")
            if s.name == "inferplane_requests_total":
                out.pairs.add((labels.get("model", ""), dep))
            elif s.name == "inferplane_deployment_kv_cache_usage_ratio":
                out.kv[dep] = s.value
            elif s.name == "inferplane_engine_preemptions_total":
                out.preemptions[dep] = out.preemptions.get(dep, 0.0) + s.value
            elif s.name == "inferplane_deployment_preemptions_per_second":
                out.preemption_rate[dep] = s.value
            elif s.name == "inferplane_deployment_prefix_cache_hit_ratio":
                out.hit_rate[dep] = s.value
    return out


def _p(values: object, p: float) -> float:
    for item in values:  # type: ignore[attr-defined]
        if abs(item.percentile - p) < 1e-9:
            return float(item.value)
    return math.nan


def collect_frame(
    stub: telemetry_pb2_grpc.TelemetryServiceStub,
    metrics_url: str,
    window_seconds: int,
    timeout_seconds: float = 3.0,
) -> Frame:
    """Reads /metrics, QueryLatency per (model, deployment) and ListAlerts into a frame.

    Never raises for an unreachable source: the frame lists it under `problems`.
    """
    problems: list[str] = []
    metrics = _Metrics()
    try:
        response = httpx.get(metrics_url, timeout=timeout_seconds)
        response.raise_for_status()
        metrics = parse_metrics(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        problems.append(f"metrics {metrics_url}: {exc}")
    alerts: dict[str, list[str]] = {}
    try:
        listed = stub.ListAlerts(telemetry_pb2.ListAlertsRequest(), timeout=timeout_seconds)
        for alert in listed.alerts:
            alerts.setdefault(alert.deployment, []).append(alert.kind)
    except grpc.RpcError as exc:
        problems.append(f"ListAlerts: {_rpc_error(exc)}")
    engine_only = (set(metrics.kv) | set(metrics.preemptions)) - {d for _, d in metrics.pairs}
    pairs = sorted(metrics.pairs | {("", d) for d in engine_only})
    if not pairs and problems:
        pairs = [("", "")]  # /metrics unreadable: one line over every deployment
    rows: list[Row] = []
    for model, deployment in pairs:
        latency: telemetry_pb2.QueryLatencyResponse | None = None
        try:
            latency = stub.QueryLatency(
                telemetry_pb2.QueryLatencyRequest(
                    model=model,
                    deployment=deployment,
                    window_seconds=window_seconds,
                    percentiles=[50, 99],
                ),
                timeout=timeout_seconds,
            )
        except grpc.RpcError as exc:
            problems.append(f"QueryLatency {deployment or 'all'}: {_rpc_error(exc)}")
        row = Row(
            model=model or NONE,
            deployment=deployment or "all",
            kv_cache_usage=metrics.kv.get(deployment, math.nan),
            preemptions=metrics.preemptions.get(deployment, math.nan),
            preemptions_per_second=metrics.preemption_rate.get(deployment, math.nan),
            prefix_cache_hit_rate=metrics.hit_rate.get(deployment, math.nan),
            alerts=tuple(sorted(alerts.get(deployment, ()))),
        )
        if latency is not None:
            count = latency.request_count
            row = dataclasses.replace(
                row,
                requests_per_second=count / window_seconds,
                ttft_p50=_p(latency.time_to_first_token_seconds, 50),
                ttft_p99=_p(latency.time_to_first_token_seconds, 99),
                itl_p50=_p(latency.inter_token_latency_seconds, 50),
                itl_p99=_p(latency.inter_token_latency_seconds, 99),
                tokens_per_second=latency.output_tokens_per_second,
                error_rate=latency.error_count / count if count else 0.0,
                tool_call_validity=latency.tool_call_validity,
            )
        rows.append(row)
    return Frame(window_seconds, tuple(rows), tuple(problems))


def _rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code}: {details}"


def _seconds(value: float) -> str:
    if math.isnan(value):
        return NONE
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _ratio(value: float) -> str:
    return NONE if math.isnan(value) else f"{value:.1%}"


def _number(value: float, digits: int) -> str:
    return NONE if math.isnan(value) else f"{value:.{digits}f}"


def render(frame: Frame) -> Table:
    """The rich table of a frame."""
    table = Table(
        title=f"inferplane top — last {frame.window_seconds} s",
        caption="\n".join(f"[yellow]{p}[/yellow]" for p in frame.problems) or None,
    )
    for name, justify in (
        ("model", "left"),
        ("deployment", "left"),
        ("req/s", "right"),
        ("TTFT p50", "right"),
        ("TTFT p99", "right"),
        ("ITL p50", "right"),
        ("ITL p99", "right"),
        ("tok/s", "right"),
        ("errors", "right"),
        ("KV", "right"),
        ("preempt.", "right"),
        ("prefix hit", "right"),
        ("tool valid", "right"),
        ("alerts", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in frame.rows:
        preempt = NONE if math.isnan(row.preemptions) else f"{row.preemptions:g}"
        if not math.isnan(row.preemptions_per_second) and row.preemptions_per_second > 0:
            preempt = f"[red]{preempt}[/red]"
        table.add_row(
            row.model,
            row.deployment,
            _number(row.requests_per_second, 2),
            _seconds(row.ttft_p50),
            _seconds(row.ttft_p99),
            _seconds(row.itl_p50),
            _seconds(row.itl_p99),
            _number(row.tokens_per_second, 1),
            _ratio(row.error_rate),
            _ratio(row.kv_cache_usage),
            preempt,
            _ratio(row.prefix_cache_hit_rate),
            _ratio(row.tool_call_validity),
            f"[red]{', '.join(row.alerts)}[/red]" if row.alerts else "",
        )
    if not frame.rows:
        table.add_row(*(["no requests recorded yet"] + [""] * 13))
    return table


@app.command()
def top(
    address: Annotated[
        str,
        typer.Option("--address", envvar="INFERPLANE_TELEMETRY_ADDRESS", help="Telemetry gRPC."),
    ] = DEFAULT_ADDRESS,
    metrics_url: Annotated[
        str,
        typer.Option(
            "--metrics-url",
            envvar="INFERPLANE_TELEMETRY_METRICS_URL",
            help="The telemetry service's /metrics.",
        ),
    ] = DEFAULT_METRICS_URL,
    window: Annotated[int, typer.Option(help="Window of the numbers, seconds.", min=1)] = 60,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.", min=0.2)] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
) -> None:
    """Live table per model/deployment: load, latency, engines, tool calls, alerts."""
    console = Console()
    try:
        security = operator_security()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    with security.channel(address) as channel:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        if once:
            console.print(render(collect_frame(stub, metrics_url, window)))
            return
        with Live(render(collect_frame(stub, metrics_url, window)), console=console) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(collect_frame(stub, metrics_url, window)))
            except KeyboardInterrupt:
                return

"""`inferplane usage`: read the usage ledger over gRPC with an admin key (through the SDK).

Rows (one per request, oldest first) or totals per hour, day, model, key or tenant, as a
table, CSV or JSON lines; filters by time range (`--since`/`--until`, ISO 8601, UTC when no
zone is given, or a duration back from now such as `24h`, `7d`), key, tenant and model. All
pages are read (`--limit` stops after that many rows or groups).

With `--region NAME=HOST:PORT` (repeatable, one per region's auth) every region's ledger is
read and merged by `inferplane.sdk.merge_usage`: each request once (`MERGE_RULE`), a `region`
column first, totals computed from the merged rows (`--group-by` also takes `region`), and a
last line on stderr saying how many requests from which regions (and copies counted once). A
region that cannot be read fails the command (exit 1, nothing printed); with `--partial` the
other regions' usage is printed and the command ends with an `INCOMPLETE:` line on stderr
naming the missing regions and exit code 3, never as a complete report.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer
from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from inferplane.api.auth.v1 import usage_pb2
from inferplane.auth.cli import DEFAULT_ADDRESS, Address, AdminKey, admin_client
from inferplane.regions import validate_region
from inferplane.sdk import (
    MERGE_RULE,
    MERGED_GROUPINGS,
    ConfigError,
    InferplaneError,
    MergedUsage,
    MultiRegionUsage,
)

app = typer.Typer(
    help="Read the usage ledger (needs an admin key).",
    add_completion=False,
    invoke_without_command=True,
)

_DURATION = re.compile(r"^(\d+)([mhd])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}
ROW_COLUMNS = (
    "end_time", "request_id", "key_id", "tenant", "api", "model", "adapter", "deployment",
    "revision", "replica", "status",
    "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "ttft_seconds",
    "duration_seconds", "gpu_seconds",
)  # fmt: skip
GROUP_COLUMNS = (
    "group", "requests", "failed_requests", "prompt_tokens", "cached_tokens",
    "completion_tokens", "reasoning_tokens", "gpu_seconds",
)  # fmt: skip


def parse_time(text: str, now: datetime) -> datetime | None:
    """`text` as a UTC time: "" → None; `30m`/`24h`/`7d` → that long before `now`; otherwise
    ISO 8601 (a time without a zone is UTC).

    Raises:
        typer.BadParameter: anything else.
    """
    if not text:
        return None
    if match := _DURATION.match(text):
        return now - timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither ISO 8601 nor a duration like 24h") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _cells(item: Any, columns: Iterable[str]) -> list[str]:
    out = []
    for column in columns:
        value = getattr(item, column)
        if column == "end_time":
            value = value.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        elif isinstance(value, float):
            value = f"{value:.3f}"
        out.append(str(value))
    return out


@app.callback()
def usage(
    address: Address = DEFAULT_ADDRESS,
    admin_key: AdminKey = "",
    group_by: Annotated[
        str,
        typer.Option(
            help='Totals per "hour", "day", "model", "key", "tenant", "api", "adapter" or '
            '"revision"; empty: rows.'
        ),
    ] = "",
    since: Annotated[str, typer.Option(help="Ended at or after: ISO 8601 or 24h, 7d.")] = "",
    until: Annotated[str, typer.Option(help="Ended before: ISO 8601 or a duration.")] = "",
    key: Annotated[str, typer.Option(help="Only this key (id or api-keys/{id}).")] = "",
    tenant: Annotated[str, typer.Option(help="Only this tenant.")] = "",
    model: Annotated[str, typer.Option(help="Only this model.")] = "",
    api: Annotated[
        str, typer.Option(help='Only this API ("chat", "messages", "responses", ...).')
    ] = "",
    output: Annotated[
        str, typer.Option("--format", help="table, csv or json (one object per line).")
    ] = "table",
    limit: Annotated[int, typer.Option(help="Stop after this many rows or groups; 0: all.")] = 0,
    region: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=HOST:PORT of a region's auth; repeatable: every region's ledger is read "
            f"and merged ({MERGE_RULE}); --address is then not used.",
            show_default=False,
        ),
    ] = None,
    partial: Annotated[
        bool,
        typer.Option(
            help="With --region: print what the reachable regions hold when one cannot be read "
            "(marked INCOMPLETE on stderr, exit code 3) instead of failing."
        ),
    ] = False,
    timeout: Annotated[float, typer.Option(help="Deadline of each call, seconds.")] = 30.0,
) -> None:
    """Prints usage rows or totals."""
    if output not in ("table", "csv", "json"):
        raise typer.BadParameter("--format must be table, csv or json")
    now = datetime.now(UTC)
    filters = {
        "start": parse_time(since, now),
        "end": parse_time(until, now),
        "key": key,
        "tenant": tenant,
        "model": model,
        "api": api,
        "page_size": 1000,
    }
    if region:
        del filters["page_size"]
        _merged(_regions(region), admin_key, group_by, filters, output, limit, partial, timeout)
        return
    columns = GROUP_COLUMNS if group_by else ROW_COLUMNS
    with admin_client(address, admin_key, timeout=timeout) as client:
        items: Iterable[usage_pb2.UsageRow | usage_pb2.UsageGroup] = (
            client.usage.groups(group_by, **filters)  # type: ignore[arg-type]
            if group_by
            else client.usage.rows(**filters)  # type: ignore[arg-type]
        )
        _print(itertools.islice(items, limit or None), columns, output)


def _regions(values: list[str]) -> dict[str, str]:
    """`--region` values as region → address.

    Raises:
        typer.BadParameter: not `NAME=HOST:PORT`, a bad region name, or a region twice.
    """
    regions: dict[str, str] = {}
    for value in values:
        name, sep, address = value.partition("=")
        if not sep or not address:
            raise typer.BadParameter(f"--region {value!r}: expected NAME=HOST:PORT")
        try:
            validate_region(name)
        except ValueError as exc:
            raise typer.BadParameter(f"--region {value!r}: {exc}") from None
        if name in regions:
            raise typer.BadParameter(f"--region {name} given twice")
        regions[name] = address
    return regions


def _merged(
    regions: dict[str, str],
    admin_key: str,
    group_by: str,
    filters: dict[str, Any],
    output: str,
    limit: int,
    partial: bool,
    timeout: float,
) -> None:
    if group_by and group_by not in MERGED_GROUPINGS:
        raise typer.BadParameter(f"--group-by must be one of {', '.join(MERGED_GROUPINGS)}")
    if not admin_key:
        typer.echo("error: no admin key; pass --admin-key or set INFERPLANE_ADMIN_KEY", err=True)
        raise typer.Exit(2)
    try:
        with MultiRegionUsage(regions, admin_key=admin_key, timeout=timeout) as reader:
            merged = reader.rows(**filters, partial=partial)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except InferplaneError as exc:
        typer.echo(f"error: {exc.grpc_code.name}: {exc.message}; nothing printed", err=True)
        raise typer.Exit(1) from None
    if group_by:
        _print(itertools.islice(merged.groups(group_by), limit or None), GROUP_COLUMNS, output)
    else:
        rows = itertools.islice(merged.rows, limit or None)
        _print(((r.region, r.row) for r in rows), ROW_COLUMNS, output, region=True)
    _summary(merged)


def _summary(merged: MergedUsage) -> None:
    totals = merged.totals()
    read = [r for r in merged.regions if r not in merged.missing]
    typer.echo(
        f"{totals.requests} requests, {totals.prompt_tokens + totals.completion_tokens} tokens "
        f"from regions {', '.join(read) or '(none)'}; duplicates dropped: {merged.duplicates} "
        "(a request held by two regions counts once)",
        err=True,
    )
    if merged.missing:
        missing = "; ".join(
            f"{r} ({exc.grpc_code.name}: {exc.message})" for r, exc in merged.missing.items()
        )
        typer.echo(f"INCOMPLETE: could not read region {missing}", err=True)
        raise typer.Exit(3)


def _print(
    items: Iterable[Any], columns: tuple[str, ...], output: str, *, region: bool = False
) -> None:
    """Prints protos (or, with `region`, `(region, row)` pairs under a first `region`
    column) as a table, CSV or JSON lines."""
    pairs = items if region else (("", item) for item in items)
    header = ("region", *columns) if region else columns
    if output == "json":
        for name, item in pairs:
            data = json_format.MessageToDict(
                item, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            if region:
                data["region"] = name
            typer.echo(json.dumps(data, sort_keys=True))
        return
    if output == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(header)
        for name, item in pairs:
            writer.writerow([name, *_cells(item, columns)] if region else _cells(item, columns))
        return
    table = Table(*header)
    for name, item in pairs:
        table.add_row(*([name, *_cells(item, columns)] if region else _cells(item, columns)))
    Console().print(table)

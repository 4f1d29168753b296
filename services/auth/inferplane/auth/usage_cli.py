"""`inferplane usage`: read the usage ledger over gRPC with an admin key (through the SDK).

Rows (one per request, oldest first) or totals per hour, day, model, key or tenant, as a
table, CSV or JSON lines; filters by time range (`--since`/`--until`, ISO 8601, UTC when no
zone is given, or a duration back from now such as `24h`, `7d`), key, tenant and model. All
pages are read (`--limit` stops after that many rows or groups).
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
    columns = GROUP_COLUMNS if group_by else ROW_COLUMNS
    with admin_client(address, admin_key) as client:
        items: Iterable[usage_pb2.UsageRow | usage_pb2.UsageGroup] = (
            client.usage.groups(group_by, **filters)  # type: ignore[arg-type]
            if group_by
            else client.usage.rows(**filters)  # type: ignore[arg-type]
        )
        _print(itertools.islice(items, limit or None), columns, output)


def _print(items: Iterable[Any], columns: tuple[str, ...], output: str) -> None:
    if output == "json":
        for item in items:
            data = json_format.MessageToDict(
                item, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            typer.echo(json.dumps(data, sort_keys=True))
        return
    if output == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        for item in items:
            writer.writerow(_cells(item, columns))
        return
    table = Table(*columns)
    for item in items:
        table.add_row(*_cells(item, columns))
    Console().print(table)

"""Usage views of the console: the CSV export and the chart bars, from the usage ledger's
rows and groups (`inferplane.auth.v1.UsageRow` / `UsageGroup`)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence

from inferplane.api.auth.v1 import usage_pb2
from inferplane.console.charts import Bar

CSV_COLUMNS = (
    "request_id",
    "end_time",
    "key_id",
    "tenant",
    "model",
    "deployment",
    "replica",
    "status",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "ttft_seconds",
    "duration_seconds",
    "gpu_seconds",
)
# A spreadsheet runs a cell starting with one of these as a formula (OWASP "CSV injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: object) -> object:
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def usage_csv(rows: Iterable[usage_pb2.UsageRow]) -> str:
    """The rows as CSV (RFC 4180, `CSV_COLUMNS` header, UTC ISO 8601 end times, seconds as
    decimals); text cells that a spreadsheet would run as a formula are prefixed with `'`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        end = row.end_time.ToDatetime().isoformat() + "Z" if row.HasField("end_time") else ""
        writer.writerow(
            [
                _cell(row.request_id),
                end,
                _cell(row.key_id),
                _cell(row.tenant),
                _cell(row.model),
                _cell(row.deployment),
                _cell(row.replica),
                _cell(row.status),
                row.prompt_tokens,
                row.cached_tokens,
                row.completion_tokens,
                row.reasoning_tokens,
                f"{row.ttft_seconds:.6f}",
                f"{row.duration_seconds:.6f}",
                f"{row.gpu_seconds:.6f}",
            ]
        )
    return out.getvalue()


def total_tokens(group: usage_pb2.UsageGroup) -> int:
    """Prompt + completion tokens of a group (what a monthly budget counts)."""
    return int(group.prompt_tokens + group.completion_tokens)


def token_bars(groups: Sequence[usage_pb2.UsageGroup]) -> list[Bar]:
    """One bar per group, its prompt + completion tokens, in the ledger's order."""
    return [Bar(g.group or "(none)", float(total_tokens(g))) for g in groups]

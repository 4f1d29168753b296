"""The usage page: tokens per day, per model and per key over the last 1, 7, 30 or 90 days
(SVG charts and tables, optionally for one key), and `usage.csv`, one row per request.

Errors: `days` outside `USAGE_PERIODS` answers 400; a refused ledger query shows auth's
message with the edge's status.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from inferplane.console.charts import bar_chart
from inferplane.console.usage import token_bars, total_tokens, usage_csv
from inferplane.console.web import Console
from inferplane.runtime import InferplaneError

USAGE_PERIODS = (1, 7, 30, 90)  # days the usage page offers


class UsagePages:
    """`usage` (charts and tables) and `usage.csv` (the rows), both GET with `days` and `key`."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def _usage_filters(self, request: web.Request) -> tuple[int, str, datetime]:
        raw = request.query.get("days", "7")
        if not raw.isdigit() or int(raw) not in USAGE_PERIODS:
            raise web.HTTPBadRequest(
                text=f"days must be one of {', '.join(map(str, USAGE_PERIODS))}"
            )
        days = int(raw)
        key = request.query.get("key", "").strip()
        start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        return days, key, start - timedelta(days=days - 1)

    async def usage_page(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.console.signed_in(request)
        days, key, start = self._usage_filters(request)
        context: dict[str, Any] = {"days": days, "key": key, "periods": USAGE_PERIODS}
        try:
            by_day = await client.usage_groups("day", start=start, key=key)
            by_model = await client.usage_groups("model", start=start, key=key)
            by_key = await client.usage_groups("key", start=start, key=key)
        except InferplaneError as exc:
            return await self.console.platform_error(
                request, exc, "usage.html", charts=None, by_day=[], by_model=[], by_key=[],
                **context,
            )  # fmt: skip
        charts = {
            "day": bar_chart(
                token_bars(by_day), title=f"Tokens per day, last {days} days", unit="tokens",
                chart_id="chart-day",
            ),
            "model": bar_chart(
                token_bars(by_model), title="Tokens per model", unit="tokens",
                chart_id="chart-model",
            ),
            "key": bar_chart(
                token_bars(by_key), title="Tokens per key", unit="tokens", chart_id="chart-key"
            ),
        }  # fmt: skip
        return self.console.render(
            request,
            "usage.html",
            charts=charts,
            by_day=by_day,
            by_model=by_model,
            by_key=by_key,
            total_tokens=total_tokens,
            **context,
        )

    async def usage_export(self, request: web.Request) -> web.StreamResponse:
        _, _, client = self.console.signed_in(request)
        days, key, start = self._usage_filters(request)
        try:
            rows = await client.usage_rows(start=start, key=key)
        except InferplaneError as exc:
            return await self.console.platform_error(request, exc, "error.html")
        name = f"inferplane-usage-{start:%Y%m%d}-{days}d.csv"
        return web.Response(
            text=usage_csv(rows),
            content_type="text/csv",
            charset="utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )

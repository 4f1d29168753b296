"""A tenant's usage across regions: every region's ledger read and merged, each request once
(issue 31; docs/regions.md, "Usage").

Each region's auth keeps its own usage ledger, one row per request id (issued by the region's
edge). A request is recorded in the region that served it; a request the global tier retried
into a second region (only before any response byte) may also have a failed attempt's row,
under the first region's own id, in the first. Should one id reach two ledgers all the same (a
ledger restored or replayed into another region), `merge_usage` keeps one row per request id,
chosen by `MERGE_RULE`; it labels each row with the region whose ledger held it and sums the
totals from the merged rows, so a report's totals always equal the sum of the rows it lists.

`MultiRegionUsage` (blocking) and `AsyncMultiRegionUsage` (asyncio) read every region's rows
for one filter (all pages, the regions queried concurrently) and merge them. A region that
cannot be read makes the report incomplete: by default they raise `UnavailableError` with
reason `USAGE_INCOMPLETE` (naming each missing region and why); with `partial=True` they
return the partial report, whose `missing` names those regions. They never present a partial
total as complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from inferplane.api.auth.v1 import usage_pb2
from inferplane.regions import validate_region
from inferplane.runtime import InferplaneError, UnavailableError
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.sdk._async_client import AsyncClient
from inferplane.sdk._client import Client
from inferplane.sdk._transport import RetryPolicy

MERGE_RULE = (
    "one row per request id; when several regions hold it, the one that is not provisional, "
    "then the one that completed, then the one with the most prompt + completion tokens, "
    "then the region whose name sorts first"
)
"""How `merge_usage` chooses among copies of one request id (also printed by the CLI's help)."""

#: What merged rows can be grouped by: the ledger's groupings (`QueryUsage.group_by`, same
#: labels: hour and day buckets as RFC 3339 UTC starts) plus `region`.
MERGED_GROUPINGS = ("hour", "day", "model", "key", "tenant", "api", "adapter", "revision", "region")


@dataclasses.dataclass(frozen=True, slots=True)
class RegionRow:
    """One request's ledger row and the region whose ledger held it."""

    region: str
    row: usage_pb2.UsageRow


@dataclasses.dataclass(frozen=True, slots=True)
class MergedUsage:
    """Usage merged across regions.

    Attributes:
        rows: each request once, ordered by end time, then request id.
        regions: the regions asked, in the order given.
        duplicates: copies of a request id dropped because another region's row won.
        missing: region → the error that kept its ledger out (empty: the report is complete).
    """

    rows: tuple[RegionRow, ...]
    regions: tuple[str, ...]
    duplicates: int = 0
    missing: Mapping[str, InferplaneError] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every region's ledger was read."""
        return not self.missing

    def totals(self) -> usage_pb2.UsageGroup:
        """The sums over `rows` (`group` "total"): requests, failed requests (status other
        than "completed"), tokens by kind, GPU-seconds."""
        return _sum("total", (r.row for r in self.rows))

    def groups(self, by: str) -> tuple[usage_pb2.UsageGroup, ...]:
        """Totals per group of the merged rows, ordered by group label.

        Raises:
            ValueError: `by` is not one of `MERGED_GROUPINGS`.
        """
        if by not in MERGED_GROUPINGS:
            raise ValueError(f"group_by must be one of {', '.join(MERGED_GROUPINGS)}")
        buckets: dict[str, list[usage_pb2.UsageRow]] = {}
        for item in self.rows:
            buckets.setdefault(_group_label(by, item), []).append(item.row)
        return tuple(_sum(label, buckets[label]) for label in sorted(buckets))


USAGE_INCOMPLETE = "USAGE_INCOMPLETE"
"""`reason` of the `UnavailableError` raised when a region's ledger could not be read."""


def incomplete_usage_error(merged: MergedUsage) -> UnavailableError:
    """The error for a merged report with missing regions: `UnavailableError`, reason
    `USAGE_INCOMPLETE`, the message naming each missing region and its error, metadata
    `missing_regions` (comma-separated names)."""
    names = "; ".join(
        f"{region} ({exc.grpc_code.name}: {exc.message})" for region, exc in merged.missing.items()
    )
    return UnavailableError(
        f"usage report incomplete: could not read region {names}",
        reason=USAGE_INCOMPLETE,
        metadata={"missing_regions": ",".join(merged.missing)},
    )


def _tokens(row: usage_pb2.UsageRow) -> int:
    return int(row.prompt_tokens + row.completion_tokens)


def _rank(item: RegionRow) -> tuple[bool, bool, int]:
    row = item.row
    return (not row.provisional, row.status == "completed", _tokens(row))


def _better(candidate: RegionRow, kept: RegionRow) -> bool:
    """Whether `candidate` replaces `kept` under `MERGE_RULE`."""
    if _rank(candidate) != _rank(kept):
        return _rank(candidate) > _rank(kept)
    return candidate.region < kept.region


def _order(item: RegionRow) -> tuple[int, int, str]:
    end = item.row.end_time
    return end.seconds, end.nanos, item.row.request_id


def merge_usage(
    rows_by_region: Mapping[str, Iterable[usage_pb2.UsageRow]],
    *,
    missing: Mapping[str, InferplaneError] | None = None,
) -> MergedUsage:
    """Merges regions' ledger rows: each request id once (`MERGE_RULE`), labelled with its
    region, ordered by end time then request id.

    Args:
        rows_by_region: region name → the rows its ledger returned.
        missing: regions that could not be read, with why (kept on the result).
    """
    kept: dict[str, RegionRow] = {}
    duplicates = 0
    for region, rows in rows_by_region.items():
        for row in rows:
            item = RegionRow(region, row)
            found = kept.get(row.request_id)
            if found is None:
                kept[row.request_id] = item
                continue
            duplicates += 1
            if _better(item, found):
                kept[row.request_id] = item
    ordered = sorted(kept.values(), key=_order)
    regions = (*rows_by_region, *(r for r in (missing or {}) if r not in rows_by_region))
    return MergedUsage(tuple(ordered), tuple(regions), duplicates, dict(missing or {}))


def _group_label(by: str, item: RegionRow) -> str:
    row = item.row
    if by == "region":
        return item.region
    if by == "key":
        return row.key_id
    if by in ("hour", "day"):
        end = row.end_time.ToDatetime(tzinfo=UTC)
        return end.strftime("%Y-%m-%dT%H:00:00Z" if by == "hour" else "%Y-%m-%dT00:00:00Z")
    return str(getattr(row, by))


def _sum(label: str, rows: Iterable[usage_pb2.UsageRow]) -> usage_pb2.UsageGroup:
    group = usage_pb2.UsageGroup(group=label)
    for row in rows:
        group.requests += 1
        group.failed_requests += row.status != "completed"
        group.prompt_tokens += row.prompt_tokens
        group.cached_tokens += row.cached_tokens
        group.completion_tokens += row.completion_tokens
        group.reasoning_tokens += row.reasoning_tokens
        group.gpu_seconds += row.gpu_seconds
    return group


@dataclasses.dataclass(frozen=True, slots=True)
class UsageFilter:
    """The filters of a usage query (`Usage.rows`' keywords): requests that ended in
    [`start`, `end`) (timezone-aware; None: unbounded), exact `key` (id or `api-keys/{id}`),
    `tenant`, `model`, `api` when set."""

    start: datetime | None = None
    end: datetime | None = None
    key: str = ""
    tenant: str = ""
    model: str = ""
    api: str = ""

    def kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _regions(regions: Mapping[str, Any]) -> None:
    if not regions:
        raise ValueError("at least one region is needed")
    for name in regions:
        validate_region(name)


def _finish(merged: MergedUsage, names: Iterable[str], partial: bool) -> MergedUsage:
    merged = dataclasses.replace(merged, regions=tuple(names))
    if merged.missing and not partial:
        raise incomplete_usage_error(merged)
    return merged


class MultiRegionUsage:
    """Reads the usage ledgers of several regions (each region's auth) and merges them.

    Args:
        regions: region name → its auth's `host:port`, or a `Client` (used, not closed).
        security, admin_key, timeout, retry: for the clients made from addresses (`Client`'s
            arguments; `timeout` is per page).

    Raises:
        ValueError: no region, or a name that is not a valid region name.
        ConfigError: no `security` and no operator identity (from `Client`).
    """

    def __init__(
        self,
        regions: Mapping[str, str | Client],
        *,
        security: PeerSecurity | None = None,
        admin_key: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        _regions(regions)
        self._owned: list[Client] = []
        self._clients: dict[str, Client] = {}
        for name, target in regions.items():
            if isinstance(target, Client):
                self._clients[name] = target
                continue
            client = Client(
                auth=target, security=security, admin_key=admin_key, timeout=timeout, retry=retry
            )
            self._owned.append(client)
            self._clients[name] = client

    def rows(
        self,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        key: str = "",
        tenant: str = "",
        model: str = "",
        api: str = "",
        partial: bool = False,
    ) -> MergedUsage:
        """Every region's rows for the filters (`Usage.rows`' meaning; every page, the regions
        read concurrently), merged.

        Raises:
            UnavailableError: reason `USAGE_INCOMPLETE` (`incomplete_usage_error`), when a
                region could not be read and `partial` is False.
        """
        query = UsageFilter(start, end, key, tenant, model, api).kwargs()

        def read(client: Client) -> list[usage_pb2.UsageRow]:
            return list(client.usage.rows(**query, page_size=1000))

        found: dict[str, list[usage_pb2.UsageRow]] = {}
        missing: dict[str, InferplaneError] = {}
        with ThreadPoolExecutor(max_workers=len(self._clients)) as pool:
            futures = {name: pool.submit(read, c) for name, c in self._clients.items()}
            for name, future in futures.items():
                try:
                    found[name] = future.result()
                except InferplaneError as exc:
                    missing[name] = exc
        return _finish(merge_usage(found, missing=missing), self._clients, partial)

    def close(self) -> None:
        """Closes the clients this object made (not those it was given)."""
        for client in self._owned:
            client.close()

    def __enter__(self) -> MultiRegionUsage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncMultiRegionUsage:
    """`MultiRegionUsage` for asyncio: the same arguments (`AsyncClient`s instead of
    `Client`s), `await rows(...)`; use it as an async context manager or `await close()`."""

    def __init__(
        self,
        regions: Mapping[str, str | AsyncClient],
        *,
        security: PeerSecurity | None = None,
        admin_key: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        _regions(regions)
        self._owned: list[AsyncClient] = []
        self._clients: dict[str, AsyncClient] = {}
        for name, target in regions.items():
            if isinstance(target, AsyncClient):
                self._clients[name] = target
                continue
            client = AsyncClient(
                auth=target, security=security, admin_key=admin_key, timeout=timeout, retry=retry
            )
            self._owned.append(client)
            self._clients[name] = client

    async def rows(
        self,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        key: str = "",
        tenant: str = "",
        model: str = "",
        api: str = "",
        partial: bool = False,
    ) -> MergedUsage:
        """`MultiRegionUsage.rows`, awaited (the regions read concurrently).

        Raises:
            UnavailableError: reason `USAGE_INCOMPLETE` (`incomplete_usage_error`), when a
                region could not be read and `partial` is False.
        """
        query = UsageFilter(start, end, key, tenant, model, api).kwargs()

        async def read(client: AsyncClient) -> list[usage_pb2.UsageRow]:
            return [row async for row in client.usage.rows(**query, page_size=1000)]

        names = list(self._clients)
        results = await asyncio.gather(
            *(read(self._clients[n]) for n in names), return_exceptions=True
        )
        found: dict[str, list[usage_pb2.UsageRow]] = {}
        missing: dict[str, InferplaneError] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, InferplaneError):
                missing[name] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                found[name] = result
        return _finish(merge_usage(found, missing=missing), self._clients, partial)

    async def close(self) -> None:
        """Closes the clients this object made (not those it was given)."""
        for client in self._owned:
            await client.close()

    async def __aenter__(self) -> AsyncMultiRegionUsage:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

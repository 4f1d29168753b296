"""`inferplane.auth.v1.UsageService`: routers report finished requests (internal callers only).

Each reported request adds its tokens to its key's current token window
(`RateLimiter.record_usage`). Who may call:

- with `internal_token` set (production: routers on other hosts), a caller must present it in
  `x-inferplane-internal-token` (constant-time compare); the token is the trust boundary, so it
  works wherever the router runs;
- without it (the local stack), only loopback peers. The edge cannot be used as a loopback
  proxy: it routes only REST paths (`match_incoming_request_route`), so a native gRPC call to
  `/inferplane.auth.v1.UsageService/ReportUsage` through it matches no route.

A forged report could erase or inflate a tenant's token usage, hence the guard. Delivery is
at-least-once (the router's outbox re-sends a batch whose call failed, also after a crash).
Each batch is first written to the usage ledger (`inferplane.auth.ledger`) in one
transaction, idempotently by request id, and only the requests written now have their tokens
accounted to the rate windows: a re-sent batch counts nothing twice, whichever auth instance
it reaches, and the response (which makes the router trim the batch from its outbox) comes
only after the rows are committed. A provisional row (`RequestUsage.provisional`: the router
concluded the request without hearing how it ended) is replaced once by the request's first
non-provisional report, which then accounts the tokens the provisional row lacked.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Collection
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.auth.ledger import STATUSES, LedgerRow, SqlUsageLedger, UsageQuery
from inferplane.auth.limits import RateLimiter
from inferplane.runtime import (
    InvalidArgumentError,
    UnavailableError,
)
from inferplane.runtime.security.identity import peer_identity
from inferplane.runtime.security.internal import InternalCallerGuard
from inferplane.runtime.time.clock import Clock, SystemClock

if TYPE_CHECKING:
    from inferplane.auth.key_service import Caller

    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any

log = structlog.get_logger("inferplane.auth.usage")


class UsageMetrics:
    """`inferplane_auth_usage_requests_total{outcome}`: reported requests by what happened."""

    OUTCOMES = ("accounted", "amended", "duplicate", "invalid")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "inferplane_auth_usage_requests",
            "Finished requests reported by routers: accounted (written and tokens added), "
            "amended (a provisional row replaced by the request's late report, its tokens "
            "added), duplicate (already accounted: a re-sent batch), invalid (no key_id).",
            ["outcome"],
            registry=registry,
        )
        for outcome in self.OUTCOMES:
            self.requests.labels(outcome)


def ledger_row(usage: usage_pb2.RequestUsage, tenant: str, now: datetime) -> LedgerRow:
    """The ledger row of one reported request (`now`: its end time when the report has
    none). A report without a request id (never sent by the router, which always has the
    edge's `x-request-id`) gets a fresh id: it is kept, but a re-send of it cannot be
    recognised. An unknown status reads as "failed"."""
    status = usage.status or "completed"
    return LedgerRow(
        request_id=usage.request_id or f"unidentified-{uuid.uuid4().hex}",
        key_id=usage.key_id,
        tenant=tenant,
        model=usage.model,
        end_time=usage.end_time.ToDatetime(UTC) if usage.HasField("end_time") else now,
        deployment=usage.deployment,
        replica=usage.replica,
        status=status if status in STATUSES else "failed",
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        ttft_seconds=max(0.0, usage.ttft_seconds),
        duration_seconds=max(0.0, usage.duration_seconds),
        gpu_seconds=max(0.0, usage.gpu_seconds),
        start_time=usage.start_time.ToDatetime(UTC) if usage.HasField("start_time") else None,
        api=usage.api,
        adapter=usage.adapter,
        revision=usage.revision,
        provisional=usage.provisional,
    )


class UsageService(usage_pb2_grpc.UsageServiceServicer):  # type: ignore[misc]
    """inferplane.auth.v1.UsageService: writes finished requests to the usage ledger and
    accounts them against their keys' limits.

    Entries without a key_id are skipped (counted as invalid), not failed: one bad entry must
    not make the sender drop the whole batch. A ledger outage raises UNAVAILABLE and the
    router re-sends the batch: the ledger skips what it already has, so only the rest is
    written and accounted. Once the rows are written the batch succeeds: a counter store
    failure then leaves their tokens out of the minute's rate window (logged), since a
    re-send would find the rows and never add them.

    Args:
        ledger: the usage ledger (its idempotent writes make a re-send count once).
        tenant_of: the tenant of a key id (blocking: a key store read; "" for a deleted key).
        clock: stamps reports that carry no end time (default: the system clock).
        on_usage: told the key ids whose usage was written now (the key table refreshes
            their monthly budget state: `inferplane.auth.key_table`).
    """

    def __init__(
        self,
        limiter: RateLimiter,
        guard: InternalCallerGuard,
        metrics: UsageMetrics,
        ledger: SqlUsageLedger,
        *,
        tenant_of: Callable[[str], str] = lambda key_id: "",
        clock: Clock | None = None,
        on_usage: Callable[[Collection[str]], None] | None = None,
    ) -> None:
        self._on_usage = on_usage
        self._clock = clock or SystemClock()
        self._limiter = limiter
        self._guard = guard
        self._metrics = metrics
        self._ledger = ledger
        self._tenant_of = tenant_of

    async def ReportUsage(
        self, request: usage_pb2.ReportUsageRequest, context: Context
    ) -> usage_pb2.ReportUsageResponse:
        self._guard.check(
            dict(context.invocation_metadata() or ()), context.peer() or "", peer_identity(context)
        )
        entries = []
        for usage in request.usage:
            if not usage.key_id:
                self._metrics.requests.labels("invalid").inc()
                continue
            entries.append(usage)
        await self._account(entries)
        return usage_pb2.ReportUsageResponse()

    async def _account(self, entries: list[usage_pb2.RequestUsage]) -> None:
        tenants: dict[str, str] = {}
        for usage in entries:
            if usage.key_id not in tenants:
                tenants[usage.key_id] = await asyncio.to_thread(self._tenant_of, usage.key_id)
        now = self._clock.now()
        rows = [ledger_row(usage, tenants[usage.key_id], now) for usage in entries]
        written = await asyncio.to_thread(self._ledger.record, rows)
        if written and self._on_usage is not None:
            self._on_usage({r.key_id for r in rows if r.request_id in written})
        windows_failed = 0
        new_ids = {r.request_id for r in rows}
        for usage, row in zip(entries, rows, strict=True):
            if row.request_id in written and row.request_id in new_ids:
                new_ids.discard(row.request_id)  # a batch holding the id twice counts it once
                tokens, replaced = written[row.request_id]
                # The ledger row is the record, written exactly once above; the minute's token
                # window is best effort: a re-send would find the row and never add the tokens,
                # so a counter store failure here must not fail the batch.
                if tokens <= 0:
                    pass
                elif not windows_failed:
                    try:
                        await self._limiter.record_usage(usage.key_id, tokens)
                    except UnavailableError:
                        windows_failed = 1
                else:
                    windows_failed += 1
                self._accounted(usage, tokens, replaced=replaced)
            else:
                # Already in the ledger (a re-sent batch): its tokens were accounted then.
                self._metrics.requests.labels("duplicate").inc()
                log.debug("usage_duplicate", key_id=usage.key_id, request_id=usage.request_id)
        if windows_failed:
            log.warning(
                "usage_token_windows_skipped",
                requests=windows_failed,
                note="in the ledger; their tokens are missing from this minute's rate window",
            )

    def _accounted(self, usage: usage_pb2.RequestUsage, tokens: int, *, replaced: bool) -> None:
        self._metrics.requests.labels("amended" if replaced else "accounted").inc()
        # One line per accounted request (at debug: an audit trail by request id, which
        # bench/chaos.py matches against what its clients saw across auth restarts).
        log.debug(
            "usage_accounted",
            key_id=usage.key_id,
            request_id=usage.request_id,
            tokens=tokens,
            provisional=usage.provisional,
            replaced=replaced,
        )


def usage_row_to_proto(row: LedgerRow) -> usage_pb2.UsageRow:
    """A ledger row as `inferplane.auth.v1.UsageRow`."""
    msg = usage_pb2.UsageRow(
        request_id=row.request_id,
        key_id=row.key_id,
        tenant=row.tenant,
        model=row.model,
        deployment=row.deployment,
        replica=row.replica,
        status=row.status,
        prompt_tokens=row.prompt_tokens,
        cached_tokens=row.cached_tokens,
        completion_tokens=row.completion_tokens,
        reasoning_tokens=row.reasoning_tokens,
        ttft_seconds=row.ttft_seconds,
        duration_seconds=row.duration_seconds,
        gpu_seconds=row.gpu_seconds,
        api=row.api,
        adapter=row.adapter,
        revision=row.revision,
        provisional=row.provisional,
    )
    msg.end_time.FromDatetime(row.end_time)
    if row.start_time is not None:
        msg.start_time.FromDatetime(row.start_time)
    return msg


class UsageLedgerService(usage_pb2_grpc.UsageLedgerServiceServicer):  # type: ignore[misc]
    """inferplane.auth.v1.UsageLedgerService: reads the usage ledger (admin scope: the edge's
    `/v1/admin/usage`, whose Check requires it, or an operator's CLI; console scope: the web
    console acting for a tenant's key, which reads only its own tenant's rows).

    Args:
        caller: who calls and which tenant it may read (`ApiKeyService.caller`: the edge's
            forwarded scopes, or a direct caller's admin or console key).

    Errors: UNAUTHENTICATED / PERMISSION_DENIED for a caller who is neither an admin nor a
    console key, and for a console key asking for another tenant;
    INVALID_ARGUMENT for a bad grouping, page size, page token or an end before the start;
    UNAVAILABLE when the database is unreachable.
    """

    def __init__(
        self, ledger: SqlUsageLedger, caller: Callable[[Context, str], Awaitable[Caller]]
    ) -> None:
        self._ledger = ledger
        self._caller = caller

    async def QueryUsage(
        self, request: usage_pb2.QueryUsageRequest, context: Context
    ) -> usage_pb2.QueryUsageResponse:
        caller = await self._caller(context, "read usage")
        start = request.start_time.ToDatetime(UTC) if request.HasField("start_time") else None
        end = request.end_time.ToDatetime(UTC) if request.HasField("end_time") else None
        if start is not None and end is not None and end <= start:
            raise InvalidArgumentError("end_time must be after start_time", param="end_time")
        query = UsageQuery(
            start=start,
            end=end,
            key_id=request.key_id,
            tenant=caller.tenant_filter(request.tenant),
            model=request.model,
            api=request.api,
            group_by=request.group_by,
            page_size=request.page_size or 100,
            page_token=request.page_token,
        )
        page = await asyncio.to_thread(self._ledger.query, query)
        return usage_pb2.QueryUsageResponse(
            rows=[usage_row_to_proto(r) for r in page.rows],
            groups=[
                usage_pb2.UsageGroup(
                    group=g.group,
                    requests=g.requests,
                    failed_requests=g.failed_requests,
                    prompt_tokens=g.prompt_tokens,
                    cached_tokens=g.cached_tokens,
                    completion_tokens=g.completion_tokens,
                    reasoning_tokens=g.reasoning_tokens,
                    gpu_seconds=g.gpu_seconds,
                )
                for g in page.groups
            ],
            next_page_token=page.next_page_token,
        )

"""Concurrency slots released by the edge's access log: every ending of every request.

A key's concurrent-request slot is taken in ext_authz `Check` (generation requests only, named
by the edge's `x-request-id`, which Envoy always generates) and used to be released only by
the router's usage report. Requests that end before the router sees them (the transcoder's
400, the picker unreachable, a client gone before the pick, a timeout in the edge) left the
slot taken until its lease expired. The edge therefore streams one access-log entry per
finished request carrying a key (Envoy's gRPC access logger, `envoy.service.accesslog.v3.
AccessLogService`, configured by `inferplane.edge` when auth is its authorizer) and this
servicer releases the slot each entry names. The router's usage report still accounts the
tokens and releases too; both releases are idempotent.

Who may call: the same guard as `UsageService` (`InternalCallerGuard`: the internal token,
which the edge sends as initial metadata, or loopback peers without one): a forged entry
could free a tenant's slots.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import structlog
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from inferplane.auth.limits import RateLimiter
from inferplane.auth.usage import InternalCallerGuard
from inferplane.wire.headers import KEY_ID

log = structlog.get_logger("inferplane.auth.slots")


class SlotReleaseService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """`AccessLogService.StreamAccessLogs`: releases the concurrency slot of every request the
    edge logs (`x-inferplane-key-id` + the request id). Entries without a key are skipped."""

    def __init__(
        self, limiter: RateLimiter, guard: InternalCallerGuard, registry: CollectorRegistry
    ) -> None:
        self._limiter = limiter
        self._guard = guard
        self._released = Counter(
            "inferplane_auth_slots_released_by_edge_log",
            "Concurrency slots released on the edge's access-log entry of a finished request.",
            registry=registry,
        )

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        self._guard.check(dict(context.invocation_metadata() or ()), context.peer())
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                key_id = entry.request.request_headers.get(KEY_ID, "")
                request_id = entry.request.request_id
                if not key_id or not request_id:
                    continue
                try:
                    await self._limiter.release(key_id, request_id)
                except Exception:  # the store is away: the lease expires on its own
                    log.warning("slot_release_failed", key_id=key_id, request_id=request_id)
                    continue
                self._released.inc()
        return als_pb2.StreamAccessLogsResponse()

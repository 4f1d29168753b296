"""Per-request usage reports from the router to auth's usage ledger, through a durable outbox.

The router concludes every request it decided on (refusals included: no replica sees those)
and writes its usage report (`ConcludedRequest.usage()`, for a request that carried a key) to
a write-ahead outbox before anything acknowledges the request: `AuthUsageSink.record` never
blocks, the outbox appends it to its file within `flush_interval_seconds`
(`inferplane.runtime.delivery.outbox`) and a background sender delivers batches to
`inferplane.auth.v1.UsageService.ReportUsage` (proto/inferplane/auth/v1/usage.proto), removing
them only once auth acknowledged. Auth keeps one row per request id, so a batch re-sent after
a crash or a lost answer is counted once. Nothing on the response path waits for auth.
Without `auth_address` the composition root wires `LoggingUsageSink`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.router.records import ConcludedRequest
from inferplane.runtime.delivery.batching import RETRYABLE_CODES, BatchMetrics, Sleep
from inferplane.runtime.delivery.outbox import Outbox, OutboxSettings
from inferplane.runtime.delivery.spool import Spool
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.wire import headers

log = structlog.get_logger("inferplane.router.usage")

__all__ = [
    "RETRYABLE_CODES",
    "AuthUsageSink",
    "LoggingUsageSink",
    "UsageSink",
    "UsageSinkMetrics",
    "UsageSinkSettings",
]


class UsageSink(Protocol):
    """Where concluded requests' usage goes. `record` must not block or raise; it returns the
    report's position for `durable` (0: nothing to wait for)."""

    def record(self, request: ConcludedRequest) -> int: ...

    async def durable(self, position: int) -> None:
        """Returns once the report at `position` is in the durable outbox."""
        ...


class LoggingUsageSink:
    """The sink without an auth service to report to: a debug log line per request."""

    def record(self, request: ConcludedRequest) -> int:
        log.debug("request_usage", **dataclasses.asdict(request))
        return 0

    async def durable(self, position: int) -> None:
        return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UsageSinkSettings(OutboxSettings):
    """How `AuthUsageSink` writes and sends (`OutboxSettings`).

    Attributes:
        target: auth's `UsageService` (`host:port`).
        internal_token: sent as `x-inferplane-internal-token` when set (auth's
            `internal_token`; auth accepts only loopback peers without one).
        rpc_timeout_seconds: the deadline of one `ReportUsage` call.
        security: the identity the channel presents (plaintext by default, for tests).
    """

    target: str
    internal_token: str = dataclasses.field(default="", repr=False)
    rpc_timeout_seconds: float = 5.0
    security: PeerSecurity = dataclasses.field(default_factory=PeerSecurity.plaintext)


class UsageSinkMetrics(BatchMetrics):
    """`inferplane_router_usage_reports_{sent_total,dropped_total{reason},buffered}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(
            registry,
            "inferplane_router_usage_reports",
            sent_help="Usage reports delivered to auth.",
            dropped_help="Usage reports never delivered: buffer_full (the outbox could not be "
            "written fast enough, or holds `capacity` without a file) or rejected (auth "
            "refused the batch, e.g. a wrong internal token).",
            buffered_help="Usage reports in the outbox: waiting to be written or to be "
            "acknowledged by auth.",
        )


class AuthUsageSink:
    """Usage reports to auth through an `Outbox` (the module docstring).

    Args:
        spool_path: the outbox's SQLite file (kept across restarts: the next process delivers
            what this one left); None: in memory (a crash loses what auth does not have yet).
        channel_options: extra gRPC channel options.
    """

    def __init__(
        self,
        settings: UsageSinkSettings,
        registry: CollectorRegistry,
        *,
        sleep: Sleep = asyncio.sleep,
        channel_options: Sequence[tuple[str, Any]] = (),
        spool_path: Path | None = None,
    ) -> None:
        self._settings = settings
        self._channel_options = channel_options
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._metadata: tuple[tuple[str, str], ...] = (
            ((headers.INTERNAL_TOKEN, settings.internal_token),) if settings.internal_token else ()
        )
        self.metrics = UsageSinkMetrics(registry)
        spool: Spool[usage_pb2.RequestUsage] = Spool(
            spool_path, usage_pb2.RequestUsage.SerializeToString, usage_pb2.RequestUsage.FromString
        )
        self._outbox = Outbox(
            spool, self._send, settings, self.metrics, name="router-usage", sleep=sleep
        )

    def record(self, request: ConcludedRequest) -> int:
        """Puts the request's usage report in the outbox; returns its position for `durable`
        (0 = dropped). Never blocks, never raises; call it on the event loop."""
        try:
            return self._outbox.put(request.usage())
        except Exception:  # the request path must never see the sink's problems
            log.exception("usage_record_failed", request_id=request.request_id)
            return 0

    async def durable(self, position: int) -> None:
        """`Outbox.durable`: returns once the report at `position` is in the outbox's file."""
        await self._outbox.durable(position)

    @property
    def pending(self) -> int:
        """Reports waiting to be written to the outbox."""
        return self._outbox.pending

    @property
    def spooled(self) -> int:
        """Reports in the outbox, not yet acknowledged by auth."""
        return self._outbox.spooled

    async def start(self) -> None:
        """Opens the channel (reconnect backoff capped at `backoff_max_seconds`) and starts
        the outbox's writer and sender."""
        max_backoff_ms = max(100, int(self._settings.backoff_max_seconds * 1000))
        self._channel = self._settings.security.aio_channel(
            self._settings.target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", max_backoff_ms),
                *self._channel_options,
            ],
        )
        self._stub = usage_pb2_grpc.UsageServiceStub(self._channel)
        await self._outbox.start()

    async def close(self, timeout_seconds: float = 5.0) -> None:
        """`Outbox.close` (what auth does not have stays in the file), then the channel."""
        await self._outbox.close(timeout_seconds)
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    async def _send(self, batch: list[usage_pb2.RequestUsage]) -> None:
        if self._stub is None:
            raise grpc.aio.AioRpcError(  # retryable: the next process sends it
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="not started",
                debug_error_string="",
            )
        await self._stub.ReportUsage(
            usage_pb2.ReportUsageRequest(usage=batch),
            metadata=self._metadata,
            timeout=self._settings.rpc_timeout_seconds,
        )

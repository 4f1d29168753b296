"""Per-request usage reports from the router to auth (token limits and concurrency leases).

The router is the only component that sees both the end of a request and its usage, so it
reports each request with a key exactly once when it ends (tokens may be 0: the report also
releases the key's concurrent-request slot in auth). `AuthUsageSink` sends them to
`inferplane.auth.v1.UsageService.ReportUsage` (proto/inferplane/auth/v1/usage.proto) in
batches, off the request path; without `auth_address` the composition root wires
`LoggingUsageSink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf import timestamp_pb2
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.runtime.delivery.batching import (
    RETRYABLE_CODES,
    BatchMetrics,
    GrpcSink,
    GrpcSinkSettings,
    Sleep,
)
from inferplane.runtime.delivery.spool import Spool
from inferplane.wire import headers

log = structlog.get_logger("inferplane.router.usage")

__all__ = [
    "RETRYABLE_CODES",
    "AuthUsageSink",
    "LoggingUsageSink",
    "UsageRecord",
    "UsageSink",
    "UsageSinkMetrics",
    "UsageSinkSettings",
    "to_proto",
]


@dataclasses.dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished request of one API key.

    Attributes:
        key_id: the API key (`x-inferplane-key-id`).
        request_id: the edge's `x-request-id` (auth's concurrency lease id).
        model: the model name the client asked for.
        prompt_tokens / completion_tokens: from the replica's usage; 0 when it never said.
        ok: whether the request completed without error.
        end_time: wall-clock seconds (Unix) when it ended; 0 = when the sink got it.
        deployment / replica: what served it ("" when nothing was picked).
        cached_tokens / reasoning_tokens: parts of prompt / completion tokens.
        ttft_seconds / duration_seconds: from arrival at the router, seconds.
        gpu_seconds: attributed by the replica (`inferplane.wire.ResponseSummary`).
        status: "completed", "failed" or "cancelled" (the client went away).
        start_time: wall-clock seconds (Unix) when it arrived; 0 = unknown.
        api: the public API it came through (`inferplane.wire.apis`); "" = unknown.
    """

    key_id: str
    request_id: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ok: bool = True
    end_time: float = 0.0
    deployment: str = ""
    replica: str = ""
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    ttft_seconds: float = 0.0
    duration_seconds: float = 0.0
    gpu_seconds: float = 0.0
    status: str = "completed"
    start_time: float = 0.0
    api: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageSink(Protocol):
    """Where usage goes. `record` must not block or raise (batch and send in the background);
    it returns the report's position for `settled` (0: nothing to wait for)."""

    def record(self, usage: UsageRecord) -> int: ...

    async def settled(self, position: int) -> None:
        """Returns once the report at `position` reached its receiver (or was given up)."""
        ...


class LoggingUsageSink:
    """The sink without an auth service to report to: a debug log line per request."""

    def record(self, usage: UsageRecord) -> int:
        log.debug("request_usage", **dataclasses.asdict(usage))
        return 0

    async def settled(self, position: int) -> None:
        return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UsageSinkSettings(GrpcSinkSettings):
    """How `AuthUsageSink` buffers and sends (`GrpcSinkSettings`; `target` is auth's
    UsageService). A report goes as soon as the previous call returned (no flush interval:
    slots are freed promptly, batches of up to 256 grow with load only). Beyond `capacity`
    the newest is dropped and counted (auth then frees the slot by lease expiry, and the
    tokens are not counted: an under-count bounded by the outage).

    Attributes:
        internal_token: sent as `x-inferplane-internal-token` when set (auth's
            `internal_token`; auth accepts only loopback peers without one).
    """

    internal_token: str = dataclasses.field(default="", repr=False)
    batch_size: int = 256


class UsageSinkMetrics(BatchMetrics):
    """`inferplane_router_usage_reports_{sent_total,dropped_total{reason},buffered}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(
            registry,
            "inferplane_router_usage_reports",
            sent_help="Usage reports delivered to auth.",
            dropped_help="Usage reports never delivered: buffer_full (auth down too long) or "
            "rejected (auth refused the batch, e.g. a wrong internal token).",
            buffered_help="Usage reports waiting in the buffer or in flight.",
        )


def to_proto(usage: UsageRecord) -> usage_pb2.RequestUsage:
    """The wire form of one report."""
    end = timestamp_pb2.Timestamp()
    end.FromNanoseconds(int(usage.end_time * 1e9))
    msg = usage_pb2.RequestUsage(
        key_id=usage.key_id,
        request_id=usage.request_id,
        model=usage.model,
        prompt_tokens=max(0, usage.prompt_tokens),
        completion_tokens=max(0, usage.completion_tokens),
        end_time=end,
        deployment=usage.deployment,
        replica=usage.replica,
        cached_tokens=max(0, usage.cached_tokens),
        reasoning_tokens=max(0, usage.reasoning_tokens),
        ttft_seconds=max(0.0, usage.ttft_seconds),
        duration_seconds=max(0.0, usage.duration_seconds),
        gpu_seconds=max(0.0, usage.gpu_seconds),
        status=usage.status,
        api=usage.api,
    )
    if usage.start_time > 0:
        msg.start_time.FromNanoseconds(int(usage.start_time * 1e9))
    return msg


def _encode(usage: usage_pb2.RequestUsage) -> bytes:
    return usage.SerializeToString()


class AuthUsageSink(GrpcSink[usage_pb2.RequestUsage]):
    """Sends usage reports to auth in batches, in the background.

    `record()` (the request path) never blocks, raises or does I/O. The guarantees are
    `inferplane.runtime.delivery.batching.Batcher`'s: bounded by `capacity` while auth is down
    (a failed
    batch goes back to the front, the sender backs off with full jitter), a refused batch
    (e.g. PERMISSION_DENIED for a wrong internal token) dropped and counted, at-least-once
    delivery (auth's usage ledger skips a request_id it already has). With `spool_path`, the
    reports that wait for auth go to that file after each failed send and at close, and are
    sent first when auth is back, also by the next process after a restart.
    """

    def __init__(
        self,
        settings: UsageSinkSettings,
        registry: CollectorRegistry,
        *,
        sleep: Sleep = asyncio.sleep,
        wall_clock: Callable[[], float] = time.time,
        channel_options: Sequence[tuple[str, Any]] = (),
        spool_path: Path | None = None,
    ) -> None:
        self._spool = (
            Spool(spool_path, _encode, usage_pb2.RequestUsage.FromString)
            if spool_path is not None
            else None
        )
        super().__init__(
            settings,
            UsageSinkMetrics(registry),
            name="router-usage-sink",
            sleep=sleep,
            channel_options=channel_options,
            spool=self._spool,
        )
        self._wall_clock = wall_clock
        self._stub: Any = None
        self._metadata: tuple[tuple[str, str], ...] = (
            ((headers.INTERNAL_TOKEN, settings.internal_token),) if settings.internal_token else ()
        )

    def record(self, usage: UsageRecord) -> int:
        """Queues one report; returns its position for `settled` (0 = dropped). Never blocks,
        never raises; may be called from any thread."""
        try:
            if not usage.end_time:
                usage = dataclasses.replace(usage, end_time=self._wall_clock())
            return self._put(to_proto(usage))
        except Exception:  # the request path must never see the sink's problems
            with contextlib.suppress(Exception):
                log.exception("usage_record_failed")
            return 0

    def _bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = usage_pb2_grpc.UsageServiceStub(channel)

    async def close(self, timeout_seconds: float = 5.0) -> None:
        """`GrpcSink.close` (what is left goes to the spool when there is one), then closes
        the spool file."""
        await super().close(timeout_seconds)
        if self._spool is not None:
            self._spool.close()

    async def _send(self, batch: list[usage_pb2.RequestUsage]) -> None:
        request = usage_pb2.ReportUsageRequest(usage=batch)
        await self._stub.ReportUsage(
            request, metadata=self._metadata, timeout=self._settings.rpc_timeout_seconds
        )

"""`inferplane.auth.v1.UsageService`: routers report finished requests (internal callers only).

Each reported request adds its tokens to its key's current token window and releases its
concurrent-request slot (`RateLimiter.record_usage`). Who may call:

- with `internal_token` set (production: routers on other hosts), a caller must present it in
  `x-inferplane-internal-token` (constant-time compare); the token is the trust boundary, so it
  works wherever the router runs;
- without it (the local stack), only loopback peers. The edge cannot be used as a loopback
  proxy: it routes only REST paths (`match_incoming_request_route`), so a native gRPC call to
  `/inferplane.auth.v1.UsageService/ReportUsage` through it matches no route.

A forged report could erase a tenant's token usage or free its concurrency slots, hence the
guard. Delivery is at-least-once (the router re-sends a batch whose call failed); a bounded
memory of recently accounted (key_id, request_id) pairs keeps a re-sent batch from counting
twice on this instance (another instance behind a balancer could count a re-send once more:
an over-count of one batch, never an under-count).
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter

from inferplane.api.auth.v1 import usage_pb2, usage_pb2_grpc
from inferplane.auth.limits import RateLimiter
from inferplane.runtime import PermissionDeniedError, UnauthenticatedError

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Context = Any

log = structlog.get_logger("inferplane.auth.usage")

INTERNAL_TOKEN_HEADER = "x-inferplane-internal-token"


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:/p`) is
    this host. Unix sockets count as local; anything unparsable does not."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = rest.rsplit(":", 1)[0]
    elif kind == "ipv6":
        host = rest.rsplit(":", 1)[0].strip("[]")
    else:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class InternalCallerGuard:
    """Admits internal callers: the shared token when one is configured, else loopback peers.

    Raises (from `check`):
        UnauthenticatedError: a token is configured and the call carries none.
        PermissionDeniedError: a wrong token, or (no token configured) a non-loopback peer.
    """

    def __init__(self, token: str = "") -> None:
        self._token = token.encode()

    def check(self, metadata: Mapping[str, str | bytes], peer: str) -> None:
        if self._token:
            presented = metadata.get(INTERNAL_TOKEN_HEADER)
            if not presented:
                raise UnauthenticatedError(
                    f"internal RPC: missing {INTERNAL_TOKEN_HEADER}", code="invalid_internal_token"
                )
            raw = presented if isinstance(presented, bytes) else presented.encode()
            if not hmac.compare_digest(raw, self._token):
                raise PermissionDeniedError(
                    "internal RPC: wrong internal token", code="invalid_internal_token"
                )
            return
        if not is_loopback_peer(peer):
            raise PermissionDeniedError(
                "internal RPC: only loopback callers are accepted when no internal_token is "
                "configured",
                code="internal_only",
            )


class RecentRequests:
    """The last `capacity` accounted (key_id, request_id) pairs, oldest forgotten first."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def __contains__(self, ident: tuple[str, str]) -> bool:
        return ident in self._seen

    def add(self, ident: tuple[str, str]) -> None:
        self._seen[ident] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)


class UsageMetrics:
    """`inferplane_auth_usage_requests_total{outcome}`: reported requests by what happened."""

    OUTCOMES = ("accounted", "duplicate", "invalid")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "inferplane_auth_usage_requests",
            "Finished requests reported by routers: accounted (tokens added, slot released), "
            "duplicate (already accounted: a re-sent batch), invalid (no key_id).",
            ["outcome"],
            registry=registry,
        )
        for outcome in self.OUTCOMES:
            self.requests.labels(outcome)


class UsageService(usage_pb2_grpc.UsageServiceServicer):  # type: ignore[misc]
    """inferplane.auth.v1.UsageService: accounts finished requests against their keys' limits.

    Entries without a key_id are skipped (counted as invalid), not failed: one bad entry must
    not make the sender drop the whole batch. A counter-store outage raises UNAVAILABLE; the
    entries already accounted are remembered, so the sender's re-send counts only the rest.
    """

    def __init__(
        self,
        limiter: RateLimiter,
        guard: InternalCallerGuard,
        metrics: UsageMetrics,
        *,
        recent: RecentRequests | None = None,
    ) -> None:
        self._limiter = limiter
        self._guard = guard
        self._metrics = metrics
        self._recent = recent or RecentRequests()

    async def ReportUsage(
        self, request: usage_pb2.ReportUsageRequest, context: Context
    ) -> usage_pb2.ReportUsageResponse:
        self._guard.check(dict(context.invocation_metadata() or ()), context.peer() or "")
        for usage in request.usage:
            if not usage.key_id:
                self._metrics.requests.labels("invalid").inc()
                continue
            ident = (usage.key_id, usage.request_id)
            if usage.request_id and ident in self._recent:
                self._metrics.requests.labels("duplicate").inc()
                log.debug("usage_duplicate", key_id=usage.key_id, request_id=usage.request_id)
                continue
            tokens = usage.prompt_tokens + usage.completion_tokens
            await self._limiter.record_usage(usage.key_id, usage.request_id, tokens)
            if usage.request_id:
                self._recent.add(ident)
            self._metrics.requests.labels("accounted").inc()
            # One line per accounted request (at debug: an audit trail by request id, which
            # bench/chaos.py matches against what its clients saw across auth restarts).
            log.debug(
                "usage_accounted", key_id=usage.key_id, request_id=usage.request_id, tokens=tokens
            )
        return usage_pb2.ReportUsageResponse()

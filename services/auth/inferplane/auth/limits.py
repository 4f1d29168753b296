"""Per-key limits enforced in ext_authz Check: requests/minute, tokens/minute (and, for a
caller that asks, concurrency leases; Check asks for none: a key's concurrency is the
endpoint picker's).

Check calls `RateLimiter.admit` after the key is verified; the router reports each finished
request's usage (`record_usage`), which accounts its tokens to the key's current window.
Token limits are therefore enforced on the NEXT request: a
key is refused once the tokens accounted in the current window reach its limit, until the
window resets (OpenAI estimates up front from max_tokens; we count what was really used).

Headers follow OpenAI's (https://platform.openai.com/docs/guides/rate-limits):
`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`
and the `-tokens` variants, on allowed responses and on 429s (plus `retry-after` on 429s).
A key with no limit set (0) costs no counter I/O at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from inferplane.auth.counters import KIND_REQUESTS, KIND_TOKENS, AdmitOutcome, CounterStore
from inferplane.auth.domain import Limits
from inferplane.auth.ledger import month_end
from inferplane.runtime.time.clock import Clock
from inferplane.wire.ratelimit import (
    concurrency_message,
    limit_headers,
    quota_message,
    requests_message,
    tokens_message,
)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class RateLimitDecision:
    """Check's verdict on limits.

    Attributes:
        refused: None when allowed, else "requests", "tokens", "concurrency" or "quota" (the
            key's monthly token budget is spent).
        headers: the x-ratelimit-* headers (only for limits the key has).
        retry_after_seconds: whole seconds until a retry can succeed (refusals only).
        message: OpenAI-style explanation (refusals only).
    """

    refused: str | None
    headers: tuple[tuple[str, str], ...] = ()
    retry_after_seconds: int = 0
    message: str = ""


ALLOWED_UNLIMITED = RateLimitDecision(None)


class RateLimiter:
    """Fixed-window counters per key in a `CounterStore` shared by every auth instance.

    `window_seconds` is 60 (limits are "per minute"); `lease_seconds` bounds how long a
    concurrency slot stays taken when its usage report never arrives (the router's request
    timeout is the natural value). `monthly_tokens(key_id, now)` (blocking: the usage
    ledger's `month_tokens`) gives the tokens a key used this calendar month, for keys with a
    `monthly_token_budget`; without it budgets are not enforced.
    """

    def __init__(
        self,
        store: CounterStore,
        clock: Clock,
        *,
        window_seconds: int = 60,
        lease_seconds: float = 600.0,
        monthly_tokens: Callable[[str, datetime], int] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._window = window_seconds
        self._lease = lease_seconds
        self._monthly_tokens = monthly_tokens

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._store.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _now(self) -> tuple[float, int, float]:
        now = self._clock.now().timestamp()
        window = int(now // self._window)
        return now, window, (window + 1) * self._window - now

    async def admit(self, key_id: str, request_id: str, limits: Limits) -> RateLimitDecision:
        """Counts one request of `key_id` if its limits allow it now.

        Raises:
            UnavailableError: the counter store or the ledger is unreachable (the edge
                answers 503).
        """
        if limits.monthly_token_budget and self._monthly_tokens is not None:
            spent = await self._budget_refusal(key_id, limits.monthly_token_budget)
            if spent is not None:
                return spent
        if not (
            limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent_requests
        ):
            return ALLOWED_UNLIMITED
        now, window, reset = self._now()
        outcome = await self._call(
            self._store.try_admit, key_id, request_id, limits, window, now, now + self._lease
        )
        headers = self._headers(limits, outcome, reset)
        if outcome.refused is None:
            return RateLimitDecision(None, headers)
        return RateLimitDecision(
            outcome.refused,
            headers,
            1 if outcome.refused == "concurrency" else max(1, math.ceil(reset)),
            self._message(limits, outcome, reset),
        )

    async def _budget_refusal(self, key_id: str, budget: int) -> RateLimitDecision | None:
        """The refusal of a key whose month's tokens reached `budget`, else None. Checked
        before the counters so a refused request takes no slot and counts no request."""
        assert self._monthly_tokens is not None
        now = self._clock.now()
        used = await asyncio.to_thread(self._monthly_tokens, key_id, now)
        if used < budget:
            return None
        reset = month_end(now)
        return RateLimitDecision(
            "quota",
            (),
            max(1, math.ceil((reset - now).total_seconds())),
            quota_message(budget, used, reset.strftime("%Y-%m-%dT%H:%M:%SZ")),
        )

    async def record_usage(self, key_id: str, total_tokens: int) -> None:
        """A request of `key_id` ended having used `total_tokens`: account them to the current
        window (nothing for 0).

        Raises:
            UnavailableError: the counter store is unreachable.
        """
        if total_tokens > 0:
            _, window, _ = self._now()
            await self._call(self._store.add_tokens, key_id, window, total_tokens)

    async def purge(self) -> None:
        """Drops windows older than the previous one and expired leases."""
        now, window, _ = self._now()
        await self._call(self._store.purge, window - 1, now)

    @staticmethod
    def _headers(
        limits: Limits, outcome: AdmitOutcome, reset: float
    ) -> tuple[tuple[str, str], ...]:
        out: tuple[tuple[str, str], ...] = ()
        if limits.requests_per_minute:
            rpm = limits.requests_per_minute
            out += limit_headers(KIND_REQUESTS, rpm, rpm - outcome.requests, reset)
        if limits.tokens_per_minute:
            tpm = limits.tokens_per_minute
            out += limit_headers(KIND_TOKENS, tpm, tpm - outcome.tokens, reset)
        return out

    @staticmethod
    def _message(limits: Limits, outcome: AdmitOutcome, reset: float) -> str:
        if outcome.refused == KIND_REQUESTS:
            return requests_message(limits.requests_per_minute, outcome.requests, reset)
        if outcome.refused == KIND_TOKENS:
            return tokens_message(limits.tokens_per_minute, outcome.tokens, reset)
        return concurrency_message(limits.max_concurrent_requests)

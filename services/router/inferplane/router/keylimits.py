"""Per-key limits, enforced by the endpoint picker in its first exchange (no call to auth per
request): requests and tokens per minute, concurrent requests, and the monthly token budget
of each API key (`keys.KeyLimits`, from auth's key table).

Windows are fixed, `window_seconds` long (60) and aligned on the wall clock's epoch like auth's
(`inferplane.auth.limits`): window = floor(epoch seconds / 60). A request counts against the
window it was admitted in; its tokens (prompt + completion) count when they are known
(`KeyLease.account`, from the summary trailers or the replica's report), into the window
current then, so a key is refused once its window's tokens reach the limit, until the window
resets (OpenAI estimates up front; we count what was used).

**Shared across routers.** Each router enforces its share of each limit: with N routers
holding a lease on the orchestrator's table and this one of rank r (`set_routers`, from the
routing table: `RouteTable.router_count` / `router_rank`), the share of a limit L is
floor(L / N) + (1 if r < L mod N else 0), at least 1 (`share`). Without an orchestrator
(a static routes file, `--no-shared-caps`) N = 1: the whole limit. The bounds (tested in
services/router/tests/test_keylimits.py; services/router/README.md, "Per-key limits"):

- requests per minute and concurrent requests: the routers together admit at most
  Σ shares = max(L, N) per window and in flight (L when L >= N; a key whose limit is below
  the number of routers gets 1 on every router instead of 0, so no router locks it out).
  While routers join or leave (the re-split), a window or a set of requests in flight
  admitted under the old shares keeps them: each router admits at most the largest share it
  had in that window, so the sum is at most Σ of each router's largest share over the change
  (L + the joining router's share, for one join).
- tokens per minute: counted after the fact, so a router's window may exceed its share by
  the tokens of the requests it admitted before its count reached the share and accounted in
  that window (at most the tokens of its requests in flight then, plus the one that crossed).
- monthly budget (not split): refused when auth's entry says `budget_exhausted`, or when the
  entry's `month_tokens` plus the tokens this router accounted since that entry arrived reach
  the budget. So a key can overshoot by the tokens used meanwhile on the other routers, plus
  the tokens this router accounted but auth's entry did not include yet: bounded by the key
  table's refresh and the usage delivery delay.

A key with no limit costs nothing: `admit` returns one shared lease without allocating.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Final

from inferplane.router.keys import KeyLimits, Principal
from inferplane.router.routes import RouteTable
from inferplane.runtime import ResourceExhaustedError
from inferplane.runtime.time.clock import Clock
from inferplane.wire.ratelimit import (
    REQUESTS,
    TOKENS,
    Headers,
    concurrency_message,
    limit_headers,
    quota_message,
    requests_message,
    tokens_message,
)

WINDOW_SECONDS: Final = 60
RATE_LIMIT_EXCEEDED: Final = "rate_limit_exceeded"
INSUFFICIENT_QUOTA: Final = "insufficient_quota"


class RequestsLimitError(ResourceExhaustedError):
    """Over requests per minute or concurrent requests: 429 `rate_limit_exceeded`, OpenAI's
    type `requests`."""

    openai_type = REQUESTS


class TokensLimitError(ResourceExhaustedError):
    """Over tokens per minute: 429 `rate_limit_exceeded`, OpenAI's type `tokens`."""

    openai_type = TOKENS


class QuotaError(ResourceExhaustedError):
    """The monthly token budget is spent: 429 `insufficient_quota` (OpenAI's type and code)."""

    openai_type = INSUFFICIENT_QUOTA


def share(limit: int, count: int, rank: int) -> int:
    """This router's part of `limit` when `count` routers split it and it has `rank`
    (0-based): floor(limit / count) + 1 for ranks below limit mod count, at least 1; the
    whole limit when count <= 1; 0 (unlimited) when limit is 0."""
    if limit <= 0 or count <= 1:
        return limit
    base, extra = divmod(limit, count)
    return max(1, base + (1 if rank < extra else 0))


def _month_start_after(now: datetime) -> datetime:
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return datetime(year, month, 1, tzinfo=UTC)


class _KeyState:
    """One key's counters on this router."""

    __slots__ = (
        "basis",
        "in_flight",
        "key_id",
        "month",
        "month_tokens",
        "requests",
        "tokens",
        "window",
    )

    def __init__(self, key_id: str) -> None:
        self.key_id = key_id
        self.window = -1
        self.requests = 0  # admitted in `window`
        self.tokens = 0  # accounted in `window`
        self.in_flight = 0  # admitted, not released (the concurrency count)
        self.basis: Principal | None = None  # the entry whose month_tokens `month_tokens` adds to
        self.month = -1  # year * 12 + month of `month_tokens`
        self.month_tokens = 0  # accounted since `basis` arrived, this month


class KeyLease:
    """One admitted request's part of its key's limits.

    Attributes:
        headers: OpenAI's x-ratelimit-* headers for the allowed response (only for the
            limits the key has; `limit` is the key's, `remaining` what this router still
            admits in the window).
    """

    __slots__ = ("_limiter", "_released", "_state", "headers")

    def __init__(
        self, limiter: KeyLimiter | None, state: _KeyState | None, headers: Headers
    ) -> None:
        self._limiter = limiter
        self._state = state
        self._released = False
        self.headers = headers

    def release(self) -> None:
        """Frees the request's concurrency slot (the request ended). Idempotent."""
        if self._released:
            return
        self._released = True
        if self._state is not None:
            self._state.in_flight -= 1

    def account(self, tokens: int) -> None:
        """Counts the request's `tokens` (prompt + completion) into the key's current window
        and its month; before or after `release`. Tokens <= 0 count nothing."""
        if tokens > 0 and self._limiter is not None and self._state is not None:
            self._limiter._account(self._state, tokens)


UNLIMITED: Final = KeyLease(None, None, ())
"""The lease of every request whose key has no limit (shared; release and account do nothing)."""


class KeyLimiter:
    """Per-key counters of this router (one event loop; no I/O).

    Args:
        clock: wall time (`time()`, `now()`) for the windows and the month.
        window_seconds: the rate windows' length (60: limits are per minute).
    """

    def __init__(self, clock: Clock, *, window_seconds: int = WINDOW_SECONDS) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self._clock = clock
        self._window = window_seconds
        self._states: dict[str, _KeyState] = {}
        self._count = 1
        self._rank = 0
        self._window_seen = -1

    def set_routers(self, count: int, rank: int) -> None:
        """How many routers split the limits (`count` <= 1 or 0: this one alone, the whole
        limit) and this router's `rank` among them; counts already made in the current window
        stay."""
        self._count = max(1, count)
        self._rank = rank if 0 <= rank < self._count else 0

    def on_table(self, table: RouteTable) -> None:
        """Takes the split from each new routing table (a route source's listener)."""
        self.set_routers(table.router_count, table.router_rank)

    @property
    def routers(self) -> tuple[int, int]:
        """(count, rank) this router splits the limits by."""
        return self._count, self._rank

    def shares(self, limits: KeyLimits) -> KeyLimits:
        """This router's shares of `limits` (the monthly budget is not split)."""
        n, r = self._count, self._rank
        return KeyLimits(
            share(limits.requests_per_minute, n, r),
            share(limits.tokens_per_minute, n, r),
            share(limits.max_concurrent_requests, n, r),
            limits.monthly_token_budget,
        )

    def admit(self, principal: Principal, request_id: str = "") -> KeyLease:
        """Counts one request of `principal`'s key if its limits (this router's shares) allow
        it now; release the lease exactly once when the request ends.

        `request_id` names the request in nothing but errors' metadata (the lease is the
        request's handle).

        Raises:
            QuotaError: the monthly budget is spent (429 `insufficient_quota`, retry after
                the budget resets).
            RequestsLimitError: requests per minute (retry at the window's end) or concurrent
                requests (retry after 1 s) at this router's share (429 `rate_limit_exceeded`).
            TokensLimitError: the window's tokens reached this router's share.
            Each carries `retry_after_seconds` and the x-ratelimit-* `headers`.
        """
        limits = principal.limits
        rpm, tpm, conc = (
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrent_requests,
        )
        if not (rpm or tpm or conc or limits.monthly_token_budget):
            return UNLIMITED
        now = self._clock.time()
        window = int(now // self._window)
        if window != self._window_seen:  # once per window: forget idle keys
            self._window_seen = window
            self.purge()
        state = self._states.get(principal.key_id)
        if state is None:
            state = self._states[principal.key_id] = _KeyState(principal.key_id)
        if state.window != window:
            state.window, state.requests, state.tokens = window, 0, 0
        if limits.monthly_token_budget:
            self._check_budget(principal, state, request_id)
        reset = (window + 1) * self._window - now
        n, r = self._count, self._rank
        rpm_share, tpm_share = share(rpm, n, r), share(tpm, n, r)
        if rpm and state.requests >= rpm_share:
            raise RequestsLimitError(
                requests_message(rpm, state.requests, reset),
                code=RATE_LIMIT_EXCEEDED,
                retry_after_seconds=max(1, math.ceil(reset)),
                headers=self._headers(limits, state, rpm_share, tpm_share, reset),
                metadata={"request_id": request_id} if request_id else None,
            )
        if tpm and state.tokens >= tpm_share:
            raise TokensLimitError(
                tokens_message(tpm, state.tokens, reset),
                code=RATE_LIMIT_EXCEEDED,
                retry_after_seconds=max(1, math.ceil(reset)),
                headers=self._headers(limits, state, rpm_share, tpm_share, reset),
                metadata={"request_id": request_id} if request_id else None,
            )
        if conc and state.in_flight >= share(conc, n, r):
            raise RequestsLimitError(
                concurrency_message(conc),
                code=RATE_LIMIT_EXCEEDED,
                retry_after_seconds=1,
                headers=self._headers(limits, state, rpm_share, tpm_share, reset),
                metadata={"request_id": request_id} if request_id else None,
            )
        if rpm:
            state.requests += 1
        state.in_flight += 1
        headers = self._headers(limits, state, rpm_share, tpm_share, reset) if rpm or tpm else ()
        return KeyLease(self, state, headers)

    def _check_budget(self, principal: Principal, state: _KeyState, request_id: str) -> None:
        budget = principal.limits.monthly_token_budget
        now = self._clock.now()
        month = now.year * 12 + now.month
        if state.month != month:
            state.month, state.month_tokens = month, 0
        if state.basis is not principal:  # a new entry: its month_tokens include ours so far
            state.basis, state.month_tokens = principal, 0
        past = principal.budget_resets is not None and now >= principal.budget_resets
        base = 0 if past else principal.month_tokens  # an entry of a month that has ended
        used = base + state.month_tokens
        if not (principal.budget_exhausted and not past) and used < budget:
            return
        resets = principal.budget_resets if not past and principal.budget_resets else None
        resets = resets or _month_start_after(now)
        raise QuotaError(
            quota_message(budget, used, resets.strftime("%Y-%m-%dT%H:%M:%SZ")),
            code=INSUFFICIENT_QUOTA,
            retry_after_seconds=max(1, math.ceil((resets - now).total_seconds())),
            metadata={"request_id": request_id} if request_id else None,
        )

    def _account(self, state: _KeyState, tokens: int) -> None:
        current = self._states.get(state.key_id)
        if current is None:  # purged after its release: counted again
            self._states[state.key_id] = state
        elif current is not state:
            state = current
        now = self._clock.time()
        window = int(now // self._window)
        if state.window != window:
            state.window, state.requests, state.tokens = window, 0, 0
        state.tokens += tokens
        if state.basis is not None:
            wall = self._clock.now()
            month = wall.year * 12 + wall.month
            if state.month != month:
                state.month, state.month_tokens = month, 0
            state.month_tokens += tokens

    @staticmethod
    def _headers(
        limits: KeyLimits, state: _KeyState, rpm_share: int, tpm_share: int, reset: float
    ) -> Headers:
        out: Headers = ()
        if limits.requests_per_minute:
            out += limit_headers(
                REQUESTS, limits.requests_per_minute, rpm_share - state.requests, reset
            )
        if limits.tokens_per_minute:
            out += limit_headers(TOKENS, limits.tokens_per_minute, tpm_share - state.tokens, reset)
        return out

    def in_flight(self, key_id: str) -> int:
        """Requests of `key_id` this router has admitted and not released (tests, metrics)."""
        state = self._states.get(key_id)
        return 0 if state is None else state.in_flight

    def purge(self) -> None:
        """Forgets keys with nothing in flight, no count in the current window and no
        month's tokens (bounds memory to the keys in use; call it now and then)."""
        window = int(self._clock.time() // self._window)
        self._states = {
            k: s
            for k, s in self._states.items()
            if s.in_flight or s.window == window or s.month_tokens
        }

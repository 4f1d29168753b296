"""OpenAI's rate-limit headers (https://platform.openai.com/docs/guides/rate-limits), defined
once for auth's ext_authz limiter and the endpoint picker's per-key limiter
(`inferplane.router.keylimits`), and the prefix the edge lets the picker set on a response.

`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`
and the `-tokens` variants, on allowed responses and on 429s (which add `retry-after`), only
for the limits a key has. Reset durations are OpenAI's: `1s`, `6m0s`, `250ms`.
"""

from __future__ import annotations

import math
from typing import Final

PREFIX: Final = "x-ratelimit-"
"""Every rate-limit header starts with it (the edge's ext_proc mutation rules allow it)."""
RETRY_AFTER: Final = "retry-after"
"""Seconds until a refused request may succeed (429 only)."""
REQUESTS: Final = "requests"
TOKENS: Final = "tokens"

Headers = tuple[tuple[str, str], ...]


def format_reset(seconds: float) -> str:
    """OpenAI's reset duration: `1s`, `6m0s`, `250ms` (whole seconds rounded up; under one
    second, milliseconds; negative → `0ms`)."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def limit_headers(kind: str, limit: int, remaining: int, reset_seconds: float) -> Headers:
    """The three headers of one limit `kind` (`REQUESTS` or `TOKENS`): its `limit`, what
    `remaining` (clamped at 0) and when the window resets (`reset_seconds` from now)."""
    return (
        (f"{PREFIX}limit-{kind}", str(limit)),
        (f"{PREFIX}remaining-{kind}", str(max(0, remaining))),
        (f"{PREFIX}reset-{kind}", format_reset(reset_seconds)),
    )


def requests_message(limit: int, used: int, reset_seconds: float) -> str:
    """OpenAI's sentence for a key over its requests per minute."""
    return (
        f"Rate limit reached for requests per min (RPM): Limit {limit}, Used {used}, "
        f"Requested 1. Please try again in {format_reset(reset_seconds)}."
    )


def tokens_message(limit: int, used: int, reset_seconds: float) -> str:
    """OpenAI's sentence for a key over its tokens per minute."""
    return (
        f"Rate limit reached for tokens per min (TPM): Limit {limit}, Used {used}. "
        f"Please try again in {format_reset(reset_seconds)}."
    )


def concurrency_message(limit: int) -> str:
    """The sentence for a key at its concurrent requests."""
    return (
        f"Too many concurrent requests for this API key: Limit {limit}. Please retry when a "
        "request finishes."
    )


def quota_message(budget: int, used: int, resets: str) -> str:
    """OpenAI's `insufficient_quota` sentence for a key whose monthly token budget is spent
    (`resets`: when, ISO 8601 UTC)."""
    return (
        f"You exceeded your current quota: this API key's monthly token budget is {budget} "
        f"tokens and {used} were used this month; it resets at {resets}."
    )

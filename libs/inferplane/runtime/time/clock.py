"""`Clock`: the one time source every inferplane component is given (never read directly).

Composition roots pass `SystemClock()`; tests pass `inferplane.testing.clock.FakeClock`, which
moves only when told to, so no test sleeps to make time pass.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    """Time as a component sees it."""

    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch (timestamps on records, `created`)."""
        ...

    def now(self) -> datetime:
        """Wall-clock time, timezone-aware UTC (stored timestamps, expiries)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a monotonic clock (latencies, timeouts, TTLs); only differences mean
        anything."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Waits `seconds` (backoff, periodic loops)."""
        ...


class SystemClock:
    """The real clock."""

    def time(self) -> float:
        return time.time()

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

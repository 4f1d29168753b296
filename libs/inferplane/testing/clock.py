"""`FakeClock`: an `inferplane.runtime.time.clock.Clock` that moves only when told to."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
"""Where a `FakeClock` starts by default (wall time)."""


class FakeClock:
    """Wall and monotonic time that move together on `advance`; `sleep` advances them by the
    time asked for and yields to the event loop once (so a loop under test runs its next
    iteration at once instead of waiting)."""

    def __init__(self, start: datetime = EPOCH, monotonic_start: float = 1000.0) -> None:
        self._now = start
        self._mono = monotonic_start
        self.slept: list[float] = []

    def time(self) -> float:
        return self._now.timestamp()

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        """Moves wall and monotonic time forward by `seconds`."""
        self._now += timedelta(seconds=seconds)
        self._mono += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)

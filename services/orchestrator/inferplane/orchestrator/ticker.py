"""`Ticker`: the control loops' shared shape (the reconcile loop, the autoscaler).

A loop runs its tick, then waits `interval_seconds` or until woken, whichever comes first; a
tick that raises is logged (`failure_event`) and the next one runs as usual. `wake` may be
called from any thread (gRPC handlers run in threads); `event` is the same wake-up for code on
the loop's own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


class Ticker:
    """Runs `tick` every `interval_seconds`, or sooner when woken.

    Args:
        tick: one pass of the loop.
        interval_seconds: the longest wait between two ticks.
        failure_event: the log event of a tick that raised.
        logger: a structlog logger.
    """

    def __init__(
        self,
        tick: Callable[[], Awaitable[None]],
        interval_seconds: float,
        failure_event: str,
        logger: Any,
    ) -> None:
        self._tick = tick
        self._interval = interval_seconds
        self._failure_event = failure_event
        self._log = logger
        self.event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        """Ticks until cancelled; a failing tick is logged and retried on the next one."""
        self._loop = asyncio.get_running_loop()
        while True:
            self.event.clear()
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._log.exception(self._failure_event)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), self._interval)

    def wake(self) -> None:
        """Asks for a tick soon (thread-safe); nothing before `run` started or after its loop
        closed."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.event.set)

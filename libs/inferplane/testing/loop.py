"""`LoopThread`: an asyncio event loop in a daemon thread, for synchronous tests and benches
that drive asynchronous servers (`run` executes a coroutine there and waits for it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """One event loop running in its own daemon thread until `close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Runs `coro` on the loop; returns its result or raises its exception.

        Raises: TimeoutError when it takes longer than `timeout` seconds.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 10.0) -> T:
        """Calls the plain function `fn(*args)` on the loop's thread (for objects that must
        only be touched from there); returns its result."""

        async def _call() -> T:
            return fn(*args)

        return self.run(_call(), timeout)

    def close(self) -> None:
        """Stops the loop and joins its thread (at most 5 s)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

"""A circuit breaker per replica: stop sending work to a replica that keeps failing.

States (Nygard, "Release It!", ch. 5): CLOSED lets every request through and counts
consecutive transport failures; after `failure_threshold` of them it OPENS for `open_seconds`
(doubling on every failed probe, up to `max_open_seconds`); then it is HALF_OPEN and lets
exactly ONE probe request through: success closes it, failure opens it again. Only transport
failures count (unreachable or refusing replica), never a client's bad request.
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """One replica's breaker; every method takes `now` (monotonic seconds) from the caller."""

    __slots__ = (
        "_current_open",
        "_failure_threshold",
        "_failures",
        "_max_open_seconds",
        "_open_seconds",
        "_open_until",
        "_probing",
        "_state",
    )

    def __init__(
        self,
        failure_threshold: int = 5,
        open_seconds: float = 5.0,
        max_open_seconds: float = 60.0,
    ) -> None:
        self._failure_threshold = max(1, failure_threshold)
        self._open_seconds = open_seconds
        self._max_open_seconds = max(open_seconds, max_open_seconds)
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._open_until = 0.0
        self._current_open = open_seconds
        self._probing = False

    @property
    def open_until(self) -> float:
        """When an OPEN breaker turns HALF_OPEN (monotonic seconds); 0 when not open."""
        return self._open_until if self._state is BreakerState.OPEN else 0.0

    def peek(self, now: float) -> BreakerState:
        """The state at `now` without changing anything (safe from a metrics thread)."""
        if self._state is BreakerState.OPEN and now >= self._open_until:
            return BreakerState.HALF_OPEN
        return self._state

    def state(self, now: float) -> BreakerState:
        """The state at `now` (an OPEN breaker past its timeout reads HALF_OPEN)."""
        if self._state is BreakerState.OPEN and now >= self._open_until:
            self._state = BreakerState.HALF_OPEN
            self._probing = False
        return self._state

    def available(self, now: float) -> bool:
        """Whether a new request may go to the replica now (without taking the probe)."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._probing

    def on_start(self, now: float) -> None:
        """A request was sent: in HALF_OPEN it is the probe, and no other goes until it ends."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probing = True

    def on_success(self) -> None:
        """The replica answered (its first chunk, or a whole unary response)."""
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._current_open = self._open_seconds
        self._probing = False

    def on_failure(self, now: float) -> None:
        """The replica was unreachable or refused before answering."""
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN:
            self._current_open = min(self._current_open * 2, self._max_open_seconds)
            self._trip(now)
        elif self._state is BreakerState.CLOSED and self._failures >= self._failure_threshold:
            self._trip(now)

    def on_abandon(self) -> None:
        """The request ended without a verdict on the replica (client cancel, queue timeout)."""
        self._probing = False

    def _trip(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._open_until = now + self._current_open
        self._probing = False

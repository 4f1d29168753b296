"""The admission grant and its knobs: `Slot` (one request's unit of one replica's concurrency
cap, held until the request ends), `AdmissionSettings`, and the `Scheduler` admission's
timers run on (the event loop's `call_later`; tests inject a fake one). `admission.Admission`
hands slots out; a slot calls its owner back when released.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Protocol

from inferplane.router.kvfit import Reservation
from inferplane.router.replicas import ReplicaKey, ReplicaState
from inferplane.router.routes import Endpoint
from inferplane.runtime.time.clock import Clock


class SlotOwner(Protocol):
    """What a `Slot` needs of the admission that granted it."""

    @property
    def clock(self) -> Clock: ...

    def slot_freed(self, state: ReplicaState) -> None: ...


class Cancellable(Protocol):
    def cancel(self) -> object: ...


class Scheduler(Protocol):
    """Runs a callback later (the event loop's `call_later`; tests use a fake one)."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopScheduler:
    """`Scheduler` on the running event loop."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback)


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """Knobs of admission (see `RouterSettings` for their meaning and defaults)."""

    default_max_concurrency: int = 64
    queue_timeout_seconds: float = 5.0
    max_queue_per_deployment: int = 1024
    retry_after_seconds: float = 1.0
    breaker_failures: int = 5
    breaker_open_seconds: float = 5.0
    cold_start_retry_after_seconds: float = 10.0
    max_cold_start_budget_seconds: float = 175.0


class Slot:
    """An admission grant: one request's slot on one replica (one unit of its concurrency
    cap), held until the request ends, with no time bound (unlike the cap-share lease of
    `set_lease`). Call `first_chunk` when the replica answered and `release` exactly once at
    the end (with `failed` before it for transport failures)."""

    __slots__ = ("_controller", "_done", "_kv", "_state", "_tokens", "_verdict", "endpoint")

    def __init__(
        self,
        endpoint: Endpoint,
        state: ReplicaState,
        tokens: int,
        controller: SlotOwner,
        kv: Reservation | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._kv = kv  # its KV reservation (`kvfit`), released with the slot
        self._state = state
        self._tokens = tokens
        self._controller = controller
        self._done = False
        self._verdict = False

    @property
    def key(self) -> ReplicaKey:
        return self._state.key

    def first_chunk(self) -> None:
        """The replica answered: its prefill is done and it is healthy."""
        if self._tokens:
            self._state.queued_tokens -= self._tokens
            self._tokens = 0
        if not self._verdict:
            self._verdict = True
            self._state.breaker.on_success()
        self._state.changed(self._controller.clock.monotonic())

    def failed(self) -> None:
        """The replica was unreachable or refused before answering (counts for its breaker)."""
        if not self._verdict:
            self._verdict = True
            self._state.breaker.on_failure(self._controller.clock.monotonic())

    def release(self) -> None:
        """Frees the slot (idempotent) and lets the queue move."""
        if self._done:
            return
        self._done = True
        if self._kv is not None:
            self._kv.release()
        state = self._state
        state.in_flight -= 1
        state.queued_tokens -= self._tokens
        self._tokens = 0
        if not self._verdict:
            state.breaker.on_abandon()
        state.changed(self._controller.clock.monotonic())
        self._controller.slot_freed(state)

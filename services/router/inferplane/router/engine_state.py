"""What the router knows of each replica's engine, from the replica's state stream (issue 29).

`replica_watch.py` follows every replica's `ReplicaProcessService.WatchReplicaState` and keeps
one `EngineState` per replica id here; the rest of the router only reads it:

- KV-fit admission (`admission.py`): `block_size`, `total_kv_blocks`, `free_kv_blocks`;
- the autoscaler's demand (`leases.py`): `waiting_requests`, `kv_usage`;
- adapter affinity (policies): `loaded_adapters`;
- the precise prefix policy: `kv_events` (else it falls back to the approximate table).

A state older than `stale_after_seconds` (the stream stopped: the replica is gone, restarting
or unreachable) counts as unknown: `EngineStates.get` returns None, and every reader then
behaves as before this stream existed (slots only, approximate prefixes). No I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator


@dataclasses.dataclass(slots=True)
class EngineState:
    """One replica's last reported engine state (fields as `WatchReplicaStateResponse`'s).

    `received` is the router's monotonic time of the last update (heartbeats included).
    """

    replica_id: str
    block_size: int = 0
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    in_flight_requests: int = 0
    loaded_adapters: frozenset[str] = frozenset()
    kv_events: bool = False
    preemptions_total: int = 0
    draining: bool = False
    received: float = 0.0

    @property
    def kv_usage(self) -> float:
        """Share of KV blocks held by running requests, 0..1 (0 when capacity is unknown)."""
        if self.total_kv_blocks <= 0:
            return 0.0
        return 1.0 - self.free_kv_blocks / self.total_kv_blocks


class EngineStates:
    """Replica id → `EngineState`, written by the state watch, read by the decision path.

    Args:
        clock: monotonic seconds (injected in tests).
        stale_after_seconds: a state not refreshed for this long reads as unknown (the replica
            sends a heartbeat at least every second).
    """

    def __init__(self, clock: Callable[[], float], stale_after_seconds: float = 3.0) -> None:
        self._clock = clock
        self._stale = stale_after_seconds
        self._states: dict[str, EngineState] = {}
        self._listeners: list[Callable[[str], None]] = []
        # LoRA adapter → replica ids whose last state lists it loaded (adapter affinity reads
        # it; kept in step by `put` and `drop`: O(adapters loaded) each, at most max_loras).
        self._holders: dict[str, set[str]] = {}

    def subscribe(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(replica_id)` after every `put` (KV-fit admission re-examines the
        requests waiting for KV room: `Admission.engine_changed`)."""
        self._listeners.append(listener)

    def put(self, state: EngineState) -> None:
        """Stores `state` (stamped now) as the replica's current one, then tells the
        listeners."""
        state.received = self._clock()
        old = self._states.get(state.replica_id)
        self._states[state.replica_id] = state
        before = old.loaded_adapters if old is not None else frozenset()
        if before != state.loaded_adapters:
            self._rehold(state.replica_id, before, state.loaded_adapters)
        for listener in self._listeners:
            listener(state.replica_id)

    def drop(self, replica_id: str) -> None:
        """Forgets a replica (it left the routing table, or its stream ended)."""
        old = self._states.pop(replica_id, None)
        if old is not None and old.loaded_adapters:
            self._rehold(replica_id, old.loaded_adapters, frozenset())

    def holders(self, adapter: str) -> frozenset[str]:
        """Replica ids whose last state lists `adapter` loaded (fresh or not: a reader checks
        `get`)."""
        return frozenset(self._holders.get(adapter, ()))

    def _rehold(self, replica_id: str, before: frozenset[str], after: frozenset[str]) -> None:
        for adapter in before - after:
            ids = self._holders.get(adapter)
            if ids is not None:
                ids.discard(replica_id)
                if not ids:
                    del self._holders[adapter]
        for adapter in after - before:
            self._holders.setdefault(adapter, set()).add(replica_id)

    def get(self, replica_id: str) -> EngineState | None:
        """The replica's fresh state, or None when unknown or stale."""
        state = self._states.get(replica_id)
        if state is None or self._clock() - state.received > self._stale:
            return None
        return state

    def fresh(self) -> Iterator[EngineState]:
        """Every fresh state."""
        now = self._clock()
        return (s for s in self._states.values() if now - s.received <= self._stale)

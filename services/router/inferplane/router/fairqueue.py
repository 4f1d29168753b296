"""A weighted fair queue of admission waiters across flows (one flow per API key), with a cap
per flow on its share of the queue.

Order: start-time fair queuing (SFQ; Goyal, Vin and Cheng, "Start-time Fair Queueing",
SIGCOMM 1996) over flows, one unit of cost per request. The head of a flow gets a start tag
`S = max(V, F)` (V: the start tag of the last request granted, F: the finish tag of the flow's
last granted request) and a finish tag `S + 1/weight`; the flow whose head has the smallest
(start, finish) is served next, so at equal start the heavier flow goes first. Over any
interval in which flows f and g both wait, their grants divided by their weights differ by at
most `1/w_f + 1/w_g`, whatever either offers; a flow that was not waiting starts at V, so its
request is granted after at most one request of each other waiting flow. The cost is O(log n)
per push and per grant in the number of waiting flows (a heap of flows, FIFO inside a flow);
a cancelled or timed-out waiter leaves at once in O(1) and costs its flow nothing. Memory:
the waiting flows, plus the flows granted since the virtual time last passed their finish
tag; all of it is forgotten whenever the queue empties (the end of SFQ's busy period).

Caps: dynamic thresholds (Choudhury and Hahne, "Dynamic queue length thresholds for
shared-memory packet switches", IEEE/ACM ToN 1998) with alpha = 1, weighted: a flow may add a
waiter while it holds fewer than `weight x (capacity - queued)`. A flow alone fills at most
about `w / (1 + w)` of the queue (half for weight 1), so some room is always left for a flow that
is not waiting yet: a newcomer is refused only when the whole queue is full, and the flow over
its share gets the refusal instead of pushing others out.

Not thread-safe: the router's event loop owns it (`len` and `flows` are plain ints that the
metrics thread may read).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Refusal(enum.Enum):
    """Why a waiter may not join the queue (the label of the refusal metric)."""

    QUEUE_FULL = "queue_full"
    FLOW_SHARE = "flow_share"


class _Flow(Generic[T]):
    __slots__ = ("cost", "finish", "key", "queued", "waiters")

    def __init__(self, key: tuple[Hashable, float], weight: float) -> None:
        self.key = key
        self.cost = 1.0 / weight
        self.finish = -math.inf  # finish tag of its last granted request
        self.queued = False  # has an entry in the active heap
        self.waiters: OrderedDict[int, T] = OrderedDict()


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket(Generic[T]):
    """A waiter's place in the queue, for `FairQueue.discard`."""

    flow: _Flow[T]
    seq: int


class FairQueue(Generic[T]):
    """Waiters of one deployment, served by weighted fair share across flows.

    A flow is `(flow, weight)`: requests without a key share the flow "" of their weight.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self.flows = 0  # flows with at least one waiter
        self._len = 0
        self._vtime = 0.0
        self._max_finish = 0.0  # largest finish tag granted: V once the queue empties
        self._seq = itertools.count()
        self._by_key: dict[tuple[Hashable, float], _Flow[T]] = {}
        # (start, finish, seq, flow) of each flow that has or just had waiters; an entry whose
        # flow emptied by cancellations stays until it reaches the top (its tags stay right).
        self._active: list[tuple[float, float, int, _Flow[T]]] = []
        # (finish, seq, flow) of flows without waiters whose finish tag is still ahead of V:
        # forgotten once V passes it, so memory follows the waiting flows, not every key seen.
        self._idle: list[tuple[float, int, _Flow[T]]] = []

    def __len__(self) -> int:
        return self._len

    @property
    def tracked_flows(self) -> int:
        """Flows the queue remembers: those waiting, plus idle ones whose last finish tag is
        still ahead of the virtual time (memory follows the waiting keys, not every key)."""
        return len(self._by_key)

    def refusal(self, flow: Hashable, weight: float) -> Refusal | None:
        """Why a new waiter of `flow` (with `weight` > 0) would be refused now, else None."""
        if self._len >= self.capacity:
            return Refusal.QUEUE_FULL
        f = self._by_key.get((flow, weight))
        held = len(f.waiters) if f is not None else 0
        if held >= weight * (self.capacity - self._len):
            return Refusal.FLOW_SHARE
        return None

    def push(self, flow: Hashable, weight: float, item: T) -> Ticket[T]:
        """Queues `item` at the end of its flow (callers check `refusal` first)."""
        key = (flow, weight)
        f = self._by_key.get(key)
        if f is None:
            f = self._by_key[key] = _Flow(key, weight)
        if not f.queued:
            start = max(self._vtime, f.finish)
            heapq.heappush(self._active, (start, start + f.cost, next(self._seq), f))
            f.queued = True
        if not f.waiters:
            self.flows += 1
        seq = next(self._seq)
        f.waiters[seq] = item
        self._len += 1
        return Ticket(f, seq)

    def head(self) -> T | None:
        """The waiter fair share serves next (not removed), or None when empty."""
        active = self._active
        while active:
            f = active[0][3]
            if f.waiters:
                return next(iter(f.waiters.values()))
            heapq.heappop(active)
            f.queued = False
            self._retire(f)
        return None

    def pop(self) -> T:
        """Removes and returns `head()`, charging its flow one request.

        Raises:
            IndexError: the queue is empty.
        """
        if self.head() is None:
            raise IndexError("pop from an empty FairQueue")
        start, finish, _, f = self._active[0]
        _, item = f.waiters.popitem(last=False)
        self._len -= 1
        self._vtime = start
        self._max_finish = max(self._max_finish, finish)
        f.finish = finish
        if f.waiters:
            heapq.heapreplace(self._active, (finish, finish + f.cost, next(self._seq), f))
        else:
            self.flows -= 1
            heapq.heappop(self._active)
            f.queued = False
            self._retire(f)
        idle = self._idle
        while idle and idle[0][0] <= self._vtime:
            _, _, g = heapq.heappop(idle)
            if not g.queued and g.finish <= self._vtime and self._by_key.get(g.key) is g:
                del self._by_key[g.key]
        if not self._len:
            self._end_busy_period()
        return item

    def drop(self) -> T:
        """Removes and returns `head()` without charging its flow (it left without a grant).

        Raises:
            IndexError: the queue is empty.
        """
        if self.head() is None:
            raise IndexError("drop from an empty FairQueue")
        f = self._active[0][3]
        _, item = f.waiters.popitem(last=False)
        self._len -= 1
        if not f.waiters:
            self.flows -= 1
        if not self._len:
            self._end_busy_period()
        return item

    def discard(self, ticket: Ticket[T]) -> bool:
        """Removes a waiter that is leaving without a grant (cancelled, timed out); False when
        it had already left. O(1); its flow is not charged."""
        f = ticket.flow
        if f.waiters.pop(ticket.seq, None) is None:
            return False
        self._len -= 1
        if not f.waiters:
            self.flows -= 1
        if not self._len:
            self._end_busy_period()
        return True

    def drain(self) -> list[T]:
        """Removes and returns every waiter (the deployment left the routing table)."""
        items: list[T] = []
        for f in self._by_key.values():
            items.extend(f.waiters.values())
            f.waiters.clear()  # tickets still held elsewhere now discard nothing
        self._len = self.flows = 0
        self._end_busy_period()
        return items

    def _end_busy_period(self) -> None:
        # Nobody waits: as SFQ does at the end of a busy period, V jumps to the largest finish
        # tag granted, so every flow starts afresh at V and none needs remembering.
        self._vtime = max(self._vtime, self._max_finish)
        self._by_key.clear()
        self._active.clear()
        self._idle.clear()

    def _retire(self, f: _Flow[T]) -> None:
        # A flow that has no waiters left: its finish tag still matters while it is ahead of
        # V (coming back at once must not reset it), after that it is forgotten.
        if f.finish > self._vtime:
            heapq.heappush(self._idle, (f.finish, next(self._seq), f))
        elif self._by_key.get(f.key) is f:
            del self._by_key[f.key]

"""Shared caps (issue 20): a router that watches with a `router_id` gets, in its own view of the
table, a share of each replica's `max_concurrency` (`RouteEndpoint.max_concurrency_share`),
and admits at most that many requests to the replica while it holds a lease
(`RenewRouterLease`). The hub keeps, per router and replica, `held`: the most the router may
have in flight there. The rule it never breaks: the `held` of all routers on a replica sum to
at most its cap (a cap lowered by a new table is the only exception, until the routers
acknowledge the smaller shares). Hence:

- A share only grows out of room (cap minus the `held` of all routers), and its `held` grows
  with it before the router can see it.
- A share that shrinks lowers `held` only when the router acknowledges the table that shrank
  it and reports that its in-flight requests to the replica fit the new share (the renewal's
  `over_share`); until then the others wait for that room.
- A lease lasts `lease_seconds` from when the router sent its renewal (so it ends, on the
  router's clock, no later than `lease_seconds` after the hub received it), and only a router
  whose watch stream is open is renewed. A router whose lease ran out without a renewal (the
  orchestrator unreachable, restarting, failing over) still admits on the shares of its last
  lease for `hold_seconds` (issue 31: the control plane's loss never refuses a request); only
  then does it stop. So a router that stops renewing leaves the split (its next view's shares
  go to 0) `lease_seconds + lease_margin_seconds` after its last renewal here, but the hub
  forgets its `held` only `lease_seconds + hold_seconds + lease_margin_seconds` after it (the
  margin covers clock-rate differences): by then the router has stopped admitting on them,
  and its next table comes under a new lease epoch, so no old lease can be renewed. A router
  that goes away (or loses its stream) thus returns its share within that bound.
- With several orchestrators, only the leader's hub may grant: `set_granting(False)` when it
  stands by (renewals are refused, every share is 0, and a router's view says `standby`, so a
  router that knows the other orchestrators moves on to the leader), `set_granting(True)` when
  it leads, under a new epoch.
- Hand-over. With a `journal` (the leader's database, `leadership.GrantsJournal`), every `held`
  that grows is written there before any router is shown the share it covers, and changes
  that shrink it are written soon after; the writes are fenced by the leader's term. A hub that
  starts leading adopts what the previous term wrote (`set_granting(True, adopted=...)`): each
  router's `held` counts as it was, the router keeps its shares under the new epoch at once
  (or gets them when it reconnects), and a router that does not come back within
  `lease_seconds + hold_seconds + lease_margin_seconds` gives them up like any silent router.
  Only room nobody held is granted. The very first leader of a database (term 1, nothing
  written) adopts nothing: no orchestrator granted before it. Without a complete hand-over
  (no journal, or stored grants of an older term than the one just before this leader's: that
  term may have granted without writing) the hub grants no room for the start-up grace
  `lease_seconds + hold_seconds + lease_margin_seconds`, after which every share a previous
  orchestrator granted has ended, held-over ones included.
- Held-over shares. A router that has no lease of its current table's epoch yet (this hub
  restarted, or leads now) but still admits on its last lease's shares names them in its
  renewal (`RenewRouterLeaseRequest.held`: per replica its share there, or its requests in
  flight if more). The hub adds them to the router's `held` (and its next view's shares)
  before granting that room to anyone, never past the room nobody else holds: during the
  start-up grace nothing else was granted, and each earlier orchestrator kept its own shares
  of one replica within the cap, so the routers' held-over shares fit in it together; after
  the grace a router can have no held-over share left (above), so the clamp only guards
  against a broken clock. The renewal that added any answers 0 (the router keeps admitting
  on its held-over shares until the view that shows them arrives, then renews).

Shares are the cap split evenly among the routers holding a lease that see the replica, the
remainder going to routers in an order rotated per replica.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Awaitable, Callable

from inferplane.orchestrator.routing.table import ReplicaKey

DEFAULT_LEASE_SECONDS = 15.0
DEFAULT_LEASE_MARGIN_SECONDS = 1.0
#: How long a router whose lease ran out unrenewed still admits on its last shares (seconds):
#: an orchestrator restart or a leader's hand-over (a standby waits out the leader lease,
#: 10 s) fits in `DEFAULT_LEASE_SECONDS` + this with room to spare.
DEFAULT_HOLD_SECONDS = 30.0
#: Between attempts to write the grants after a failed one.
JOURNAL_RETRY_SECONDS = 1.0

Grants = dict[str, dict[ReplicaKey, int]]
"""router id → replica → `held`: what the router may have in flight there."""

GrantsJournal = Callable[[Grants], Awaitable[None]]
"""Writes every router's `held` (replacing what was written before); raises when it could not
(the hub retries every `JOURNAL_RETRY_SECONDS` while it grants)."""


@dataclasses.dataclass(eq=False, slots=True)
class RouterLease:
    """What the hub knows of one router: its lease, the shares its next view carries
    (`sent`), what it may have in flight (`held`) and its last view's shares (`shown`)."""

    router_id: str
    epoch: str
    models: tuple[str, ...] = ()
    streams: int = 0
    expires: float = -math.inf  # hub monotonic: member while now < expires
    forget_at: float = -math.inf  # hub monotonic: `held` kept until then (its hold window)
    released: bool = False
    sent: dict[ReplicaKey, int] = dataclasses.field(default_factory=dict)  # next view's shares
    held: dict[ReplicaKey, int] = dataclasses.field(default_factory=dict)
    shown: dict[ReplicaKey, int] = dataclasses.field(default_factory=dict)  # last view's
    shown_version: str = ""
    generation: int = 0  # bumped whenever `sent` or `epoch` changes: its view is stale

    def member(self, now: float) -> bool:
        return not self.released and now < self.expires

    def reset(self, epoch: str) -> None:
        """Forgets everything of its lease: a new epoch, nothing held, not a member."""
        self.epoch = epoch
        self.expires = self.forget_at = -math.inf
        self.released = False
        self.held, self.sent, self.shown, self.shown_version = {}, {}, {}, ""
        self.generation += 1


def split_cap(
    key: ReplicaKey,
    cap: int,
    sharing: list[RouterLease],
    routers: list[RouterLease],
    *,
    granting: bool,
    frozen: bool = False,
) -> int:
    """Moves each router's next share (`sent`) of replica `key` toward an even split of `cap`
    among `sharing` (the members that see it; the remainder to routers in an order rotated per
    replica), never past the rule: shares shrink at once, grow only out of room (`cap` minus
    what all `routers` hold), the smallest first, and `held` grows with a share before the
    router sees it. `granting` False: every target is 0. `frozen` (the start-up grace): the
    members keep the shares they have (held-over ones), none grows; they shrink to the even
    split only when together they exceed `cap` (a cap lowered meanwhile). Returns how many
    `held` grew (the hub writes them to its journal before any view shows them)."""
    grown = 0
    n = len(sharing)
    target: dict[str, int] = {}
    if n and granting:
        base, extra = divmod(cap, n)
        offset = zlib.crc32(key[1].encode()) % n
        for i, router in enumerate(sharing):
            target[router.router_id] = base + (1 if (i - offset) % n < extra else 0)
        if frozen:
            kept = {r.router_id: r.sent.get(key, 0) for r in sharing}
            if sum(kept.values()) <= cap:
                target = kept
            else:
                target = {r: min(kept[r], t) for r, t in target.items()}
    for router in routers:  # shrink at once; `held` follows on the router's word
        want = target.get(router.router_id, 0)
        if router.sent.get(key, 0) > want:
            if want:
                router.sent[key] = want
            else:
                del router.sent[key]
    room = cap - sum(r.held.get(key, 0) for r in routers)
    order = sorted(sharing, key=lambda r: (r.sent.get(key, 0), r.router_id))
    for router in order:  # grow out of room, the smallest shares first
        current = router.sent.get(key, 0)
        want = target.get(router.router_id, 0)
        if want <= current:
            continue
        held = router.held.get(key, 0)
        share = min(want, max(current, held + max(0, room)))
        if share <= current:
            continue
        room -= max(0, share - held)
        router.sent[key] = share
        if share > held:
            router.held[key] = share
            grown += 1
    return grown

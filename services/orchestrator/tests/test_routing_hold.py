"""The hold (issue 31, `inferplane.orchestrator.routing.shares`): a router whose lease ran out
unrenewed still admits on its last shares for `hold_seconds`, so the hub keeps a silent
router's `held` for lease + hold + margin, a hub that starts without a hand-over grants no room
for as long, and routers that come back name their held-over shares, which the hub counts
before any other router gets that room. Invariant checked throughout: what routers may have in
flight to a replica (the held-over shares a new hub has not heard of included) never exceeds
its cap. Fake clock, no sleeps."""

from __future__ import annotations

import asyncio

from inferplane.orchestrator.routing import ReplicaKey, RoutingHub
from inferplane.testing.clock import FakeClock

from .test_routing_shares import LEASE, MARGIN, REPLICA, Router, _join, _table

HOLD = 20.0
GRACE = LEASE + HOLD + MARGIN


def _hub(clock: FakeClock, epoch: str = "e") -> RoutingHub:
    return RoutingHub(
        clock=clock,
        lease_seconds=LEASE,
        lease_margin_seconds=MARGIN,
        hold_seconds=HOLD,
        epoch=epoch,
    )


class HeldRouter(Router):
    """A router that renews naming the shares it still admits on from an earlier lease."""

    def __init__(self, hub: RoutingHub, router_id: str, held: dict[ReplicaKey, int]) -> None:
        super().__init__(hub, router_id)
        self.held = dict(held)

    def renew(self, *, release: bool = False) -> float:
        seconds = self.hub.renew(
            self.router_id,
            self.view.lease_epoch,
            self.view.version,
            self.over(release),
            release=release,
            held=list(self.held.items()),
        )
        if seconds > 0:
            self.held = {}  # a lease of the new epoch: its view's shares from now on
        return seconds

    def admits_on(self) -> dict[ReplicaKey, int]:
        shares = self.shares()
        return {k: max(shares.get(k, 0), self.held.get(k, 0)) for k in {*shares, *self.held}}


def test_a_silent_routers_share_goes_to_the_others_only_after_lease_hold_and_margin() -> None:
    """A router that stops renewing leaves the split after lease + margin (its next view
    would show 0), but its `held` stays until lease + hold + margin: only then does the other
    router get the room."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(GRACE)
        a, b = await _join(hub, clock, "a", "b")
        assert a.shares() == b.shares() == {REPLICA: 2}
        await b.close()  # b's orchestrator link is cut: it holds its 2 for its hold
        for _ in range(int(GRACE) - 1):
            clock.advance(1.0)
            hub.expire_leases()
            a.renew()
            await a.catch_up()
            a.renew()
            assert hub.held(REPLICA) <= 4
            assert a.shares() == {REPLICA: 2}, clock.monotonic()
        clock.advance(1.0 + 0.01)
        hub.expire_leases()
        for _ in range(2):
            await a.catch_up()
            a.renew()
        await a.catch_up()
        assert a.shares() == {REPLICA: 4} and hub.held(REPLICA) == 4

    asyncio.run(scenario())


def test_after_a_restart_held_over_shares_come_back_and_no_room_is_granted_before_the_grace() -> (
    None
):
    """An orchestrator restart without a hand-over: routers a and b held 2 + 1 of a cap of 4
    under the old orchestrator, c is new. The new hub shows a and b their held-over shares as
    soon as they name them (the renewal that adds them answers 0: wait for the view), grants
    c nothing during the grace, never lets the total pass the cap, and after the grace
    splits the cap among the three."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock, epoch="new")
        await hub.publish(_table({"r0": 4}))
        a = HeldRouter(hub, "a", {REPLICA: 2})
        b = HeldRouter(hub, "b", {REPLICA: 1})
        c = HeldRouter(hub, "c", {})
        for r in (a, b, c):
            await r.catch_up()
            assert r.shares() == {REPLICA: 0}
        assert a.renew() == 0.0  # its held-over share was added: wait for the view
        await a.catch_up()
        assert a.shares() == {REPLICA: 2} and hub.held(REPLICA) == 2
        assert a.renew() == LEASE  # the view acknowledged: a lease of the new epoch
        assert b.renew() == 0.0
        await b.catch_up()
        assert b.renew() == LEASE and b.shares() == {REPLICA: 1}
        assert c.renew() == LEASE
        await c.catch_up()
        assert c.shares() == {REPLICA: 0}  # no room during the grace
        for _ in range(int(GRACE) - 1):
            clock.advance(1.0)
            hub.expire_leases()
            for r in (a, b, c):
                await r.catch_up()
                r.renew()
            assert sum(r.admits_on().get(REPLICA, 0) for r in (a, b, c)) <= 4
            assert c.shares() == {REPLICA: 0}
        clock.advance(1.0 + 0.01)
        hub.expire_leases()
        for _ in range(3):
            for r in (a, b, c):
                await r.catch_up()
                r.renew()
        shares = [r.shares()[REPLICA] for r in (a, b, c)]
        assert sorted(shares) == [1, 1, 2] and hub.held(REPLICA) <= 4

    asyncio.run(scenario())


def test_held_over_shares_never_push_the_total_past_a_cap() -> None:
    """A router naming more than the room nobody else holds (possible only with a broken
    clock) gets the room, not its claim: the hub's `held` of a replica stays within its cap."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        a = HeldRouter(hub, "a", {REPLICA: 3})
        late = HeldRouter(hub, "late", {REPLICA: 4})
        for r in (a, late):
            await r.catch_up()
        assert a.renew() == 0.0
        await a.catch_up()
        assert a.shares() == {REPLICA: 3}
        assert a.renew() == LEASE
        assert late.renew() == 0.0
        await late.catch_up()
        assert late.shares() == {REPLICA: 1} and hub.held(REPLICA) == 4

    asyncio.run(scenario())


def test_an_adopted_router_keeps_its_held_share_for_its_hold() -> None:
    """A new leader adopts a router's grants; the router does not come back (its link to the
    new leader is cut, it holds its share over): its `held` stays lease + hold + margin, so
    a newcomer gets only the room nobody held until then."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        hub.set_granting(True, adopted={"gone": {REPLICA: 3}, "c": {REPLICA: 1}})
        (c,) = await _join(hub, clock, "c")
        assert c.shares() == {REPLICA: 1} and hub.held(REPLICA) == 4
        clock.advance(LEASE + MARGIN + 1.0)  # past the lease: "gone" is in its hold
        hub.expire_leases()
        for _ in range(2):
            await c.catch_up()
            c.renew()
        assert c.shares() == {REPLICA: 1} and hub.held(REPLICA) == 4
        clock.advance(HOLD)
        hub.expire_leases()
        for _ in range(2):
            await c.catch_up()
            c.renew()
        await c.catch_up()
        assert c.shares() == {REPLICA: 4}

    asyncio.run(scenario())

"""Shared caps (issue 20): the routing hub splits each replica's cap among the routers holding
a lease, never lets what they may hold in flight add up past the cap, and gives a silent
router's share to the others once its lease ended. On a fake clock (no sleeps); the RPCs over
real gRPC on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.orchestrator.routing import ReplicaKey, RoutingHub, make_table
from inferplane.orchestrator.routing import hub as routing
from inferplane.orchestrator.servicer import RoutingService
from inferplane.runtime import ErrorInterceptor, FailedPreconditionError
from inferplane.testing.clock import FakeClock

LEASE = 10.0
MARGIN = 1.0
REPLICA: ReplicaKey = ("10.0.0.1:9000", "r0")


def _table(caps: dict[str, int], model: str = "m") -> pb.WatchRoutingTableResponse:
    return make_table(
        [
            pb.ModelRoute(
                model=model,
                deployment=model,
                endpoints=[
                    pb.RouteEndpoint(
                        replica_id=rid, address=f"10.0.0.{i + 1}:9000", max_concurrency=cap
                    )
                    for i, (rid, cap) in enumerate(sorted(caps.items()))
                ],
            )
        ]
    )


def _hub(clock: FakeClock) -> RoutingHub:
    return RoutingHub(
        clock=clock, lease_seconds=LEASE, lease_margin_seconds=MARGIN, hold_seconds=0, epoch="e"
    )


class Router:
    """A router as the hub sees it: its watch (views pulled by hand), its in-flight requests
    per replica, and renewals that report the replicas over their share."""

    def __init__(self, hub: RoutingHub, router_id: str, models: tuple[str, ...] = ()) -> None:
        self.hub = hub
        self.router_id = router_id
        self.views: asyncio.Queue[pb.WatchRoutingTableResponse] = asyncio.Queue()
        self.task = asyncio.create_task(self._follow(hub.watch(models, router_id)))
        self.view = pb.WatchRoutingTableResponse()
        self.in_flight: dict[ReplicaKey, int] = {}

    async def _follow(self, stream: AsyncIterator[pb.WatchRoutingTableResponse]) -> None:
        async for view in stream:
            self.views.put_nowait(view)

    async def catch_up(self) -> None:
        """Takes the latest view the hub sent (the current one stays when none came)."""
        for _ in range(3):
            await asyncio.sleep(0)
        while not self.views.empty():
            self.view = self.views.get_nowait()

    def shares(self) -> dict[ReplicaKey, int]:
        return {
            (e.address, e.replica_id): e.max_concurrency_share
            for r in self.view.routes
            for e in r.endpoints
        }

    def over(self, release: bool = False) -> list[ReplicaKey]:
        shares = {} if release else self.shares()
        return [k for k, n in self.in_flight.items() if n > shares.get(k, 0)]

    def renew(self, *, release: bool = False) -> float:
        return self.hub.renew(
            self.router_id,
            self.view.lease_epoch,
            self.view.version,
            self.over(release),
            release=release,
        )

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _join(hub: RoutingHub, clock: FakeClock, *ids: str) -> list[Router]:
    """Routers that watched, renewed (epoch first seen), took their shares and renewed again."""
    routers = [Router(hub, i) for i in ids]
    for _ in range(3):
        for r in routers:
            await r.catch_up()
            r.renew()
    for r in routers:
        await r.catch_up()
    return routers


def test_no_shares_before_the_leases_of_a_previous_orchestrator_ended() -> None:
    """Invariant: a hub that just started grants nothing for lease + margin (the routers of
    the orchestrator before it may still admit on their leases that long)."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        (a,) = await _join(hub, clock, "a")
        assert a.shares() == {REPLICA: 0} and a.view.lease_epoch.startswith("e.")
        clock.advance(LEASE + MARGIN)
        hub.expire_leases()
        a.renew()
        await a.catch_up()
        assert a.shares() == {REPLICA: 4}

    asyncio.run(scenario())


def test_two_routers_split_a_cap_and_a_newcomer_waits_for_the_room() -> None:
    """Invariant: the shares of all routers on a replica sum to at most its cap, even while a
    router that holds the whole cap is told to shrink: the newcomer's share grows only when
    the first one reports that its requests in flight fit its smaller share."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        (a,) = await _join(hub, clock, "a")
        assert a.shares() == {REPLICA: 4}
        a.in_flight[REPLICA] = 4  # a is at the cap
        (b,) = await _join(hub, clock, "b")
        await a.catch_up()
        assert a.shares() == {REPLICA: 2}
        assert b.shares() == {REPLICA: 0}, "b may not admit while a still has 4 in flight"
        assert hub.held(REPLICA) == 4
        a.in_flight[REPLICA] = 3  # one ended: still over its share
        a.renew()
        await b.catch_up()
        assert b.shares() == {REPLICA: 0}
        a.in_flight[REPLICA] = 2
        a.renew()
        await b.catch_up()
        assert b.shares() == {REPLICA: 2} and hub.held(REPLICA) == 4
        for r in (a, b):
            await r.close()

    asyncio.run(scenario())


def test_a_silent_router_returns_its_share_after_lease_plus_margin_not_before() -> None:
    """Invariant: the share of a router that stopped renewing (gone, or cut off) goes to the
    others only once its lease ended on its own clock (lease seconds after its last renewal,
    plus the margin); it then needs a new table (a new epoch) to admit again."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        a, b = await _join(hub, clock, "a", "b")
        assert a.shares()[REPLICA] + b.shares()[REPLICA] == 4
        old_epoch = a.view.lease_epoch
        await a.close()  # a's stream breaks; it renews no more
        for _ in range(int(LEASE)):
            clock.advance(1.0)
            hub.expire_leases()
            b.renew()
            await b.catch_up()
        assert b.shares() == {REPLICA: 2}, "a's lease may still run"
        clock.advance(MARGIN + 0.01)
        hub.expire_leases()
        b.renew()
        await b.catch_up()
        assert b.shares() == {REPLICA: 4} and hub.held(REPLICA) == 4
        # a comes back: its old lease is not renewed; its new table names a new epoch.
        a = Router(hub, "a")
        await asyncio.sleep(0)  # its stream is open; it still enforces its old table
        a.view.lease_epoch = old_epoch
        assert a.renew() == 0.0
        await a.catch_up()
        assert a.view.lease_epoch != old_epoch and a.shares() == {REPLICA: 0}
        assert a.renew() == LEASE
        b.renew()
        await b.catch_up()
        b.renew()
        await a.catch_up()
        assert a.shares() == {REPLICA: 2} and b.shares() == {REPLICA: 2}

    asyncio.run(scenario())


def test_each_router_view_carries_the_router_count_and_its_rank() -> None:
    """The per-key limits' split: every router's view says how many routers hold a lease
    (a newcomer counts itself before its first lease) and its rank in router id order; a
    router joining or going silent changes every other router's view."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        (b,) = await _join(hub, clock, "b")
        assert (b.view.router_count, b.view.router_rank) == (1, 0)
        c = Router(hub, "c")
        await c.catch_up()
        assert (c.view.router_count, c.view.router_rank) == (2, 1), "counted before its lease"
        a = Router(hub, "a")
        await a.catch_up()
        assert (a.view.router_count, a.view.router_rank) == (2, 0)
        for r in (a, c):
            r.renew()
        for r in (a, b, c):
            await r.catch_up()
        assert [(r.view.router_count, r.view.router_rank) for r in (a, b, c)] == [
            (3, 0),
            (3, 1),
            (3, 2),
        ]
        await a.close()  # silent: the others' views change once its lease ended
        clock.advance(LEASE + MARGIN + 0.01)
        for r in (b, c):
            r.renew()
        hub.expire_leases()
        for r in (b, c):
            await r.catch_up()
        assert [(r.view.router_count, r.view.router_rank) for r in (b, c)] == [(2, 0), (2, 1)]
        for r in (b, c):
            await r.close()

    asyncio.run(scenario())


def test_only_the_leaders_hub_grants_and_a_new_leader_waits_out_the_old_leases() -> None:
    """Invariant: with several orchestrators only the leader's hub grants shares (a standby's
    refuses renewals and shows shares of 0), and a hub that starts leading grants nothing for
    lease + margin, while the leases the previous leader granted may still run."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        (a,) = await _join(hub, clock, "a")
        assert a.shares() == {REPLICA: 4}
        hub.set_granting(False)  # it lost the leadership
        await a.catch_up()
        assert a.shares() == {REPLICA: 0}
        with pytest.raises(FailedPreconditionError):
            a.renew()
        hub.set_granting(True)  # it leads again
        for r in (a,):
            await r.catch_up()
            r.renew()
        await a.catch_up()
        assert a.shares() == {REPLICA: 0}
        clock.advance(LEASE + MARGIN)
        hub.expire_leases()
        a.renew()
        await a.catch_up()
        assert a.shares() == {REPLICA: 4}

    asyncio.run(scenario())


class Journal:
    """A grants journal that keeps each write and can be held shut (the database slow) or
    made to fail (the database away)."""

    def __init__(self) -> None:
        self.writes: list[dict[str, dict[ReplicaKey, int]]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.fail = False

    async def __call__(self, held: dict[str, dict[ReplicaKey, int]]) -> None:
        await self.open.wait()
        if self.fail:
            raise RuntimeError("database away")
        self.writes.append({r: dict(k) for r, k in held.items()})

    @property
    def last(self) -> dict[str, dict[ReplicaKey, int]]:
        return self.writes[-1] if self.writes else {}


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_grown_share_is_shown_only_once_the_journal_wrote_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Write-ahead (hand-over, module docstring): a successor adopts what the journal holds,
    so no router may see a share whose `held` is not written; while the journal is slow or
    failing, routers keep the shares they were shown."""
    monkeypatch.setattr(routing, "JOURNAL_RETRY_SECONDS", 0.01)

    async def scenario() -> None:
        clock = FakeClock()
        journal = Journal()
        journal.open.clear()
        hub = RoutingHub(
            clock=clock,
            lease_seconds=LEASE,
            lease_margin_seconds=MARGIN,
            hold_seconds=0,
            journal=journal,
        )
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        (a,) = await _join(hub, clock, "a")
        assert hub.held(REPLICA) == 4 and journal.writes == []
        assert a.shares() == {REPLICA: 0}
        journal.fail = True
        journal.open.set()
        await asyncio.sleep(0.05)
        await a.catch_up()
        assert a.shares() == {REPLICA: 0}  # retried, still not written
        journal.fail = False
        await asyncio.sleep(0.05)
        await a.catch_up()
        assert a.shares() == {REPLICA: 4} and journal.last == {"a": {REPLICA: 4}}
        await a.close()

    asyncio.run(scenario())


def test_a_new_leader_adopting_the_grants_keeps_the_routers_admitting() -> None:
    """Hand-over: the next term adopts what the previous leader wrote. A router that comes
    back keeps its share under the new epoch at once (no wait for the old leases to end), a
    newcomer gets only room nobody held, and a router that does not come back gives its share
    up after lease + margin, like any silent router."""

    async def scenario() -> None:
        clock = FakeClock()
        old_journal, new_journal = Journal(), Journal()
        old = RoutingHub(
            clock=clock,
            lease_seconds=LEASE,
            lease_margin_seconds=MARGIN,
            hold_seconds=0,
            journal=old_journal,
        )
        await old.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        a, b = await _join(old, clock, "a", "b")
        await _settle()
        assert a.shares() == b.shares() == {REPLICA: 2}
        assert old_journal.last == {"a": {REPLICA: 2}, "b": {REPLICA: 2}}
        await a.close()
        await b.close()  # the old leader is gone; b does not come back

        new = RoutingHub(
            clock=clock,
            lease_seconds=LEASE,
            lease_margin_seconds=MARGIN,
            hold_seconds=0,
            journal=new_journal,
        )
        await new.publish(_table({"r0": 4}))
        new.set_granting(True, adopted=old_journal.last)
        assert new.held(REPLICA) == 4
        a2, c = Router(new, "a"), Router(new, "c")
        await _settle()
        await a2.catch_up()
        assert a2.shares() == {REPLICA: 2}  # at once, under the new epoch
        assert a2.renew() == LEASE
        c.renew()
        await _settle()
        await c.catch_up()
        assert c.shares() == {REPLICA: 0}  # b's share may still be in use
        assert new.held(REPLICA) <= 4
        assert new_journal.last == {"a": {REPLICA: 2}, "b": {REPLICA: 2}}  # this term wrote
        clock.advance(LEASE / 2)
        a2.renew()
        c.renew()
        clock.advance(LEASE / 2 + MARGIN)
        new.expire_leases()
        await _settle()
        for r in (a2, c):
            await r.catch_up()
            r.renew()
        await _settle()
        for r in (a2, c):
            await r.catch_up()
        assert a2.shares() == c.shares() == {REPLICA: 2}
        assert new.held(REPLICA) == 4 and "b" not in new_journal.last
        await a2.close()
        await c.close()

    asyncio.run(scenario())


def test_a_router_without_its_watch_gets_no_renewal() -> None:
    """Invariant: a lease is renewed only while the router's watch stream is open, so a
    router that cannot hear share changes stops admitting within the lease."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        with pytest.raises(FailedPreconditionError):
            hub.renew("nobody", "", "")
        (a,) = await _join(hub, clock, "a")
        await a.close()
        with pytest.raises(FailedPreconditionError):
            a.renew()

    asyncio.run(scenario())


def test_release_returns_the_share_at_once_when_nothing_is_in_flight() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        a, b = await _join(hub, clock, "a", "b")
        assert a.renew(release=True) == 0.0
        b.renew()
        await b.catch_up()
        assert b.shares() == {REPLICA: 4}

    asyncio.run(scenario())


def test_watchers_without_a_router_id_see_the_table_as_before() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        table = _table({"r0": 4})
        await hub.publish(table)
        clock.advance(LEASE + MARGIN)
        await _join(hub, clock, "a")
        plain = await anext(hub.watch())
        assert plain == table and not plain.lease_epoch
        assert all(e.max_concurrency_share == 0 for r in plain.routes for e in r.endpoints)

    asyncio.run(scenario())


def test_a_router_watching_some_models_shares_only_their_replicas() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        routes = [*_table({"r0": 4}, "m").routes]
        other = pb.ModelRoute(
            model="n",
            deployment="n",
            endpoints=[
                pb.RouteEndpoint(replica_id="s0", address="10.0.1.1:9000", max_concurrency=6)
            ],
        )
        await hub.publish(make_table([*routes, other]))
        clock.advance(LEASE + MARGIN)
        a, b = await _join(hub, clock, "a", "b")
        only_m = Router(hub, "c", ("m",))
        for _ in range(3):
            for r in (a, b, only_m):
                await r.catch_up()
                r.renew()
        for r in (a, b, only_m):
            await r.catch_up()
        n_key = ("10.0.1.1:9000", "s0")
        assert a.shares()[n_key] + b.shares()[n_key] == 6 and n_key not in only_m.shares()
        assert sum(r.shares()[REPLICA] for r in (a, b, only_m)) == 4
        assert only_m.shares()[REPLICA] >= 1

    asyncio.run(scenario())


# Renewals and admissions are the common steps; the rarer ones change who holds what.
OPS = ("join", "renew", "renew", "renew", "admit", "admit", "finish", "silence", "mute", "tick")
OPS += ("tick", "cap")


# Cases that catch the hub lowering `held` without the router's word (ignoring `over_share`),
# and renewing a lease of an epoch it had forgotten...
SHRINK_WITHOUT_ACK = [("join", 0, 2), ("renew", 0, 2), *[("admit", 0, 2)] * 4, ("join", 1, 2)]
SHRINK_WITHOUT_ACK += [("renew", 1, 2), ("renew", 0, 2), ("renew", 1, 2), ("renew", 0, 2)]
RENEW_FORGOTTEN = [("join", 0, 2), ("renew", 0, 2), ("renew", 0, 2), ("join", 1, 2)]
RENEW_FORGOTTEN += [("renew", 1, 2), ("renew", 0, 2), ("mute", 0, 2), ("renew", 1, 2)]
RENEW_FORGOTTEN += [("tick", 0, 6), ("renew", 1, 2), ("tick", 0, 6), ("renew", 1, 2)]
RENEW_FORGOTTEN += [("renew", 1, 2), ("mute", 0, 2), ("admit", 0, 2), ("admit", 0, 2)]

# ... and when two routers grew out of the same room (a cap raised while a share it shrank
# was not yet acknowledged).
ONE_ROOM_TWICE = [("join", 0, 2), ("renew", 0, 2), *[("admit", 0, 2)] * 4, ("join", 1, 2)]
ONE_ROOM_TWICE += [("join", 2, 2), ("renew", 1, 2), ("renew", 2, 2), ("cap", 0, 6)]


@example(SHRINK_WITHOUT_ACK)
@example(RENEW_FORGOTTEN)
@example(ONE_ROOM_TWICE)
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(OPS), st.integers(0, 2), st.integers(1, 6)),
        min_size=40,
        max_size=120,
    )
)
def test_what_routers_may_have_in_flight_never_exceeds_the_cap(
    ops: list[tuple[str, int, int]],
) -> None:
    """Invariant (the issue's guarantee): at every step, on every replica, the requests the
    routers have in flight plus what their shares still let them admit (while their own
    lease holds) stay within the cap, whatever the order of joins, renewals, finished
    requests, routers going away or cut off (`mute`: no renewals, stream open) and time.
    Not counted: the requests of a router whose lease ended before they did (module
    docstring of `inferplane.orchestrator.routing.shares`: the hub cannot see them)."""

    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        caps = {"r0": 4, "r1": 3}
        keys = {rid: (f"10.0.0.{1 + int(rid[1])}:9000", rid) for rid in caps}
        await hub.publish(_table(caps))
        clock.advance(LEASE + MARGIN)
        routers: dict[int, Router] = {}
        leases: dict[int, tuple[str, float]] = {}  # router -> (epoch, until) on its own clock
        gone: set[int] = set()
        muted: set[int] = set()

        def live(i: int) -> bool:
            epoch, until = leases.get(i, ("", -1.0))
            return routers[i].view.lease_epoch == epoch and clock.monotonic() < until

        def may_admit(i: int, key: ReplicaKey) -> int:
            r = routers[i]
            return max(r.in_flight.get(key, 0), r.shares().get(key, 0) if live(i) else 0)

        def check() -> None:
            for rid, cap in caps.items():
                total = sum(may_admit(j, keys[rid]) for j in routers if j not in gone)
                assert total <= cap, (rid, total, cap)
                assert hub.held(keys[rid]) <= cap

        def renew(i: int) -> None:
            r = routers[i]
            sent_at, epoch = clock.monotonic(), r.view.lease_epoch
            with contextlib.suppress(FailedPreconditionError):
                if seconds := r.renew():
                    leases[i] = (epoch, sent_at + seconds)

        for op, i, n in ops:
            r = routers.get(i)
            key = keys[f"r{n % 2}"]
            if op == "join" and r is None:
                routers[i] = Router(hub, f"router-{i}")
            elif r is None or i in gone:
                pass
            elif op == "renew" and i not in muted:
                renew(i)
            elif op == "admit" and may_admit(i, key) > r.in_flight.get(key, 0):
                r.in_flight[key] = r.in_flight.get(key, 0) + 1
            elif op == "finish" and r.in_flight.get(key, 0):
                r.in_flight[key] -= 1
            elif op == "silence":
                gone.add(i)
                await r.close()
            elif op == "mute":  # cut off (no renewal, no table), or back: renews at once
                muted ^= {i}
                if i not in muted:
                    renew(i)
            if op == "tick":
                clock.advance(n)
                hub.expire_leases()
            elif op == "cap":  # a replica's cap grows (a smaller one waits for the acks)
                caps[f"r{n % 2}"] = max(caps[f"r{n % 2}"], n)
                await hub.publish(_table(caps))
            check()  # before the tables the step caused arrive
            for j, other in routers.items():
                if j not in gone and j not in muted:
                    await other.catch_up()
                if not live(j):  # its lease ended: what it still runs is out of sight
                    other.in_flight.clear()
            check()

    asyncio.run(scenario())


# -- over gRPC -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _server(hub: RoutingHub) -> AsyncIterator[orchestrator_pb2_grpc.RoutingServiceStub]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server(RoutingService(hub), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield orchestrator_pb2_grpc.RoutingServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


def test_rpcs_a_router_stream_carries_its_epoch_and_a_renewal_needs_it_open() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        hub = _hub(clock)
        await hub.publish(_table({"r0": 4}))
        clock.advance(LEASE + MARGIN)
        async with _server(hub) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RenewRouterLease(pb.RenewRouterLeaseRequest(router_id="a"))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            call = stub.WatchRoutingTable(pb.WatchRoutingTableRequest(router_id="a"))
            first = await call.read()
            assert first.lease_epoch and first.routes[0].endpoints[0].max_concurrency_share == 0
            renewed = await stub.RenewRouterLease(
                pb.RenewRouterLeaseRequest(
                    router_id="a", lease_epoch=first.lease_epoch, version=first.version
                )
            )
            assert renewed.lease_seconds == LEASE
            second = await call.read()
            assert second.routes[0].endpoints[0].max_concurrency_share == 4
            call.cancel()
            for _ in range(100):  # the server notices the cancel, closes the hub's stream
                with contextlib.suppress(FailedPreconditionError):
                    hub.renew("a", second.lease_epoch, second.version)
                    await asyncio.sleep(0.01)
                    continue
                break
            else:
                raise AssertionError("the closed stream still renews")

    asyncio.run(scenario())

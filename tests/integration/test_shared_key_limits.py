"""Per-key limits shared across routers with the real parts: the orchestrator's `RoutingService`
and `RoutingHub`, and three routers (routing-table watch with their ids, lease keepers, a
`KeyLimiter` on each one's table) over real gRPC on loopback.

Invariant: the routers together admit at most a key's requests per minute (each its share:
the hub's router count and each router's rank); a router that goes away gives its share to
the others with the next split (after lease + margin), so the key's limit holds with two.
"""

from __future__ import annotations

import asyncio

from inferplane.orchestrator.routing import RoutingHub
from inferplane.router.keylimits import KeyLimiter
from inferplane.router.keys import KeyLimits, Principal
from inferplane.runtime import ResourceExhaustedError
from inferplane.testing.clock import FakeClock

from .test_shared_caps import LEASE, MARGIN, Router, _one_replica_table, _round, _serve, _settle

LIMIT = 10
KEY = Principal("k1", "t1", ("inference",), (), "standard", KeyLimits(requests_per_minute=LIMIT))


def _admitted(limiter: KeyLimiter, tries: int) -> int:
    admitted = 0
    for _ in range(tries):
        try:
            limiter.admit(KEY, "r").release()
            admitted += 1
        except ResourceExhaustedError:
            pass
    return admitted


def test_three_routers_admit_a_keys_limit_between_them_and_two_after_one_left() -> None:
    async def scenario() -> None:
        hub_clock = FakeClock()
        hub = RoutingHub(
            clock=hub_clock, lease_seconds=LEASE, lease_margin_seconds=MARGIN, hold_seconds=0
        )
        await hub.publish(_one_replica_table())
        hub_clock.advance(LEASE + MARGIN)  # the start-up wait is over
        server, address = await _serve(hub)
        clocks = [FakeClock() for _ in range(3)]
        routers = [Router(address, f"router-{i}", clocks[i]) for i in range(3)]
        limiters = [KeyLimiter(clocks[i]) for i in range(3)]
        for router, limiter in zip(routers, limiters, strict=True):
            router.source.subscribe(limiter.on_table)
        try:
            for router in routers:
                await router.source.start()
            await _settle()
            await _round(*routers)
            assert sorted(limiter.routers for limiter in limiters) == [(3, 0), (3, 1), (3, 2)]
            counts = [_admitted(limiter, 2 * LIMIT) for limiter in limiters]
            assert sum(counts) == LIMIT and sorted(counts) == [3, 3, 4]
            # router-0 goes away: its share goes to the others after the lease + margin.
            await routers[0].source.stop()
            for clock in (hub_clock, *clocks):
                clock.advance(LEASE + MARGIN + 60)  # and a new rate window
            hub.expire_leases()
            await _round(*routers[1:])
            assert [limiter.routers for limiter in limiters[1:]] == [(2, 0), (2, 1)]
            assert sum(_admitted(limiter, 2 * LIMIT) for limiter in limiters[1:]) == LIMIT
        finally:
            for router in routers:
                await router.lease.stop()
                await router.source.stop()
            await server.stop(0)

    asyncio.run(scenario())

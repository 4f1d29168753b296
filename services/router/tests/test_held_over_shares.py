"""Held-over shares (issue 31): while the orchestrator is away, restarting or failing over, a
router keeps admitting on the shares of its last lease for the lease's hold, says so in a
gauge, names them in its next renewal, and takes a new grant's shares once it comes. On a
fake clock; the orchestrator is a fake on loopback gRPC (`test_shared_caps.FakeOrchestrator`).
"""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import CollectorRegistry

from inferplane.router.metrics import AdmissionCollector

from .test_shared_caps import LEASE, REPLICA, Router, _rig, _settle, _table

HOLD = 30.0


def _gauge(router: Router, name: str) -> float | None:
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(router.admission, router.clock.monotonic))
    return registry.get_sample_value(name)


def test_orchestrator_unreachable_admission_goes_on_for_the_hold_then_stops() -> None:
    """The lease runs out while renewals fail: the router admits on its last shares for
    `hold_seconds` more (the gauge counts the seconds), then nothing new; a new grant ends
    the hold and its table's shares apply."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        fake.hold_seconds = HOLD
        a = Router(address, "a")
        try:
            await a.source.start()
            fake.send("a", _table(cap=4, share=2))
            await a.receive("cap4-share2-e.1")
            assert await a.lease.renew()
            assert _gauge(a, "inferplane_router_cap_shares_held_over_seconds") == 0.0
            fake.refuse = grpc.StatusCode.UNAVAILABLE  # the orchestrator is away
            assert not await a.lease.renew()
            a.clock.advance(LEASE + 5.0)  # the lease ran out 5 s ago
            first = a.acquire()
            await _settle()
            assert first.done() and a.admission.lease_valid() is True
            assert a.admission.held_over_seconds() == 5.0
            assert _gauge(a, "inferplane_router_cap_shares_held_over_seconds") == 5.0
            assert _gauge(a, "inferplane_router_cap_lease_valid") == 1.0
            second = a.acquire()
            third = a.acquire()  # over the held share (2): it waits as at any full cap
            await _settle()
            assert second.done() and not third.done()
            second.result().release()
            await _settle()
            assert third.done()
            third.result().release()
            a.clock.advance(HOLD - 5.0)  # the hold is over: nothing new
            late = a.acquire()
            await _settle()
            assert not late.done() and a.admission.lease_valid() is False
            assert a.admission.held_over_seconds() == 0.0
            fake.refuse = None
            fake.send("a", _table(cap=4, share=3, version="v2"))  # a new grant, share 3
            await a.receive("v2")
            assert await a.lease.renew()
            await _settle()
            assert late.done() and a.admission.share(REPLICA) == 3
            assert a.admission.held_over_seconds() == 0.0
        finally:
            await a.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_new_epochs_table_before_its_lease_keeps_the_last_shares_and_names_them() -> None:
    """An orchestrator restart: the new epoch's first table shows share 0 (it grants nothing
    yet), so the router keeps admitting on its last lease's share (3), names it in its
    renewal (`held`: the share, or the requests in flight if more), and runs on the new
    table's own share once a lease of the new epoch is granted."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        fake.hold_seconds = HOLD
        a = Router(address, "a")
        try:
            await a.source.start()
            fake.send("a", _table(cap=4, share=3))
            await a.receive("cap4-share3-e.1")
            assert await a.lease.renew()
            assert not fake.renewals["a"][-1].held  # under its lease: nothing held over
            slots = [a.acquire() for _ in range(2)]
            await _settle()
            assert all(s.done() for s in slots)
            fake.send("a", _table(cap=4, share=0, epoch="e.2"))  # restarted, granting nothing
            await a.receive("cap4-share0-e.2")
            a.clock.advance(LEASE + 1.0)  # and e.1's lease has run out meanwhile
            more = a.acquire()
            extra = a.acquire()
            await _settle()
            assert more.done() and not extra.done()  # 3 in flight: e.1's share
            assert a.admission.share(REPLICA) == 3 and a.admission.lease_valid()
            assert a.admission.held_over_seconds() == LEASE + 1.0  # since e.2 came
            assert a.admission.held_over() == [(REPLICA, 3)]
            fake.lease_seconds = 0.0  # the orchestrator takes the held share, shows it next
            await a.lease.renew()
            held = fake.renewals["a"][-1].held
            assert fake.renewals["a"][-1].lease_epoch == "e.2"
            assert [(h.replica.replica_id, h.requests) for h in held] == [("r0", 3)]
            await _settle()
            assert not extra.done() and a.admission.share(REPLICA) == 3
            fake.lease_seconds = LEASE
            fake.send("a", _table(cap=4, share=1, epoch="e.2", version="v3"))
            await a.receive("v3")
            assert await a.lease.renew()
            await _settle()
            # e.2's own share (1) now: 3 in flight are over it, reported as such.
            assert a.admission.share(REPLICA) == 1 and not extra.done()
            assert a.admission.over_share() == [REPLICA]
            assert a.admission.held_over() == [] and a.admission.held_over_seconds() == 0.0
            for slot in (*slots, more):
                slot.result().release()
            await _settle()
            assert extra.done()
        finally:
            await a.stop()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_new_epochs_table_after_the_hold_admits_nothing_until_its_lease() -> None:
    """Past the last lease's hold, a new epoch's table gives no held-over shares: requests
    wait for its lease, and the renewal names nothing held over."""

    async def scenario() -> None:
        fake, server, address = await _rig()
        fake.hold_seconds = HOLD
        a = Router(address, "a")
        try:
            await a.source.start()
            fake.send("a", _table(cap=4, share=2))
            await a.receive("cap4-share2-e.1")
            assert await a.lease.renew()
            a.clock.advance(LEASE + HOLD)
            fake.send("a", _table(cap=4, share=2, epoch="e.2"))
            await a.receive("cap4-share2-e.2")
            waiting = a.acquire()
            await _settle()
            assert not waiting.done() and a.admission.held_over() == []
            assert await a.lease.renew()
            assert not fake.renewals["a"][-1].held
            await _settle()
            assert waiting.done()
        finally:
            await a.stop()
            await server.stop(0)

    asyncio.run(scenario())

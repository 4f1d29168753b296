"""Several orchestrators on one database (issue 20): the leader lease, the fencing of writes,
what a standby does, and a failover between two real orchestrator processes. SQLite always,
PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL` is set (each test gets a database of its own).

Invariants:
- at most one orchestrator holds the lease at any instant, each by its own clock: a leader
  stops counting itself leader before a standby may take over; a standby takes over a dead
  leader's lease within d + r of the death (d the lease duration, r the renew interval), at
  once when the lease was released or names the standby's own id;
- a leader deposed without noticing (paused, cut off) can write nothing: catalogue, fleet and
  placement commits, managed replicas, releases and the published routing table are refused
  (NotLeaderError naming the new leader) and its successor's rows stay as they were; a takeover
  cannot commit while a fenced write is open;
- a standby refuses the catalogue and fleet RPCs with UNAVAILABLE / NOT_LEADER naming the
  leader and serves the routing table the leader stored; a deposed leader stops its loops;
- kill -9 of the leader process under traffic: the other leads within d + r (plus loading),
  no replica is started twice, drained or stopped, every request keeps being served, the
  standby's routing table keeps every endpoint throughout, and a shared-caps router listing
  both orchestrators follows the new leader, which adopts its share, so it never stops
  admitting (for longer than a renewal takes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import create_engine, text

from inferplane.api.inference.v1 import inference_pb2, inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.orchestrator.fleet.model import Node, NodeCondition
from inferplane.orchestrator.leadership import GrantsJournal, LeaderLease
from inferplane.orchestrator.release.store import ManagedReplica, SqlReleaseStore, Stage
from inferplane.orchestrator.routing import make_table
from inferplane.orchestrator.store.base import StateChange
from inferplane.orchestrator.store.lease import (
    NotLeaderError,
    SqlLeaseStore,
    SqlRouterGrants,
    SqlRoutingTables,
)
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.router.admission import Admission, AdmissionSettings, LoopScheduler
from inferplane.router.leases import CapLease
from inferplane.router.policies import default_registry
from inferplane.router.sources import OrchestratorRouteSource
from inferplane.runtime import ConfigError
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.time.clock import SystemClock
from inferplane.testing.clock import FakeClock
from inferplane.testing.databases import database_or_skip
from inferplane.testing.loop import LoopThread

S = na.Replica.State
D, R = 10.0, 3.0  # lease duration and renew interval of the fake-clock tests (the defaults)
T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_or_skip(request.param, tmp_path) as database:
        yield database


@pytest.fixture
def leases(url: str) -> Iterator[SqlLeaseStore]:
    store = SqlLeaseStore(url)
    store.create_schema()
    yield store
    store.close()


def contender(
    store: SqlLeaseStore, holder: str, clock: FakeClock, name: str = "orchestrator"
) -> LeaderLease:
    return LeaderLease(
        store, holder=holder, duration_seconds=D, renew_interval_seconds=R, clock=clock, name=name
    )


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    trailers = dict(exc.trailing_metadata())  # type: ignore[attr-defined]
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return info


# ---- the lease ------------------------------------------------------------------------------


def test_the_first_contender_leads_and_the_others_stand_by(leases: SqlLeaseStore) -> None:
    clock = FakeClock()
    a, b = contender(leases, "a", clock), contender(leases, "b", clock)
    assert a.try_acquire() and a.term() == 1 and a.leader() == ("a", 1)
    assert not b.try_acquire() and not b.held()
    assert b.leader() == ("a", 1)
    with pytest.raises(NotLeaderError) as refused:
        b.term()
    assert refused.value.status is grpc.StatusCode.UNAVAILABLE
    assert refused.value.reason == "NOT_LEADER"
    assert refused.value.metadata == {"leader": "a", "term": "1"}
    assert "a leads (term 1)" in refused.value.message


def test_a_standby_takes_over_only_after_a_whole_lease_without_renewal(
    leases: SqlLeaseStore,
) -> None:
    """The standby counts d from when it first saw the current version; the leader counts
    itself leader until d after its last renewal began, which is never later."""
    clock = FakeClock()
    a, b = contender(leases, "a", clock), contender(leases, "b", clock)
    assert a.try_acquire()
    assert not b.try_acquire()  # t=0: b sees version 1
    clock.advance(9)
    assert a.renew()  # t=9: a leads until 19
    clock.advance(2)
    assert not b.try_acquire()  # t=11: a new version; b counts from here
    assert b.wait_seconds() == R
    clock.advance(7.9)
    assert not b.try_acquire() and a.held()  # t=18.9
    assert b.wait_seconds() == pytest.approx(2.1)  # it wakes when the lease may expire
    clock.advance(0.1)
    assert not a.held()  # t=19: a stops first...
    assert not b.try_acquire()
    clock.advance(2)
    assert b.try_acquire() and b.term() == 2  # ...b takes over at 21 = 11 + d
    assert not a.renew() and a.leader() == ("b", 2)
    assert not a.try_acquire()


@pytest.mark.parametrize("death", [25.0, 26.4, 27.9])
def test_a_dead_leader_is_replaced_within_the_lease_plus_one_renew_interval(
    leases: SqlLeaseStore, death: float
) -> None:
    """Renewals and polls each when `wait_seconds` says (0.1 s steps): never two holders at
    once, and the standby leads between d - r and d + r after the leader died."""
    clock = FakeClock()
    a, b = contender(leases, "a", clock), contender(leases, "b", clock)
    assert a.try_acquire()
    clock.advance(1.3)  # the standby polls out of phase with the renewals
    start, elapsed, took_over = clock.monotonic(), 1.3, None
    while took_over is None:
        if elapsed < death and a.wait_seconds() < 1e-9:
            assert a.renew()
        if b.wait_seconds() < 1e-9 and b.try_acquire():
            took_over = elapsed
        assert not (a.held() and b.held()), f"two leaders at t={elapsed:.1f}"
        clock.advance(0.1)
        elapsed = round(clock.monotonic() - start + 1.3, 6)
        assert elapsed < death + D + R + 1, "no takeover"
    assert D - R - 0.1 <= took_over - death <= D + R + 0.1


def test_a_released_lease_is_taken_at_once(leases: SqlLeaseStore) -> None:
    clock = FakeClock()
    a, b = contender(leases, "a", clock), contender(leases, "b", clock)
    assert a.try_acquire()
    assert not b.try_acquire()
    assert a.release() and not a.held()
    assert b.try_acquire() and b.term() == 2


def test_the_same_id_restarted_leads_at_once_and_fences_its_former_self(
    leases: SqlLeaseStore,
) -> None:
    clock = FakeClock()
    before, after = contender(leases, "host:1", clock), contender(leases, "host:1", clock)
    assert before.try_acquire()
    assert after.try_acquire() and after.term() == 2
    assert not before.renew()


def test_take_is_a_compare_and_swap(leases: SqlLeaseStore) -> None:
    """A take succeeds only on the row exactly as the taker saw it: not after the holder
    renewed meanwhile, not after another contender took it; one of two inserters wins."""
    assert leases.insert("x", "a", D, T0)
    assert not leases.insert("x", "b", D, T0)
    stale = leases.read("x")
    assert stale is not None and (stale.holder, stale.term, stale.version) == ("a", 1, 1)
    assert leases.renew("x", "a", 1, D, T0)  # the holder is alive after all
    assert not leases.take(stale, "b", D, T0)
    seen = leases.read("x")
    assert seen is not None and seen.version == 2
    assert leases.take(seen, "b", D, T0)
    assert not leases.take(seen, "c", D, T0)
    now = leases.read("x")
    assert now is not None and (now.holder, now.term, now.version) == ("b", 2, 3)
    assert not leases.renew("x", "a", 1, D, T0) and leases.renew("x", "b", 2, D, T0)
    assert leases.release("x", "b", 2, T0)
    released = leases.read("x")
    assert released is not None and (released.holder, released.term) == ("", 2)


def test_lease_settings_out_of_range_are_refused(leases: SqlLeaseStore) -> None:
    for renew, duration, holder in ((10.0, 10.0, "a"), (0.0, 10.0, "a"), (3.0, 10.0, "")):
        with pytest.raises(ConfigError):
            LeaderLease(
                leases,
                holder=holder,
                duration_seconds=duration,
                renew_interval_seconds=renew,
                clock=FakeClock(),
            )


# ---- fencing --------------------------------------------------------------------------------

NODE = Node(
    name="cpu-a",
    address="127.0.0.1:50052",
    gpus=(),
    cpu_count=2,
    memory_bytes=32 * 10**9,
    labels=(),
    agent_version="test",
    condition=NodeCondition.READY,
    unschedulable=False,
    last_heartbeat_time=T0,
    register_time=T0,
)


def replica(revision: str) -> ManagedReplica:
    return ManagedReplica(
        node="cpu-a",
        replica_id="tiny-0-abcdef12",
        deployment_id="tiny",
        slot="tiny-0",
        address="127.0.0.1:50052",
        revision=revision,
        stage=Stage.SERVING,
        stage_since=T0,
    )


@pytest.mark.parametrize(
    "write", ["catalogue", "managed-replicas", "routing-table", "router-grants"]
)
def test_a_deposed_leader_cannot_overwrite_its_successor(
    url: str, leases: SqlLeaseStore, write: str
) -> None:
    """`a` was paused: its clock says it still holds the lease, but `b` took over. Its next
    write is refused by the database, naming `b`, and `b`'s row stays as `b` wrote it."""
    clock_a, clock_b = FakeClock(), FakeClock()
    a, b = contender(leases, "a", clock_a), contender(leases, "b", clock_b)
    stores: list[Any] = []

    def writer(fence: LeaderLease) -> tuple[Callable[[str], None], Callable[[], list[str]]]:
        """Writes value v of the kind under test; reads back the values stored."""
        if write == "catalogue":
            state = SqlStateStore(url, fence=fence)
            stores.append(state)
            return (
                lambda v: state.commit(
                    StateChange(put_nodes=(dataclasses.replace(NODE, agent_version=v),))
                ),
                lambda: [n.agent_version for n in state.load().nodes],
            )
        if write == "managed-replicas":
            state = SqlStateStore(url)
            stores.append(state)
            releases = SqlReleaseStore(state.engine, fence=fence)
            return (
                lambda v: releases.put_replica(replica(v)),
                lambda: [r.revision for r in releases.load()[0]],
            )
        if write == "router-grants":
            grants = SqlRouterGrants(leases.database, fence=fence)

            def save(v: str) -> None:
                grants.save("orchestrator", {v: {("10.0.0.1:9000", "r0"): 1}}, 1, T0)

            def saved() -> list[str]:
                got = grants.load("orchestrator")
                assert got is not None
                return list(got.held)

            return save, saved
        tables = SqlRoutingTables(leases.database, fence=fence)

        def publish(v: str) -> None:
            table = make_table([pb.ModelRoute(model=v, deployment=v)])
            tables.publish("orchestrator", table.version, table.SerializeToString(), 1, T0)

        def stored() -> list[str]:
            got = tables.read("orchestrator")
            assert got is not None
            return [r.model for r in pb.WatchRoutingTableResponse.FromString(got[1]).routes]

        return publish, stored

    write_a, _ = writer(a)
    write_b, read = writer(b)
    try:
        assert a.try_acquire()
        write_a("v1")
        assert not b.try_acquire()
        clock_b.advance(D)
        assert b.try_acquire() and b.term() == 2
        assert a.held()  # a has not noticed
        write_b("v2")
        with pytest.raises(NotLeaderError) as refused:
            write_a("v3")
        assert (refused.value.leader, refused.value.term) == ("b", 2)
        assert read() == ["v2"]
        assert not a.held()  # the refusal deposed it at once
    finally:
        for store in stores:
            store.close()


def test_a_new_leader_adopts_only_the_grants_of_the_term_just_before_its_own(
    leases: SqlLeaseStore,
) -> None:
    """The hand-over rule (`inferplane.orchestrator.routing`): grants are adoptable only when
    the term that wrote them is the one just before the new leader's; a term in between may
    have granted without writing (an older orchestrator, or one that died before its first
    write), so then the new leader waits out the leases instead; the database's first leader
    has nothing to adopt and nothing to wait for."""
    clocks = {h: FakeClock() for h in "abc"}
    a, b, c = (contender(leases, h, clocks[h]) for h in "abc")
    journals = {
        h: GrantsJournal(SqlRouterGrants(leases.database, fence=lease), lease, clock=clocks[h])
        for h, lease in zip("abc", (a, b, c), strict=True)
    }
    held = {"router-1": {("10.0.0.1:9000", "r0"): 3}, "router-2": {("10.0.0.1:9000", "r0"): 1}}

    async def scenario() -> None:
        assert a.try_acquire() and a.term() == 1
        # The database's first leader: nothing stored and term 1, so nobody granted before it.
        assert await journals["a"].adoptable() == {}
        await journals["a"](held)
        assert not b.try_acquire()  # first sight of a's version
        clocks["b"].advance(D)
        assert b.try_acquire() and b.term() == 2
        assert await journals["b"].adoptable() == held
        # b dies before writing anything; c takes term 3: term 2 wrote nothing, so no adoption.
        clocks["c"].advance(D)
        assert not c.try_acquire()  # first sight of b's version
        clocks["c"].advance(D)
        assert c.try_acquire() and c.term() == 3
        assert await journals["c"].adoptable() is None
        with pytest.raises(NotLeaderError):
            await journals["b"]({})  # deposed: fenced out

    asyncio.run(scenario())


def test_a_takeover_waits_for_a_fenced_write_to_commit(url: str, leases: SqlLeaseStore) -> None:
    """The fence holds the lease row until the write commits: a takeover that starts meanwhile
    commits after it (so the write happened under a term that was current)."""
    clock = FakeClock()
    a = contender(leases, "a", clock)
    assert a.try_acquire()
    seen = leases.read("orchestrator")
    assert seen is not None
    events: list[str] = []

    def take_over() -> None:
        taker = SqlLeaseStore(url)
        try:
            won = taker.take(seen, "b", D, T0)
            events.append(f"take {won}")
        finally:
            taker.close()

    with leases.database.transaction() as session:
        a.fence(session)
        thread = threading.Thread(target=take_over)
        thread.start()
        thread.join(0.5)  # it waits for the row (PostgreSQL) or the write lock (SQLite)
        events.append("write committed")
    thread.join(10)
    assert events == ["write committed", "take True"]
    with leases.database.transaction() as session, pytest.raises(NotLeaderError):
        a.fence(session)


# ---- standbys, in process -------------------------------------------------------------------


def lead_settings(fx: Any, tmp_path: Path, url: str, holder: str, **more: Any) -> Any:
    values: dict[str, Any] = {
        "database_url": url,
        "leader_id": holder,
        "leader_lease_seconds": 2.0,
        "leader_renew_seconds": 0.25,
        "reconcile_interval_seconds": 0.1,
    }
    return fx.make_settings(tmp_path / holder, **{**values, **more})


def wait_for(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.05)


def refusal(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_a_standby_refuses_the_catalogue_and_fleet_and_serves_the_leaders_routing_table(
    url: str, tmp_path: Path, fx: Any
) -> None:
    """Then the leader stops cleanly: the standby leads within its renew interval (the lease,
    30 s, has not expired: the leader released it) and serves what the leader created."""
    clock = FakeClock()
    lease = {"leader_lease_seconds": 30.0}
    with contextlib.ExitStack() as stop_a:
        a = stop_a.enter_context(
            fx.running(lead_settings(fx, tmp_path, url, "orch-a", **lease), clock)
        )
        with fx.running(lead_settings(fx, tmp_path, url, "orch-b", **lease), clock) as b:
            a.deployments.CreateDeployment(
                pb.CreateDeploymentRequest(deployment_id="tiny", deployment=fx.tiny_cpu_proto()),
                timeout=10,
            )
            wait_for(
                lambda: [r.model for r in b.components.hub.table.routes] == ["tiny"],
                5,
                "the standby serves the table the leader stored",
            )
            call = orchestrator_pb2_grpc.RoutingServiceStub(b.channel).WatchRoutingTable(
                pb.WatchRoutingTableRequest(), timeout=5
            )
            assert next(iter(call)).version == a.components.hub.table.version
            call.cancel()

            for rpc in (
                lambda: b.deployments.ListDeployments(pb.ListDeploymentsRequest(), timeout=5),
                lambda: b.deployments.CreateDeployment(
                    pb.CreateDeploymentRequest(deployment_id="x", deployment=fx.tiny_cpu_proto()),
                    timeout=5,
                ),
                lambda: b.nodes.RegisterNode(
                    pb.RegisterNodeRequest(status=fx.cpu_status("cpu-a")), timeout=5
                ),
                lambda: b.nodes.ListNodes(pb.ListNodesRequest(), timeout=5),
            ):
                refused = refusal(rpc)
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
                info = error_info(refused)
                assert (info.reason, info.metadata["leader"]) == ("NOT_LEADER", "orch-a")
                assert "orch-a leads" in refused.details()
            assert b.components.control.deployments() == ()  # it never loaded the catalogue

            stop_a.close()  # a clean stop releases the lease
            listed = wait_for(
                lambda: _listed(b),
                5,
                "the standby leads within its renew interval after a clean stop",
            )
            assert [d.name for d in listed.deployments] == ["deployments/tiny"]


def _listed(harness: Any) -> Any:
    with contextlib.suppress(grpc.RpcError):
        return harness.deployments.ListDeployments(pb.ListDeploymentsRequest(), timeout=5)
    return None


def test_a_deposed_leader_stops_its_loops_and_names_its_successor(
    url: str, tmp_path: Path, fx: Any
) -> None:
    with fx.running(lead_settings(fx, tmp_path, url, "orch-a"), FakeClock()) as a:
        components = a.components
        assert components.leadership.leading and components._leader_tasks
        intruder = SqlLeaseStore(url)
        try:
            seen = intruder.read("orchestrator")
            assert seen is not None and intruder.take(seen, "intruder", 60.0, T0)
        finally:
            intruder.close()
        refused = wait_for(
            lambda: _refused(a), 3, "the deposed leader refuses within its renew interval"
        )
        assert error_info(refused).metadata["leader"] == "intruder"
        assert not components.leadership.leading
        # A refusal can come (lease no longer held on its clock) just before the election
        # step that stands it by has run on the loop: its loops stop in that step.
        wait_for(
            lambda: components._leader_tasks == [] and components._follower is not None,
            3,
            "the deposed leader stops its loops and follows",
        )


def _refused(harness: Any) -> grpc.RpcError | None:
    try:
        harness.nodes.ListNodes(pb.ListNodesRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc
    return None


# ---- two orchestrator processes -------------------------------------------------------------

PROCESS_LEASE, PROCESS_RENEW = 2.0, 0.5
#: Loading the state and scheduling on a loaded 2-core machine, on top of d + r.
PROCESS_SLACK = 1.5


DIALLED = "x-test-dialled-replica"
"""Test-only metadata: the replica whose endpoint the test's traffic dialled (all the fake's
replicas share its one address, where each real replica process has its own)."""


class FakeNodeAgent(
    nodeagent_pb2_grpc.NodeAgentServiceServicer,  # type: ignore[misc]
    inference_pb2_grpc.InferenceServiceServicer,  # type: ignore[misc]
):
    """A node-agent whose replicas are READY once started and answer streamed chat requests
    on the agent's own address (standing for their replica processes' addresses): the replica
    named by `DIALLED` (the test's traffic says which endpoint it dialled) or, without it (the
    orchestrator's warm-up probes), any READY replica of the request's model; records every
    call."""

    def __init__(self) -> None:
        self.address = ""
        self.replicas: dict[str, na.Replica] = {}
        self.calls: list[tuple[str, str]] = []

    async def StartReplica(self, request: Any, context: Any) -> na.StartReplicaResponse:
        self.calls.append(("Start", request.replica_id))
        current = self.replicas.get(request.replica_id)
        if current is None or current.state in (S.STATE_STOPPED, S.STATE_FAILED):
            self.replicas[request.replica_id] = na.Replica(
                name=f"replicas/{request.replica_id}",
                spec=request.spec,
                state=S.STATE_READY,
                inference_address=self.address,
            )
        return na.StartReplicaResponse(replica=self.replicas[request.replica_id])

    def _set(self, method: str, name: str, state: int) -> na.Replica:
        replica_id = name.removeprefix("replicas/")
        self.calls.append((method, replica_id))
        self.replicas[replica_id].state = state
        return self.replicas[replica_id]

    async def DrainReplica(self, request: Any, context: Any) -> na.DrainReplicaResponse:
        return na.DrainReplicaResponse(replica=self._set("Drain", request.name, S.STATE_DRAINING))

    async def StopReplica(self, request: Any, context: Any) -> na.StopReplicaResponse:
        return na.StopReplicaResponse(replica=self._set("Stop", request.name, S.STATE_STOPPED))

    async def ListReplicas(self, request: Any, context: Any) -> na.ListReplicasResponse:
        self.calls.append(("List", ""))
        return na.ListReplicasResponse(replicas=[self.replicas[k] for k in sorted(self.replicas)])

    async def StreamChatCompletion(self, request: Any, context: Any) -> Any:
        model = request.request.model
        dialled = dict(context.invocation_metadata()).get(DIALLED, "")
        ready = [
            r
            for replica_id, r in self.replicas.items()
            if r.state == S.STATE_READY
            and (replica_id == dialled if dialled else model == r.spec.served_model_name)
        ]
        if not ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{dialled or model} is not serving")
        yield inference_pb2.StreamChatCompletionResponse(
            id="chatcmpl-1",
            object="chat.completion.chunk",
            model=request.request.model,
            choices=[inference_pb2.ChatCompletionChunkChoice(index=0, finish_reason="stop")],
        )

    def count(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)


@contextlib.contextmanager
def fake_agents(count: int) -> Iterator[list[FakeNodeAgent]]:
    loop = LoopThread()
    agents = [FakeNodeAgent() for _ in range(count)]

    async def serve(agent: FakeNodeAgent) -> grpc.aio.Server:
        server = grpc.aio.server()
        nodeagent_pb2_grpc.add_NodeAgentServiceServicer_to_server(agent, server)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(agent, server)
        agent.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        return server

    servers = [loop.run(serve(agent)) for agent in agents]
    try:
        yield agents
    finally:
        for server in servers:
            loop.run(server.stop(0))
        loop.close()


@contextlib.contextmanager
def orchestrator(url: str, holder: str, tmp_path: Path) -> Iterator[tuple[Any, str]]:
    """`python -m inferplane.orchestrator` on a free port; yields (process, address). Its
    log is `tmp_path/<holder>.log`; SIGTERM (or nothing, after a kill) at the end."""
    port = free_port()
    log = (tmp_path / f"{holder}.log").open("wb")
    args = [
        *("--plaintext", "--host", "127.0.0.1", "--port", str(port)),
        *("--data-dir", str(tmp_path / holder), "--database-url", url),
        *("--leader-id", holder, "--leader-lease-seconds", str(PROCESS_LEASE)),
        *("--leader-renew-seconds", str(PROCESS_RENEW), "--reconcile-interval-seconds", "0.2"),
        *("--heartbeat-interval-seconds", "60", "--grace-period-seconds", "0.2"),
        *("--no-json-logs", "--event-loop", "asyncio"),
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "inferplane.orchestrator", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                assert process.poll() is None, (tmp_path / f"{holder}.log").read_text()
                with contextlib.suppress(grpc.RpcError):
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    return bool(status == health_pb2.HealthCheckResponse.SERVING)
                return False

            wait_for(serving, 60, f"{holder} serves")
        yield process, address
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


class SharedCapsRouter:
    """The shared-caps half of a real router, in process: its routing-table watch (with its
    router id) and lease keeper listing every orchestrator, and its admission. Samples every
    20 ms, after it first could admit, how long it could not (no lease or no share): the
    longest such gap is `longest_gap` seconds (a new leader's table and the renewal it
    triggers are milliseconds apart: requests queue meanwhile)."""

    def __init__(self, addresses: list[str], router_id: str = "router-1") -> None:
        self.loop = LoopThread()
        self.longest_gap = 0.0
        self._could_admit = False
        self._gap_since: float | None = None

        async def build() -> None:
            clock = SystemClock()
            self.admission = Admission(
                default_registry(), AdmissionSettings(), clock, LoopScheduler()
            )
            self.source = OrchestratorRouteSource(
                ",".join(addresses),
                router_id=router_id,
                initial_backoff_seconds=0.1,
                max_backoff_seconds=1.0,
            )
            self.lease = CapLease(lambda: self.source.address, router_id, self.admission, clock)
            self.source.subscribe(self.admission.apply)
            self.source.subscribe(self.lease.on_table)
            await self.source.start()
            await self.lease.start()
            self._sampler = asyncio.create_task(self._sample())

        self.loop.run(build())

    def _may_admit(self) -> bool:
        """Under a lease, with room on some replica (its share)."""
        route = self.source.current().get("tiny")
        shares = [self.admission.share(e.key) or 0 for e in (route.endpoints if route else ())]
        return bool(self.admission.lease_valid()) and sum(shares) > 0

    async def _sample(self) -> None:
        while True:
            now = time.monotonic()
            if self._may_admit():
                self._could_admit, self._gap_since = True, None
            elif self._could_admit:
                self._gap_since = self._gap_since or now
                self.longest_gap = max(self.longest_gap, now - self._gap_since)
            await asyncio.sleep(0.02)

    def state(self) -> tuple[str, bool]:
        """(the lease epoch of the table it applied last, whether it may admit now)"""
        return self.loop.call(lambda: (self.source.current().lease_epoch, self._may_admit()))

    def close(self) -> None:
        async def stop() -> None:
            self._sampler.cancel()
            await self.lease.stop()
            await self.source.stop()

        self.loop.run(stop())
        self.loop.close()


def leads(address: str) -> bool:
    """Whether the orchestrator at `address` answers the fleet API (a standby refuses it)."""
    with grpc.insecure_channel(address) as channel:
        try:
            orchestrator_pb2_grpc.NodeServiceStub(channel).ListNodes(
                pb.ListNodesRequest(), timeout=2
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return False
    return True


class Traffic:
    """A router in miniature: follows the routing table of one orchestrator (the standby's)
    and sends streamed chat requests round-robin to the endpoints it lists."""

    def __init__(self, address: str, model: str) -> None:
        self.tables: list[list[str]] = []  # endpoint ids of each table received
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._endpoints: list[pb.RouteEndpoint] = []
        self._channel = grpc.insecure_channel(address)
        self._model = model
        self._threads = [
            threading.Thread(target=self._watch, daemon=True),
            threading.Thread(target=self._send, daemon=True),
        ]
        self._watch_error: list[str] = []
        self._call: Any = None

    def __enter__(self) -> Traffic:
        stub = orchestrator_pb2_grpc.RoutingServiceStub(self._channel)
        self._call = stub.WatchRoutingTable(pb.WatchRoutingTableRequest(models=[self._model]))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._call.cancel()
        for thread in self._threads:
            thread.join(10)
        self._channel.close()

    def _watch(self) -> None:
        try:
            for table in self._call:
                self._endpoints = [e for route in table.routes for e in route.endpoints]
                self.tables.append(sorted(e.replica_id for e in self._endpoints))
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                self._watch_error.append(f"{exc.code().name}: {exc.details()}")

    def _send(self) -> None:
        channels: dict[str, grpc.Channel] = {}
        turn = 0
        request = inference_pb2.StreamChatCompletionRequest(
            request=inference_pb2.ChatCompletionRequest(model=self._model, stream=True)
        )
        while not self._stop.is_set():
            endpoints = self._endpoints
            if not endpoints:
                time.sleep(0.01)
                continue
            endpoint = endpoints[turn % len(endpoints)]
            turn += 1
            channel = channels.setdefault(endpoint.address, grpc.insecure_channel(endpoint.address))
            try:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                chunks = list(
                    stub.StreamChatCompletion(
                        request, timeout=5, metadata=((DIALLED, endpoint.replica_id),)
                    )
                )
                assert chunks[-1].choices[0].finish_reason == "stop"
                self.ok += 1
            except (grpc.RpcError, AssertionError, IndexError) as exc:
                self.failures.append(f"{endpoint.replica_id}: {exc!r}")
            time.sleep(0.02)
        for channel in channels.values():
            channel.close()


def test_killing_the_leader_under_traffic_fails_over_within_the_bound(
    url: str, tmp_path: Path, fx: Any
) -> None:
    with (
        fake_agents(2) as agents,
        orchestrator(url, "orch-a", tmp_path) as (leader, address_a),
        orchestrator(url, "orch-b", tmp_path) as (_standby, address_b),
    ):
        assert leads(address_a) and not leads(address_b)
        with grpc.insecure_channel(address_a) as channel:
            nodes = orchestrator_pb2_grpc.NodeServiceStub(channel)
            for name, agent in zip(("cpu-a", "cpu-b"), agents, strict=True):
                status = fx.cpu_status(name)
                status.address = agent.address
                nodes.RegisterNode(pb.RegisterNodeRequest(status=status), timeout=10)
            orchestrator_pb2_grpc.DeploymentServiceStub(channel).CreateDeployment(
                pb.CreateDeploymentRequest(
                    deployment_id="tiny", deployment=fx.tiny_cpu_proto(replicas=2)
                ),
                timeout=10,
            )
        router = SharedCapsRouter([address_b, address_a])  # the standby first
        with Traffic(address_b, "tiny") as traffic:
            wait_for(
                lambda: traffic.tables and len(traffic.tables[-1]) == 2,
                30,
                "both replicas in the standby's routing table",
            )
            wait_for(lambda: router.state()[1], 30, "the router's lease at the leader")
            epoch_a = router.state()[0]
            wait_for(lambda: traffic.ok >= 20, 10, "traffic flows")
            served_before = traffic.ok
            endpoints = traffic.tables[-1]
            starts = sorted(rid for agent in agents for m, rid in agent.calls if m == "Start")
            assert len(starts) == 2 and len(set(starts)) == 2

            killed = time.monotonic()
            leader.send_signal(signal.SIGKILL)
            leader.wait(10)
            wait_for(lambda: leads(address_b), PROCESS_LEASE + PROCESS_RENEW + 10, "failover")
            failover = time.monotonic() - killed
            lists = sum(agent.count("List") for agent in agents)
            wait_for(
                lambda: sum(agent.count("List") for agent in agents) >= lists + 6,
                10,
                "the new leader's reconcile loop observes the node-agents",
            )
            wait_for(lambda: traffic.ok >= served_before + 40, 10, "traffic flows after")
            # The router moved to the new leader, which adopted its share: it kept admitting
            # (its last renewal at the old leader covered it until then).
            wait_for(
                lambda: router.state()[0] != epoch_a and router.state()[1],
                20,
                "the router admits under the new leader's lease",
            )
        router.close()
        print(
            f"\nfailover after kill -9 ({url.split(':')[0]}): {failover:.2f} s "
            f"(lease {PROCESS_LEASE} s + renew {PROCESS_RENEW} s); requests served "
            f"{traffic.ok}, failed {len(traffic.failures)}"
        )
        logs = {h: (tmp_path / f"{h}.log").read_text()[-3000:] for h in ("orch-a", "orch-b")}
        assert failover <= PROCESS_LEASE + PROCESS_RENEW + PROCESS_SLACK, logs
        assert traffic.failures == [] and not traffic._watch_error, traffic.failures[:5]
        assert router.longest_gap < 1.0, f"the router could not admit for {router.longest_gap} s"
        # The standby's watch got the two-endpoint table once and nothing after it.
        assert traffic.tables[traffic.tables.index(endpoints) :] == [endpoints], traffic.tables
        calls = [c for agent in agents for c in agent.calls if c[0] != "List"]
        assert sorted(rid for m, rid in calls if m == "Start") == starts, (calls, logs)
        assert not any(m in ("Drain", "Stop") for m, _ in calls), (calls, logs)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            placements = conn.execute(text("SELECT replica_id, node FROM placements")).all()
            managed = conn.execute(
                text("SELECT slot, replica_id, stage FROM managed_replicas")
            ).all()
            lease = conn.execute(text("SELECT holder, term FROM leader_leases")).all()
    finally:
        engine.dispose()
    assert sorted(p.replica_id for p in placements) == ["tiny-0", "tiny-1"]
    assert sorted((m.slot, m.replica_id, m.stage) for m in managed) == [
        ("tiny-0", starts[0], "serving"),
        ("tiny-1", starts[1], "serving"),
    ]
    # orch-b led at term 2, then released the lease when it stopped.
    assert [tuple(row) for row in lease] == [("", 2)], (tmp_path / "orch-b.log").read_text()[-3000:]

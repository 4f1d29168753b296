"""The reconcile loop and rolling releases against hand-written fake node-agents (no processes,
no sleeps: the clock is fake and ticks are called one by one).

Invariants: a deployment's replicas are started with the placement's numbers; ticks are
idempotent; a profile change replaces replicas make-before-break (the old replica serves until
the new one is READY and warmed up, then is marked draining, drained, stopped); a failed gate
rolls back and says so; an orchestrator restart adopts running replicas; a failing node-agent is
retried with exponential backoff.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import replica_pb2 as rp
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.app import OrchestratorComponents, build_components
from inferplane.orchestrator.convert import deployment_from_proto, node_from_status
from inferplane.orchestrator.release.agents import ProbeResult
from inferplane.orchestrator.release.gate import GateReading, GateTarget, gate_verdict, p99
from inferplane.orchestrator.release.spec import agent_replica_id
from inferplane.orchestrator.routing import RoutingHub, make_table
from inferplane.testing.clock import FakeClock

S = na.Replica.State
ADDRESS = "127.0.0.1:50052"


class FakeAgents:
    """Node-agents in memory, by address. Started replicas are READY at once unless
    `auto_ready` is off; `down` addresses raise; `bad_probes` replica ids fail warm-up."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, na.Replica]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.down: set[str] = set()
        self.bad_probes: set[str] = set()
        self.auto_ready = True

    def _check(self, address: str, method: str, replica_id: str = "") -> None:
        self.calls.append((method, address, replica_id))
        if address in self.down:
            raise ConnectionError(f"{address} is down")

    async def list_replicas(self, address: str) -> list[na.Replica]:
        self._check(address, "List")
        return [self.replicas[address][k] for k in sorted(self.replicas.get(address, {}))]

    async def start_replica(
        self, address: str, replica_id: str, spec: na.ReplicaSpec
    ) -> na.Replica:
        self._check(address, "Start", replica_id)
        node = self.replicas.setdefault(address, {})
        existing = node.get(replica_id)
        if existing is not None and existing.state not in (S.STATE_STOPPED, S.STATE_FAILED):
            return existing
        state = S.STATE_READY if self.auto_ready else S.STATE_STARTING
        node[replica_id] = na.Replica(
            name=f"replicas/{replica_id}",
            spec=spec,
            state=state,
            inference_address=address,
            metrics_url=f"http://{address.split(':')[0]}:9100/{replica_id}/metrics",
        )
        return node[replica_id]

    async def drain_replica(self, address: str, replica_id: str, grace: int) -> na.Replica:
        self._check(address, "Drain", replica_id)
        replica = self.replicas[address][replica_id]
        replica.state = S.STATE_DRAINING
        return replica

    async def stop_replica(self, address: str, replica_id: str, grace: int) -> na.Replica:
        self._check(address, "Stop", replica_id)
        replica = self.replicas[address][replica_id]
        replica.state = S.STATE_STOPPED
        return replica

    async def probe(
        self,
        address: str,
        replica_id: str,
        model: str,
        *,
        embed: bool = False,
        speech: bool = False,
    ) -> ProbeResult:
        self._check(address, "Probe", replica_id)
        if replica_id in self.bad_probes:
            return ProbeResult(False, 0.0, "UNAVAILABLE: engine not answering")
        return ProbeResult(True, 0.05)

    async def conformance(
        self, address: str, *, live_requests: int, timeout_seconds: float, seed: int
    ) -> rp.ConformanceReport:
        """A clean conformance run (the release pipeline's gate passes)."""
        self._check(address, "Conformance")
        return rp.ConformanceReport(
            replay_cases=4,
            replay_passed=4,
            live_requests=live_requests,
            tool_calls_expected=live_requests,
            tool_calls_returned=live_requests,
            tool_calls=live_requests,
            tool_calls_schema_valid=live_requests,
        )

    async def close(self) -> None:
        return None

    def count(self, method: str) -> int:
        return sum(1 for m, _, _ in self.calls if m == method)

    def live(self) -> dict[str, int]:
        return {
            rid: r.state
            for rid, r in self.replicas.get(ADDRESS, {}).items()
            if r.state != S.STATE_STOPPED
        }


class FakeGate:
    """A gate source returning a fixed reading."""

    def __init__(self, reading: GateReading) -> None:
        self.reading = reading
        self.targets: list[GateTarget] = []

    async def measure(self, target: GateTarget, window_seconds: float) -> GateReading:
        self.targets.append(target)
        return self.reading


@dataclasses.dataclass
class World:
    components: OrchestratorComponents
    agents: FakeAgents
    clock: Any
    gate: FakeGate

    @property
    def control(self) -> Any:
        return self.components.control

    def tick(self, times: int = 1) -> None:
        async def ticks() -> None:
            for _ in range(times):
                await self.components.reconciler.reconcile_once()
                for _ in range(5):
                    await asyncio.sleep(0)  # let warm-up/gate tasks finish

        asyncio.run(ticks())

    def table(self) -> pb.WatchRoutingTableResponse:
        return self.components.hub.table

    def endpoints(self, model: str = "kimi-tiny") -> list[tuple[str, bool]]:
        (route,) = [r for r in self.table().routes if r.model == model]
        return [(e.replica_id, e.draining) for e in route.endpoints]

    def status(self) -> Any:
        return self.control.get("kimi-tiny").status


def make_world(
    tmp_path: Path,
    fx: Any,
    agents: FakeAgents | None = None,
    settings_overrides: dict[str, Any] | None = None,
    **gate: Any,
) -> World:
    clock = FakeClock()
    agents = agents or FakeAgents()
    fake_gate = FakeGate(
        GateReading(**(gate or {"requests": 10, "errors": 0, "ttft_p99_seconds": 0.1}))
    )
    settings = fx.make_settings(tmp_path, reconcile=False, **(settings_overrides or {}))
    components = build_components(settings, clock=clock, agents=agents, gate=fake_gate)
    components.store.create_schema()
    components.releases.create_schema()
    components.control.load()
    components.reconciler.load()
    components.control.set_status_provider(components.reconciler.status)
    components.control.register_node(node_from_status(fx.cpu_status("cpu-a")))
    return World(components, agents, clock, fake_gate)


@pytest.fixture
def world(tmp_path: Path, fx: Any) -> Iterator[World]:
    w = make_world(tmp_path, fx)
    yield w
    w.components.store.close()


def create_tiny(world: World, fx: Any, **rollout: Any) -> None:
    proto = fx.tiny_cpu_proto(aliases=["tiny"])
    if rollout:
        proto.rollout.CopyFrom(pb.RolloutStrategy(**rollout))
    world.control.create(deployment_from_proto(proto, "kimi-tiny"))


def change_profile(world: World, *args: str) -> str:
    current = world.control.resolve("kimi-tiny")
    profile = dataclasses.replace(current.profile, extra_engine_args=args)
    return world.control.update(
        dataclasses.replace(current, profile=profile), ["profile"]
    ).deployment.revision


def test_replica_is_started_with_the_placement_and_served_after_warm_up(
    world: World, fx: Any
) -> None:
    create_tiny(world, fx)
    deployment = world.control.resolve("kimi-tiny")
    world.tick()
    rid = agent_replica_id("kimi-tiny-0", deployment.revision)
    assert world.agents.count("Start") == 1
    spec = world.agents.replicas[ADDRESS][rid].spec
    (placement,) = world.control.placements().placements
    assert spec.revision == deployment.revision and spec.deployment == "kimi-tiny"
    assert spec.kv_cache_bytes == placement.kv_cache_bytes > 0
    assert spec.dtype == "float32" and spec.reasoning_parser == "kimi_k2"
    assert spec.owned_by == "inferplane" and spec.created > 0
    assert world.endpoints() == []  # READY but not warmed up yet: not routable
    world.tick(2)
    assert world.agents.count("Probe") == 1
    assert world.endpoints() == [(rid, False)] == world.endpoints("tiny")
    (endpoint,) = world.table().routes[0].endpoints
    assert endpoint.address == ADDRESS and endpoint.max_concurrency == 8
    # Routers tokenize precise_prefix prompts with the tokenizer the replicas load.
    assert world.table().routes[0].tokenizer == deployment.profile.model_source != ""
    # Telemetry scrapes the engine the node-agent reports, found through the table.
    assert endpoint.metrics_url == world.agents.replicas[ADDRESS][rid].metrics_url != ""
    status = world.status()
    assert (status.phase, status.ready_replicas) == ("Available", 1)
    version = world.table().version
    world.tick(3)  # idempotent: nothing more to do
    assert world.agents.count("Start") == 1 and world.agents.count("Stop") == 0
    assert world.table().version == version


def test_profile_change_rolls_out_make_before_break(world: World, fx: Any) -> None:
    create_tiny(world, fx)
    world.tick(3)
    old = world.endpoints()[0][0]
    new_revision = change_profile(world, "--seed", "1")
    new = agent_replica_id("kimi-tiny-0", new_revision)
    world.agents.auto_ready = False
    world.tick()
    assert set(world.agents.live()) == {old, new}  # surge: both run
    assert world.endpoints() == [(old, False)]  # the old one serves alone meanwhile
    status = world.status()
    assert status.phase == "Progressing" and status.target_revision == new_revision
    assert status.current_revision != new_revision
    world.agents.replicas[ADDRESS][new].state = S.STATE_READY
    world.tick(4)  # warm-up, then the release's qualifying gate (conformance)
    assert world.agents.count("Conformance") == 1
    # New one serves; old one is marked draining in the table before anyone drains it.
    # (order in the table follows replica ids, i.e. revision hashes: compare as sets)
    assert sorted(world.endpoints()) == sorted([(new, False), (old, True)])
    assert world.agents.count("Drain") == 0
    world.clock.advance(1.0)  # drain_propagation_seconds
    world.tick()
    assert world.agents.replicas[ADDRESS][old].state == S.STATE_DRAINING
    world.agents.replicas[ADDRESS][old].in_flight_requests = 2
    world.tick()
    assert world.agents.count("Stop") == 0  # in-flight requests finish first
    world.agents.replicas[ADDRESS][old].in_flight_requests = 0
    world.tick(2)
    assert world.agents.live() == {new: S.STATE_READY}
    assert world.endpoints() == [(new, False)]
    status = world.status()
    assert (status.phase, status.current_revision, status.target_revision) == (
        "Available",
        new_revision,
        "",
    )


def test_failed_gate_rolls_back_and_status_says_why(tmp_path: Path, fx: Any) -> None:
    world = make_world(tmp_path, fx, requests=10, errors=4, ttft_p99_seconds=0.1)
    create_tiny(world, fx, max_surge=1, max_error_rate=0.1, gate_window_seconds=30)
    world.tick(3)
    old = world.endpoints()[0][0]
    serving = world.status().current_revision
    bad = change_profile(world, "--seed", "13")  # any change: the gate readings fail it
    world.tick(4)
    assert len(world.gate.targets) == 1  # the gate ran on the new replica only
    assert world.agents.live() == {old: S.STATE_READY}
    assert world.endpoints() == [(old, False)]
    status = world.status()
    assert status.phase == "RolledBack" and status.current_revision == serving
    assert bad in status.message and "error rate 0.400 (4/10) > 0.1" in status.message
    world.tick(3)  # holds at the serving revision
    assert world.agents.count("Start") == 2
    fixed = change_profile(world, "--seed", "2")  # a new profile tries again
    world.gate.reading = GateReading(10, 0, 0.1)
    world.tick(5)  # warm-up and probe gate, the release's conformance gate, then it serves
    world.clock.advance(1.0)
    world.tick(3)
    assert world.endpoints() == [(agent_replica_id("kimi-tiny-0", fixed), False)]
    assert world.status().phase == "Available"
    world.components.store.close()


def test_failed_warm_up_of_a_rollout_rolls_back(world: World, fx: Any) -> None:
    create_tiny(world, fx)
    world.tick(3)
    old = world.endpoints()[0][0]
    bad = change_profile(world, "--seed", "13")  # any change: its probes fail
    world.agents.bad_probes.add(agent_replica_id("kimi-tiny-0", bad))
    components = world.components
    components.reconciler._settings = dataclasses.replace(  # no real sleeps between attempts
        components.reconciler._settings, warmup_retry_seconds=0
    )
    world.tick(4)
    assert world.status().phase == "RolledBack"
    assert "warm-up request failed" in world.status().message
    assert world.endpoints() == [(old, False)]


def test_restart_adopts_running_replicas(tmp_path: Path, fx: Any) -> None:
    agents = FakeAgents()
    first = make_world(tmp_path, fx, agents)
    create_tiny(first, fx)
    first.tick(3)
    version = first.table().version
    first.components.store.close()
    calls = len(agents.calls)

    second = make_world(tmp_path, fx, agents)  # same database, same node-agent
    second.tick(3)
    assert second.table().version == version  # same content, same version
    new_calls = {m for m, _, _ in agents.calls[calls:]}
    assert new_calls == {"List"}  # nothing restarted, nothing probed again
    second.components.store.close()


def test_records_lost_replicas_are_adopted_not_restarted(tmp_path: Path, fx: Any) -> None:
    """A fresh database (no records) next to a running replica: the replica whose id and
    revision match the slot is adopted as serving."""
    agents = FakeAgents()
    first = make_world(tmp_path / "a", fx, agents)
    create_tiny(first, fx)
    first.tick(3)
    first.components.store.close()
    second = make_world(tmp_path / "b", fx, agents)
    create_tiny(second, fx)
    second.tick(2)
    assert agents.count("Start") == 1
    assert len(second.endpoints()) == 1
    second.components.store.close()


def test_unreachable_node_agent_is_retried_with_backoff(world: World, fx: Any) -> None:
    world.agents.down.add(ADDRESS)
    create_tiny(world, fx)
    world.tick(3)
    assert world.agents.count("List") == 1  # backed off for 1 s
    world.clock.advance(1.0)
    world.tick(3)
    assert world.agents.count("List") == 2  # then for 2 s
    world.clock.advance(1.0)
    world.tick()
    assert world.agents.count("List") == 2
    world.agents.down.clear()
    world.clock.advance(1.0)
    world.tick(3)
    assert len(world.endpoints()) == 1


def test_deleting_a_deployment_drains_and_stops_its_replicas(world: World, fx: Any) -> None:
    create_tiny(world, fx)
    world.tick(3)
    world.control.delete("kimi-tiny")
    world.tick()
    world.clock.advance(1.0)
    world.tick(2)
    assert world.agents.count("Drain") == 1 and world.agents.count("Stop") == 1
    assert world.agents.live() == {} and world.table().routes == []


def test_routing_hub_sends_the_full_table_first_then_changes() -> None:
    async def scenario() -> list[list[str]]:
        hub = RoutingHub()
        route = pb.ModelRoute(model="a", deployment="a")
        await hub.publish(make_table([route]))
        seen: list[list[str]] = []

        async def watch() -> None:
            async for table in hub.watch(("a",)):
                seen.append([r.model for r in table.routes])
                if len(seen) == 2:
                    return

        task = asyncio.create_task(watch())
        await asyncio.sleep(0)
        await hub.publish(make_table([route, pb.ModelRoute(model="b", deployment="b")]))  # not "a"
        await asyncio.sleep(0)
        changed = pb.ModelRoute(
            model="a", deployment="a", endpoints=[pb.RouteEndpoint(replica_id="r")]
        )
        await hub.publish(make_table([changed]))
        await asyncio.wait_for(task, 2)
        return seen

    assert asyncio.run(scenario()) == [["a"], ["a"]]
    assert (
        make_table([pb.ModelRoute(model="x")]).version
        == make_table([pb.ModelRoute(model="x")]).version
    )


def test_replica_ids_are_node_agent_safe() -> None:
    assert agent_replica_id("kimi-tiny-0", "0123456789abcdef") == "kimi-tiny-0-01234567"
    odd = agent_replica_id("Meta.Llama_3-0", "0123456789abcdef")
    assert odd.endswith("-01234567") and odd == odd.lower() and "." not in odd
    long = agent_replica_id("x" * 140 + "-0", "0123456789abcdef")
    assert len(long) <= 63
    assert agent_replica_id("x" * 140 + "-1", "ab") != agent_replica_id("x" * 140 + "-0", "ab")


def test_gate_verdict_and_percentile() -> None:
    from inferplane.orchestrator.catalog.model import RolloutStrategy

    strategy = RolloutStrategy(max_error_rate=0.05, max_ttft_p99_seconds=0.5)
    assert gate_verdict(strategy, GateReading(100, 5, 0.5)) == ""
    assert "TTFT p99 0.600 s > 0.5 s" in gate_verdict(strategy, GateReading(100, 0, 0.6))
    assert "no request" in gate_verdict(strategy, GateReading(0, 0, 0.0))
    assert p99([float(i) for i in range(1, 101)]) == 99.0


class SilentAgents(FakeAgents):
    """FakeAgents where `silent` addresses answer ListReplicas only after `silence_seconds`
    of real time: a node whose cable was pulled (no answer, no reset)."""

    def __init__(self, silence_seconds: float) -> None:
        super().__init__()
        self.silent: set[str] = set()
        self.silence_seconds = silence_seconds

    async def list_replicas(self, address: str) -> list[na.Replica]:
        if address in self.silent:
            await asyncio.sleep(self.silence_seconds)
        return await super().list_replicas(address)


def test_a_silent_node_holds_neither_the_tick_nor_the_routing_table(
    tmp_path: Path, fx: Any
) -> None:
    """A node-agent that stops answering (its network died: nothing resets the call) costs a
    reconcile tick at most `node_agent_observe_timeout_seconds`, while the other nodes are
    observed as usual; once the node is NotReady the next tick drops its replica from the
    routing table (issue 20: tests/multihost saw a lost node's replica listed 27 s after
    NotReady, the tick waiting out the 30 s control deadline on it)."""
    agents = SilentAgents(silence_seconds=3.0)
    world = make_world(
        tmp_path, fx, agents, settings_overrides={"node_agent_observe_timeout_seconds": 0.3}
    )
    silent = "127.0.0.2:50052"
    other = fx.cpu_status("cpu-b")
    other.address = silent
    world.control.register_node(node_from_status(other))
    proto = fx.tiny_cpu_proto()
    proto.replicas = 2
    world.control.create(deployment_from_proto(proto, "kimi-tiny"))
    world.tick(3)
    table = world.table().routes[0].endpoints
    assert sorted(e.address for e in table) == [ADDRESS, silent], table

    agents.silent.add(silent)
    started = time.monotonic()
    world.tick()
    assert time.monotonic() - started < 2.0, "the tick waited for the silent node"
    assert len(world.endpoints()) == 2  # not NotReady yet: still listed, as before

    # Its heartbeats stopped too: NotReady after missed_heartbeats intervals; cpu-a beats on.
    world.clock.advance(31.0)
    world.control.heartbeat(node_from_status(fx.cpu_status("cpu-a")))
    assert world.control.sweep() == ["cpu-b"]
    started = time.monotonic()
    world.tick()
    assert time.monotonic() - started < 2.0
    assert [e.address for e in world.table().routes[0].endpoints] == [ADDRESS]

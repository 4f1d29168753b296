"""The release pipeline's canary stage (issue 30) in the reconcile loop, against fake
node-agents, fake telemetry by revision and the in-memory compatibility matrix on a fake clock
(the fakes and the `World` are in `release_world.py`; the gates before it in
`test_release_pipeline.py`).

Invariants: a canary serves its share beside the stable revision, then is promoted on good
figures (shares removed, the old replica drained) or rolled back on a worse error rate; too few
canary requests extend the window three times, then roll back; the candidates run on top of the
stable replicas (their number follows scaling) and a restarted orchestrator resumes the window.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.app import build_components
from inferplane.orchestrator.catalog.model import RolloutStrategy
from inferplane.orchestrator.convert import deployment_from_proto
from inferplane.orchestrator.release import canary
from inferplane.orchestrator.release.gate import GateReading
from inferplane.orchestrator.release.spec import agent_replica_id
from inferplane.orchestrator.routing import revision_shares

from .release_world import PassingProbes, World, new_revision, serve_first


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

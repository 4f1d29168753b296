"""The release pipeline (issue 30) in the reconcile loop, against fake node-agents, a fake
performance gate, fake telemetry by revision and the in-memory compatibility matrix (no
processes, no sleeps: the clock is fake and ticks are called one by one; the fakes and the
`World` are in `release_world.py`, the canary stage in `test_release_canary.py`).

Invariants: a candidate qualifies on a replica that takes no live traffic (in the table, its
revision without a share); a failed conformance or performance gate rolls back with its verdict
in status and in the matrix; without a canary a qualified candidate is promoted and the matrix
says "qualified"; a combination the matrix already qualified skips conformance; bad canary and
gate settings name their field.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
from typer.testing import CliRunner

from inferplane.api.nodeagent.v1 import replica_pb2 as rp
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator import cli
from inferplane.orchestrator.convert import deployment_from_proto
from inferplane.orchestrator.release.spec import agent_replica_id
from inferplane.runtime import InvalidArgumentError

from .release_world import ARTIFACTS, S, World, new_revision, serve_first


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

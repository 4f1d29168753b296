"""The qualifying gates of a release (issue 30) and the ports they use.

A candidate revision's first replica is qualified while it takes no live traffic (in the routing
table with no revision share): the conformance gate (`RunConformance` on the replica, scored by
`inferplane.conformance.score` against the profile's `ReleaseGates`) unless
`release_gates.conformance` is explicitly false, then the performance gate (`PerformanceGate`,
GuideLLM through the edge pinned to each revision: release/performance.py) when
`release_gates.performance` is set. Each gate gives one `GateVerdict` (gate, result "passed" /
"failed" / "error", a reason with the numbers, seconds, measurements); "error" (the gate could
not run) stops the release as "failed" does.

The compatibility matrix (`Matrix`, release/matrix.py) records every decided combination. A
combination the matrix already holds as "qualified" with a passed conformance verdict skips
the conformance gate (the verdict is kept, reason "already qualified ..."): the same weights,
chat template, parsers and engine version give the same replay and the same parse path; the
performance gate and the canary still run, as they compare against what serves now.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

import grpc
from google.protobuf import timestamp_pb2

from inferplane import conformance
from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import DeploymentProfile
from inferplane.orchestrator.release import matrix as matrix_verdicts
from inferplane.orchestrator.release.agents import NodeAgents
from inferplane.orchestrator.release.progress import ERROR, FAILED, PASSED

CONFORMANCE = "conformance"
PERFORMANCE = "performance"
CANARY = "canary"
#: CompatibilityEntry.verdict values (orchestrator.proto), defined by the matrix.
QUALIFIED = matrix_verdicts.QUALIFIED
NOT_QUALIFIED = matrix_verdicts.FAILED


class PerformanceGate(Protocol):
    """Benchmarks `candidate_revision` against `serving_revision` of one deployment (both
    reached through the edge pinned to their revision) and judges the candidate by `gates`'
    allowed regressions. Returns a `GateVerdict` with gate "performance"; errors inside the
    run are a verdict with result "error", not an exception."""

    async def compare(
        self,
        deployment_id: str,
        model: str,
        candidate_revision: str,
        serving_revision: str,
        gates: pb.ReleaseGates,
    ) -> pb.GateVerdict: ...


class Matrix(Protocol):
    """The compatibility matrix (release/matrix.py `CompatibilityMatrix`): one verdict per
    combination of `ReplicaArtifacts`; sync calls (a small database write/read)."""

    def record(self, entry: pb.CompatibilityEntry) -> None: ...

    def lookup(self, artifacts: replica_pb2.ReplicaArtifacts) -> pb.CompatibilityEntry | None: ...


def release_gates(profile: DeploymentProfile) -> pb.ReleaseGates:
    """The profile's `ReleaseGates` (its set fields; the others read as 0: their defaults)."""
    return pb.ReleaseGates(**dict(profile.release_gates))


def conformance_on(gates: pb.ReleaseGates) -> bool:
    """Conformance runs unless `conformance` is explicitly false."""
    return not gates.HasField("conformance") or gates.conformance


def verdict(
    gate: str,
    result: str,
    reason: str,
    *,
    revision: str,
    seconds: float,
    now: datetime,
    measurements: Mapping[str, float] | None = None,
) -> pb.GateVerdict:
    """One `GateVerdict` decided at `now` (timezone-aware)."""
    decided = timestamp_pb2.Timestamp()
    decided.FromDatetime(now)
    return pb.GateVerdict(
        gate=gate,
        result=result,
        reason=reason,
        seconds=round(seconds, 3),
        decide_time=decided,
        measurements=dict(measurements or {}),
        revision=revision,
    )


def conformance_seed(revision: str) -> int:
    """The live requests' seed: the revision's hash as a number (a revision is 16 hex digits),
    so a rerun on the same revision sends the same requests."""
    try:
        return int(revision[:16], 16)
    except ValueError:
        return 0


def conformance_measurements(report: replica_pb2.ConformanceReport) -> dict[str, float]:
    return {
        "replay_pass_rate": conformance.replay_pass_rate(report),
        "replay_cases": float(report.replay_cases),
        "tool_call_rate": conformance.tool_call_rate(report),
        "schema_valid_rate": conformance.schema_valid_rate(report),
        "tool_calls": float(report.tool_calls),
        "leaked_markers": float(report.leaked_markers),
        "finish_reason_mismatches": float(report.finish_reason_mismatches),
        "reasoning_unseparated": float(report.reasoning_unseparated),
        "live_requests": float(report.live_requests),
        "live_errors": float(report.live_errors),
        "run_seconds": report.seconds,
    }


async def run_conformance(
    agents: NodeAgents,
    address: str,
    gates: pb.ReleaseGates,
    *,
    revision: str,
    now: datetime,
) -> tuple[pb.GateVerdict, replica_pb2.ConformanceReport | None]:
    """The conformance gate on the replica process at `address`: `RunConformance` with the
    profile's live requests (0: `conformance.DEFAULT_LIVE_REQUESTS`) and bound (0:
    `conformance.DEFAULT_TIMEOUT_SECONDS`), scored by `conformance.score`. A call that fails
    (or thresholds out of range) is a verdict "error" and no report."""
    started = time.monotonic()
    timeout = float(gates.conformance_timeout_seconds or conformance.DEFAULT_TIMEOUT_SECONDS)
    live = gates.conformance_live_requests or conformance.DEFAULT_LIVE_REQUESTS
    try:
        report = await agents.conformance(
            address, live_requests=live, timeout_seconds=timeout, seed=conformance_seed(revision)
        )
        passed, reason = conformance.score(report, gates)
    except grpc.aio.AioRpcError as exc:  # refused or failed: the gate could not run
        problem = f"{exc.code().name}: {exc.details()}"
    except Exception as exc:  # a fake's error, or thresholds out of range (ValueError)
        problem = str(exc) or type(exc).__name__
    else:
        return (
            verdict(
                CONFORMANCE,
                PASSED if passed else FAILED,
                reason,
                revision=revision,
                seconds=time.monotonic() - started,
                now=now,
                measurements=conformance_measurements(report),
            ),
            report,
        )
    return (
        verdict(
            CONFORMANCE,
            ERROR,
            f"conformance could not run on {address}: {problem}",
            revision=revision,
            seconds=time.monotonic() - started,
            now=now,
        ),
        None,
    )


def already_qualified(
    matrix: Matrix | None, artifacts: replica_pb2.ReplicaArtifacts | None
) -> pb.CompatibilityEntry | None:
    """The matrix's "qualified" entry for these artifacts with a passed conformance verdict
    (None: no matrix, artifacts unknown, or no such entry)."""
    if matrix is None or artifacts is None or not artifacts.engine_version:
        return None
    entry = matrix.lookup(artifacts)
    if entry is None or entry.verdict != QUALIFIED:
        return None
    if not any(g.gate == CONFORMANCE and g.result == PASSED for g in entry.gates):
        return None
    return entry


def combination_verdict(
    matrix: Matrix | None,
    artifacts: replica_pb2.ReplicaArtifacts,
    verdicts: list[pb.GateVerdict],
    decided: str,
) -> str:
    """The verdict a release records for its combination (weights, template, parsers, engine):
    `decided` (QUALIFIED / NOT_QUALIFIED from the gates), except that a failure the
    combination is not to blame for keeps the combination's recorded verdict. That is a
    release whose conformance did not fail but whose performance or canary gate did, on a
    combination the matrix already holds as qualified or unqualified (another revision
    served it): the profile failed (`max_num_seqs: 1`), not the engine and weights, and a
    "failed" row would refuse every later create of a combination that serves fine. A
    failed conformance gate, or any failure of a combination new to the matrix (an engine
    upgrade slower than the engine it replaces), marks the combination failed."""
    if decided != NOT_QUALIFIED or matrix is None:
        return decided
    if any(v.gate == CONFORMANCE and v.result != PASSED for v in verdicts):
        return decided
    known = matrix.lookup(artifacts)
    if known is None or known.verdict == NOT_QUALIFIED:
        return decided
    return known.verdict


async def run_performance(
    gate: PerformanceGate | None,
    deployment_id: str,
    model: str,
    candidate: str,
    serving: str,
    gates: pb.ReleaseGates,
    *,
    now: datetime,
) -> pb.GateVerdict:
    """The performance gate through the injected port; no port: a verdict "error" ("no
    benchmark runner configured"); an exception from the port: "error" with its text."""
    started = time.monotonic()
    if gate is None:
        return verdict(
            PERFORMANCE,
            ERROR,
            "error: no benchmark runner configured (the orchestrator's benchmark edge URL and "
            "API key settings); the profile asks for release_gates.performance",
            revision=candidate,
            seconds=0.0,
            now=now,
        )
    try:
        result = await gate.compare(deployment_id, model, candidate, serving, gates)
    except Exception as exc:
        return verdict(
            PERFORMANCE,
            ERROR,
            f"performance gate failed to run: {exc!r}",
            revision=candidate,
            seconds=time.monotonic() - started,
            now=now,
        )
    out = pb.GateVerdict()
    out.CopyFrom(result)
    out.gate = PERFORMANCE
    out.revision = out.revision or candidate
    if not out.seconds:
        out.seconds = round(time.monotonic() - started, 3)
    if not out.HasField("decide_time"):
        out.decide_time.FromDatetime(now)
    return out

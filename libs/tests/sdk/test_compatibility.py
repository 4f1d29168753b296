"""The compatibility matrix through the SDK against a real orchestrator (mTLS, the operator's
identity), blocking and asyncio: `deployments.list_compatibility` (filters, lazy pages),
`deployments.list_forced_changes`, and `force` / `force_reason` on create and update."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.orchestrator.release.matrix import CompatibilityMatrix
from inferplane.orchestrator.settings import OrchestratorSettings
from inferplane.runtime.security.identity import NODE_AGENT
from inferplane.sdk import AsyncClient, Client, InvalidArgumentError
from inferplane.sdk import _methods as m

SOURCE = "meta-llama/Llama-3.1-8B-Instruct"  # fx.llama8b's model source, no parsers


def artifacts(version: str) -> replica_pb2.ReplicaArtifacts:
    return replica_pb2.ReplicaArtifacts(
        engine="vllm",
        engine_version=version,
        model_digest="sha256:llama",
        chat_template_digest="sha256:template",
        parser="/",
    )


def matrix_of(tmp_path: Path) -> CompatibilityMatrix:
    """The SDK fixture orchestrator's matrix (its SQLite database under tmp_path)."""
    url = OrchestratorSettings(data_dir=tmp_path / "orchestrator").resolved_database_url
    return CompatibilityMatrix(create_engine(url))


def record(matrix: CompatibilityMatrix, verdict: str, version: str) -> None:
    matrix.record(
        pb.CompatibilityEntry(
            artifacts=artifacts(version),
            verdict=verdict,
            gates=[pb.GateVerdict(gate="performance", result="failed", reason="ttft p99 +40%")],
            deployment="measured",
            revision="r1",
        )
    )


def report_replica(pki: Any, orchestrator: str, version: str) -> None:
    """A node registering with one ready replica of SOURCE (unpinned) that reports artifacts."""
    status = nodeagent_pb2.NodeStatus(
        node="gpu-a",
        address="127.0.0.1:9",
        gpus=[
            nodeagent_pb2.Gpu(
                index=i, uuid=f"GPU-{i}", model="NVIDIA H100", memory_bytes=80 * 10**9, healthy=True
            )
            for i in range(2)
        ],
        cpu_count=64,
        memory_bytes=512 * 10**9,
        agent_version="test",
        engines=[
            nodeagent_pb2.EngineInstall(
                engine="vllm", version=v, location=f"/engines/{v}", default=v == version
            )
            for v in ("0.32.0", "0.31.0")
        ],
        replicas=[
            nodeagent_pb2.Replica(
                name="replicas/earlier-0",
                state=nodeagent_pb2.Replica.STATE_READY,
                spec=nodeagent_pb2.ReplicaSpec(
                    deployment="earlier", revision="r0", model_source=SOURCE
                ),
                artifacts=artifacts(version),
            )
        ],
    )
    with pki.security(NODE_AGENT).channel(orchestrator) as channel:
        orchestrator_pb2_grpc.NodeServiceStub(channel).RegisterNode(
            pb.RegisterNodeRequest(status=status), timeout=10
        )


def test_force_needs_a_reason_and_is_audited(
    client: Client, pki: Any, orchestrator: str, fx: Any, tmp_path: Path
) -> None:
    report_replica(pki, orchestrator, "0.32.0")
    matrix = matrix_of(tmp_path)
    record(matrix, "failed", "0.32.0")
    record(matrix, "qualified", "0.31.0")
    deployments = client.deployments
    with pytest.raises(InvalidArgumentError) as refused:
        deployments.create("llama", fx.llama8b())
    assert refused.value.param == "deployment.profile.model_source"
    assert "ttft p99 +40%" in refused.value.message
    with pytest.raises(InvalidArgumentError) as no_reason:
        deployments.create("llama", fx.llama8b(), force=True)
    assert no_reason.value.param == "force_reason"
    deployments.create("llama", fx.llama8b(), force=True, force_reason="known regression")
    (change,) = deployments.list_forced_changes("llama")
    assert (change.deployment, change.actor, change.reason) == (
        "llama",
        "admin",  # the operator's certificate identity
        "known regression",
    )
    assert deployments.list_forced_changes("deployments/other") == ()

    entries = list(deployments.list_compatibility(page_size=1))  # two pages, lazily
    assert [(e.artifacts.engine_version, e.verdict) for e in entries] == [
        ("0.31.0", "qualified"),
        ("0.32.0", "failed"),
    ]
    failed = list(deployments.list_compatibility(verdict="failed", deployment="measured"))
    assert [e.artifacts.engine_version for e in failed] == ["0.32.0"]
    assert list(deployments.list_compatibility(engine_version="0.30.0")) == []
    with pytest.raises(InvalidArgumentError) as bad:
        list(deployments.list_compatibility(verdict="maybe"))
    assert bad.value.param == "verdict"
    assert m.LIST_COMPATIBILITY.retry and m.LIST_FORCED_CHANGES.retry  # reads
    matrix.close()


def test_async_update_with_force(pki: Any, orchestrator: str, fx: Any, tmp_path: Path) -> None:
    report_replica(pki, orchestrator, "0.32.0")
    matrix = matrix_of(tmp_path)

    async def scenario() -> None:
        async with AsyncClient(orchestrator=orchestrator, security=pki.security()) as c:
            await c.deployments.create("llama", fx.llama8b())  # no verdict yet: allowed
            record(matrix, "failed", "0.31.0")
            pinned = pb.Deployment(
                name="llama", profile=pb.DeploymentProfile(engine_version="0.31.0")
            )
            with pytest.raises(InvalidArgumentError) as refused:
                await c.deployments.update(pinned, ["profile.engine_version"])
            assert refused.value.param == "deployment.profile.engine_version"
            await c.deployments.update(
                pinned, ["profile.engine_version"], force=True, force_reason="pin for rollback"
            )
            (change,) = await c.deployments.list_forced_changes()
            assert (change.reason, change.actor) == ("pin for rollback", "admin")
            pages = [e async for e in c.deployments.list_compatibility(verdict="failed")]
            assert [e.artifacts.engine_version for e in pages] == ["0.31.0"]

    asyncio.run(scenario())
    matrix.close()

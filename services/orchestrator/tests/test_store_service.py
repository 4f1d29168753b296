"""The orchestrator service on its SQL databases (SQLite always, PostgreSQL when
`INFERPLANE_TEST_POSTGRES_URL` is set; the stores themselves are in `test_store.py`).

Invariants: the service keeps its state across a restart on PostgreSQL as on SQLite; a value a
column cannot hold (too long, a NUL) is INVALID_ARGUMENT naming the field on every database,
values at the limit are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import MAX_OWNED_BY
from inferplane.orchestrator.fleet.model import MAX_AGENT_VERSION, MAX_NODE_ADDRESS, MAX_NODE_NAME
from inferplane.testing.clock import FakeClock

from .store_data import POSTGRES_URL, UINT32_MAX, drop_orchestrator_tables


@pytest.mark.skipif(
    not POSTGRES_URL,
    reason="set INFERPLANE_TEST_POSTGRES_URL to run the orchestrator service on PostgreSQL",
)
def test_service_keeps_its_state_across_a_restart_on_postgresql(tmp_path: Path, fx: Any) -> None:
    drop_orchestrator_tables(POSTGRES_URL)
    settings = fx.make_settings(tmp_path, database_url=POSTGRES_URL, reconcile=False)
    clock = FakeClock()
    request = pb.CreateDeploymentRequest(
        deployment_id="Llama-8B",
        deployment=fx.llama8b_proto(
            replicas=3, max_replicas=UINT32_MAX, aliases=["meta-llama/Llama-3.1-8B-Instruct"]
        ),
    )

    def state(orch: Any) -> tuple[Any, ...]:
        return (
            orch.deployments.GetDeployment(
                pb.GetDeploymentRequest(name="deployments/meta-llama/Llama-3.1-8B-Instruct"),
                timeout=10,
            ),
            orch.deployments.ListDeploymentReplicas(
                pb.ListDeploymentReplicasRequest(parent="deployments/Llama-8B"), timeout=10
            ),
            orch.nodes.ListNodes(pb.ListNodesRequest(), timeout=10),
        )

    with fx.running(settings, clock) as orch:
        for name in ("gpu-a", "gpu-b"):
            orch.nodes.RegisterNode(
                pb.RegisterNodeRequest(status=fx.gpu_status(name, gpus=2)), timeout=10
            )
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("cpu-c")), timeout=10)
        orch.nodes.DrainNode(pb.DrainNodeRequest(name="nodes/gpu-b"), timeout=10)
        created = orch.deployments.CreateDeployment(request, timeout=10).deployment
        clock.advance(0.000123)
        orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id="tiny", deployment=fx.tiny_cpu_proto()),
            timeout=10,
        )
        before = state(orch)
        placements = before[1].placements
        assert created.status.phase != "Unplaceable"
        assert [p.node for p in placements] == ["gpu-a"] * 3  # gpu-b is drained
        gpus = [i for p in placements for i in p.gpu_indices]
        assert len(gpus) > len(set(gpus))  # two replicas share one GPU
        assert all(0 < p.memory_fraction < 0.5 for p in placements)
    assert not list(tmp_path.glob("orchestrator.db*"))  # it ran on PostgreSQL, not SQLite

    clock.advance(3600)
    with fx.running(settings, clock) as orch:
        assert state(orch) == before
        assert orch.components.control.sweep() == []  # nodes get a fresh heartbeat timeout


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_values_a_column_cannot_hold_are_refused_alike(
    database: str, tmp_path: Path, fx: Any
) -> None:
    """A node name, address or agent version, or a deployment owner, longer than its column or
    with a NUL character is INVALID_ARGUMENT naming the field on every database (SQLite kept
    it; PostgreSQL refused it and the call failed with INTERNAL); values at the limit are
    kept."""
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'orchestrator.db'}"
    elif not POSTGRES_URL:
        pytest.skip("set INFERPLANE_TEST_POSTGRES_URL to run the service on PostgreSQL")
    else:
        url = POSTGRES_URL
        drop_orchestrator_tables(url)
    settings = fx.make_settings(tmp_path, database_url=url, reconcile=False)

    def refused(call: Callable[[str], Any], value: str, field: str, limit: int) -> None:
        with pytest.raises(grpc.RpcError) as info:
            call(value)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        if "\x00" in value:
            assert info.value.details() == f"{field} must not contain NUL characters"
        else:
            assert info.value.details().startswith(f"{field} must be at most {limit} characters")

    with fx.running(settings, FakeClock()) as orch:

        def register(**changes: str) -> Any:
            status = fx.gpu_status("gpu-a")
            for name, value in changes.items():
                setattr(status, name, value)
            return orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=status), timeout=10)

        def heartbeat(**changes: str) -> Any:
            status = fx.gpu_status("gpu-a")
            for name, value in changes.items():
                setattr(status, name, value)
            beats = iter([pb.StreamHeartbeatsRequest(status=status)])
            return list(orch.nodes.StreamHeartbeats(beats, timeout=10))

        limits = (
            ("node", MAX_NODE_NAME),
            ("address", MAX_NODE_ADDRESS),
            ("agent_version", MAX_AGENT_VERSION),
        )
        for field, limit in limits:
            too_long = "x" * (limit + 1)
            refused(lambda v, f=field: register(**{f: v}), too_long, f"status.{field}", limit)
            refused(lambda v, f=field: heartbeat(**{f: v}), too_long, f"status.{field}", limit)
            refused(lambda v, f=field: register(**{f: v}), "a\x00b", f"status.{field}", limit)
            register(**{field: "x" * limit})
        heartbeat(address="y" * MAX_NODE_ADDRESS, agent_version="y" * MAX_AGENT_VERSION)

        def create(owned_by: str) -> Any:
            deployment = fx.llama8b_proto(owned_by=owned_by)
            request = pb.CreateDeploymentRequest(deployment_id="m", deployment=deployment)
            return orch.deployments.CreateDeployment(request, timeout=10)

        def set_owner(owned_by: str) -> Any:
            request = pb.UpdateDeploymentRequest(
                deployment=pb.Deployment(name="deployments/m", owned_by=owned_by),
                update_mask=field_mask_pb2.FieldMask(paths=["owned_by"]),
            )
            return orch.deployments.UpdateDeployment(request, timeout=10)

        refused(create, "o" * (MAX_OWNED_BY + 1), "owned_by", MAX_OWNED_BY)
        create("o" * MAX_OWNED_BY)
        refused(set_owner, "p" * (MAX_OWNED_BY + 1), "owned_by", MAX_OWNED_BY)
        refused(set_owner, "acme\x00", "owned_by", MAX_OWNED_BY)
        nodes = {n.name for n in orch.components.store.load().nodes}
    assert nodes == {"gpu-a", "x" * MAX_NODE_NAME}
    with fx.running(settings, FakeClock()) as orch:
        got = orch.deployments.GetDeployment(pb.GetDeploymentRequest(name="deployments/m"))
        assert got.deployment.owned_by == "o" * MAX_OWNED_BY
        node = orch.nodes.GetNode(pb.GetNodeRequest(name="nodes/gpu-a"), timeout=10).node
        assert node.status.address == "y" * MAX_NODE_ADDRESS
        assert node.status.agent_version == "y" * MAX_AGENT_VERSION

"""DeploymentService and NodeService over real gRPC (in-process server, SQLite in a tmp dir):
CRUD, aliases, paging, update masks and revisions, errors with numbers, heartbeats and
NotReady re-placement, draining, and persistence across a restart."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.testing.clock import FakeClock

GB = 10**9


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> Any:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10, **kwargs)
    return info.value


def create(orch: Any, deployment_id: str, deployment: pb.Deployment, **kw: Any) -> pb.Deployment:
    response = orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id=deployment_id, deployment=deployment, **kw),
        timeout=10,
    )
    return response.deployment


def replicas(orch: Any, name: str) -> list[pb.Placement]:
    return list(
        orch.deployments.ListDeploymentReplicas(
            pb.ListDeploymentReplicasRequest(parent=f"deployments/{name}"), timeout=10
        ).placements
    )


def test_create_get_list_delete_with_aliases(orch: Any, fx: Any) -> None:
    for n in ("gpu-a", "gpu-b"):
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status(n)), timeout=10)
    created = create(
        orch, "llama-8b", fx.llama8b_proto(replicas=2, aliases=["meta-llama/Llama-3.1-8B"])
    )
    assert created.name == "deployments/llama-8b"
    assert created.status.phase == "Progressing"  # placed, no replica reported ready yet
    assert len(created.status.current_revision) == 16
    assert created.profile.engine == "vllm" and created.profile.tensor_parallel_size == 1
    got = orch.deployments.GetDeployment(
        pb.GetDeploymentRequest(name="deployments/meta-llama/Llama-3.1-8B"), timeout=10
    ).deployment
    assert got.name == "deployments/llama-8b"  # the alias resolves to the deployment
    assert sorted(p.node for p in replicas(orch, "llama-8b")) == ["gpu-a", "gpu-b"]  # spread

    for i in range(3):
        create(orch, f"m{i}", fx.llama8b_proto())
    first = orch.deployments.ListDeployments(pb.ListDeploymentsRequest(page_size=3), timeout=10)
    rest = orch.deployments.ListDeployments(
        pb.ListDeploymentsRequest(page_size=3, page_token=first.next_page_token), timeout=10
    )
    names = [d.name for d in (*first.deployments, *rest.deployments)]
    assert names == [f"deployments/{n}" for n in ("llama-8b", "m0", "m1", "m2")]
    assert rest.next_page_token == ""

    orch.deployments.DeleteDeployment(pb.DeleteDeploymentRequest(name="deployments/m0"))
    err = rpc_error(orch.deployments.GetDeployment, pb.GetDeploymentRequest(name="deployments/m0"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "deployments/m0 not found"


def test_duplicate_id_or_alias_is_already_exists(orch: Any, fx: Any) -> None:
    create(orch, "a", fx.llama8b_proto(aliases=["shared"]))
    err = rpc_error(
        orch.deployments.CreateDeployment,
        pb.CreateDeploymentRequest(
            deployment_id="b", deployment=fx.llama8b_proto(aliases=["shared"])
        ),
    )
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.details() == "alias 'shared' is already used by deployments/a"


def test_validate_only_previews_without_creating(orch: Any, fx: Any) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("g")), timeout=10)
    preview = create(orch, "x", fx.llama8b_proto(replicas=3), validate_only=True)
    assert preview.status.phase == "Progressing"
    assert preview.status.message == "3 of 3 replicas placed, 0 ready"
    err = rpc_error(orch.deployments.GetDeployment, pb.GetDeploymentRequest(name="deployments/x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_a_deployment_that_cannot_fit_the_fleet_fails_with_the_numbers(orch: Any, fx: Any) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("h100")), timeout=10)
    big = fx.llama8b_proto(
        profile={"parameter_count": 70_000_000_000, "precision": "fp16", "num_layers": 80}
    )
    err = rpc_error(
        orch.deployments.CreateDeployment,
        pb.CreateDeploymentRequest(deployment_id="llama-70b", deployment=big),
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("70B at fp16 needs 140 GB of weights + 21.5 GB KV budget")
    assert "the largest GPU group on one node offers 640 GB (8 × 80 GB on h100) but TP=1 " in (
        err.details()
    )
    bad = rpc_error(
        orch.deployments.CreateDeployment,
        pb.CreateDeploymentRequest(
            deployment_id="x", deployment=fx.llama8b_proto(profile={"precision": "fp4"})
        ),
    )
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(bad.trailing_metadata())["x-openai-error-param"] == "deployment.profile.precision"


def test_update_mask_changes_fields_and_a_profile_change_bumps_the_revision(
    orch: Any, fx: Any
) -> None:
    status = fx.gpu_status("g", versions=("0.32.0", "0.33.0"))  # the update's engine too
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=status), timeout=10)
    before = create(orch, "m", fx.llama8b_proto())
    update = pb.Deployment(name="deployments/m", replicas=3, owned_by="acme")
    after = orch.deployments.UpdateDeployment(
        pb.UpdateDeploymentRequest(
            deployment=update, update_mask=field_mask_pb2.FieldMask(paths=["replicas"])
        ),
        timeout=10,
    ).deployment
    assert (after.replicas, after.owned_by) == (3, "inferplane")  # owned_by not in the mask
    assert after.status.current_revision == before.status.current_revision
    assert len(replicas(orch, "m")) == 3

    update.profile.engine_version = "0.33.0"
    bumped = orch.deployments.UpdateDeployment(
        pb.UpdateDeploymentRequest(
            deployment=update,
            update_mask=field_mask_pb2.FieldMask(paths=["profile.engine_version"]),
        ),
        timeout=10,
    ).deployment
    assert bumped.profile.engine_version == "0.33.0"
    assert bumped.profile.precision == "bf16"  # the rest of the profile is untouched
    assert bumped.status.current_revision != before.status.current_revision
    err = rpc_error(
        orch.deployments.UpdateDeployment,
        pb.UpdateDeploymentRequest(
            deployment=update, update_mask=field_mask_pb2.FieldMask(paths=["status"])
        ),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("update_mask path 'status' is not updatable")


def test_explain_says_where_and_why(orch: Any, fx: Any) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("g", gpus=1)), timeout=10)
    create(orch, "m", fx.llama8b_proto(replicas=2))
    lines = orch.deployments.ExplainPlacement(
        pb.ExplainPlacementRequest(name="deployments/m"), timeout=10
    ).lines
    assert (
        lines[0].startswith("deployments/m (revision ")
        and "2 replicas wanted, 2 placed, 0 unplaced; each replica: 8.03B at bf16 needs "
        in lines[0]
    )
    # 16.06 GB weights + 8.59 GB KV + (2 GiB + 5 %) 3.38 GB overhead = 28.03 GB = 0.3503 × 80 GB
    assert lines[1] == (
        "m-0 → g GPU 0: 28 GB per GPU = 0.3503 of 80 GB (engine started with "
        "--gpu-memory-utilization 0.3503); best fit: the tightest chosen GPU had 80 GB free and "
        "keeps 52 GB; spread: 1st replica of m on g"
    )
    assert "spread: 1st replica of m on g" in lines[1]
    assert "had 52 GB free and keeps 23.9 GB; spread: 2nd replica of m on g" in lines[2]


def _beats(statuses: list[nodeagent_pb2.NodeStatus]) -> Iterator[pb.StreamHeartbeatsRequest]:
    for status in statuses:
        yield pb.StreamHeartbeatsRequest(status=status)


def test_missed_heartbeats_make_a_node_notready_and_its_replicas_move(orch: Any, fx: Any) -> None:
    registered = orch.nodes.RegisterNode(
        pb.RegisterNodeRequest(status=fx.gpu_status("a")), timeout=10
    )
    assert registered.heartbeat_interval_seconds == 10
    assert registered.node.condition == "Ready"
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("b")), timeout=10)
    create(orch, "m", fx.llama8b_proto(replicas=2))
    assert sorted(p.node for p in replicas(orch, "m")) == ["a", "b"]

    orch.clock.advance(25)  # 2.5 intervals: not late yet (3 missed heartbeats allowed)
    answers = list(orch.nodes.StreamHeartbeats(_beats([fx.gpu_status("b")]), timeout=10))
    assert [a.condition for a in answers] == ["Ready"]
    assert orch.components.control.sweep() == []
    orch.clock.advance(10)  # a: 35 s without a heartbeat > 30 s; b: 10 s
    assert orch.components.control.sweep() == ["a"]
    node_a = orch.nodes.GetNode(pb.GetNodeRequest(name="nodes/a"), timeout=10).node
    assert node_a.condition == "NotReady"
    assert [p.node for p in replicas(orch, "m")] == ["b", "b"]  # m-0 re-placed on b

    back = list(orch.nodes.StreamHeartbeats(_beats([fx.gpu_status("a")]), timeout=10))
    assert [a.condition for a in back] == ["Ready"]
    assert [p.node for p in replicas(orch, "m")] == ["b", "b"]  # no churn back


def test_heartbeats_with_only_usage_changes_do_not_replan(orch: Any, fx: Any) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status("a")), timeout=10)
    create(orch, "m", fx.llama8b_proto())
    plan_before = orch.components.control.placements()
    busy = fx.gpu_status("a")
    busy.gpus[0].memory_used_bytes = 30 * GB
    list(orch.nodes.StreamHeartbeats(_beats([busy, busy]), timeout=10))
    assert orch.components.control.placements() is plan_before
    sick = fx.gpu_status("a", unhealthy=(0,))
    list(orch.nodes.StreamHeartbeats(_beats([sick]), timeout=10))
    (placement,) = replicas(orch, "m")
    assert list(placement.gpu_indices) == [1]  # GPU 0 turned unhealthy: the replica moved


def test_drain_moves_replicas_and_reports_draining(orch: Any, fx: Any) -> None:
    for n in ("a", "b"):
        orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status(n)), timeout=10)
    create(orch, "m", fx.llama8b_proto(replicas=2))
    drained = orch.nodes.DrainNode(pb.DrainNodeRequest(name="nodes/a"), timeout=10).node
    assert (drained.condition, drained.unschedulable) == ("Draining", True)
    assert [p.node for p in replicas(orch, "m")] == ["b", "b"]
    answers = list(orch.nodes.StreamHeartbeats(_beats([fx.gpu_status("a")]), timeout=10))
    assert [a.condition for a in answers] == ["Draining"]
    listed = orch.nodes.ListNodes(pb.ListNodesRequest(), timeout=10).nodes
    assert [(n.name, n.condition) for n in listed] == [
        ("nodes/a", "Draining"),
        ("nodes/b", "Ready"),
    ]


def test_ready_replicas_come_from_heartbeats_and_cpu_nodes_host_the_fixture_model(
    orch: Any, fx: Any
) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("laptop")), timeout=10)
    created = create(orch, "kimi-tiny", fx.tiny_cpu_proto())
    (placement,) = replicas(orch, "kimi-tiny")
    assert (placement.replica_id, placement.node, list(placement.gpu_indices)) == (
        "kimi-tiny-0",
        "laptop",
        [],
    )
    assert created.status.phase == "Progressing"
    status = fx.cpu_status("laptop")
    status.replicas.append(
        nodeagent_pb2.Replica(name="replicas/kimi-tiny-0", state=nodeagent_pb2.Replica.STATE_READY)
    )
    list(orch.nodes.StreamHeartbeats(_beats([status]), timeout=10))
    got = orch.deployments.GetDeployment(
        pb.GetDeploymentRequest(name="deployments/kimi-tiny"), timeout=10
    ).deployment
    assert (got.status.phase, got.status.ready_replicas) == ("Available", 1)
    (placement,) = replicas(orch, "kimi-tiny")
    assert placement.replica.state == nodeagent_pb2.Replica.STATE_READY


def test_state_survives_a_restart_on_the_same_sqlite_file(tmp_path: Any, fx: Any) -> None:
    settings = fx.make_settings(tmp_path)
    clock = FakeClock()
    with fx.running(settings, clock) as orch:
        for n in ("a", "b"):
            orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.gpu_status(n)), timeout=10)
        orch.nodes.DrainNode(pb.DrainNodeRequest(name="nodes/b"), timeout=10)
        create(orch, "m", fx.llama8b_proto(replicas=3, aliases=["mm"]))
        before = (
            orch.deployments.GetDeployment(pb.GetDeploymentRequest(name="deployments/m")),
            replicas(orch, "m"),
        )
    assert (tmp_path / "orchestrator.db").exists()
    clock.advance(3600)  # a long outage: nodes get a fresh heartbeat timeout on start-up
    with fx.running(settings, clock) as orch:
        after = (
            orch.deployments.GetDeployment(pb.GetDeploymentRequest(name="deployments/mm")),
            replicas(orch, "m"),
        )
        assert after == before
        assert orch.components.control.sweep() == []
        node_b = orch.nodes.GetNode(pb.GetNodeRequest(name="nodes/b"), timeout=10).node
        assert (node_b.condition, node_b.unschedulable) == ("Draining", True)

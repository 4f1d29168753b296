"""ListDeploymentReplicas carries each placement's node-agent report (issue 21's console shows
a replica's health from it)."""

from __future__ import annotations

from typing import Any

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.release.spec import agent_replica_id


def test_a_placement_carries_the_report_of_its_revisioned_replica(orch: Any, fx: Any) -> None:
    """Node-agents name replicas `{slot}-{revision[:8]}` (make before break); the placement
    (named by slot) must still find its report, or every replica reads as unreported."""
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("laptop")), timeout=10)
    orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="kimi-tiny", deployment=fx.tiny_cpu_proto()),
        timeout=10,
    )
    request = pb.ListDeploymentReplicasRequest(parent="deployments/kimi-tiny")
    (placement,) = orch.deployments.ListDeploymentReplicas(request, timeout=10).placements
    assert not placement.HasField("replica")
    name = agent_replica_id(placement.replica_id, placement.revision)
    assert name != placement.replica_id
    status = fx.cpu_status("laptop")
    status.replicas.append(
        nodeagent_pb2.Replica(
            name=f"replicas/{name}", state=nodeagent_pb2.Replica.STATE_READY, restart_count=2
        )
    )
    list(orch.nodes.StreamHeartbeats(iter([pb.StreamHeartbeatsRequest(status=status)]), timeout=10))
    (placement,) = orch.deployments.ListDeploymentReplicas(request, timeout=10).placements
    assert placement.replica.state == nodeagent_pb2.Replica.STATE_READY
    assert placement.replica.restart_count == 2

"""inferplane.nodeagent.v1.NodeAgentService over the ReplicaManager (proto ⇄ domain only;
errors are raised as InferplaneError and mapped to status by the runtime's interceptor)."""

from __future__ import annotations

import re
from collections.abc import Callable

import grpc

from inferplane.api.nodeagent.v1 import nodeagent_pb2, nodeagent_pb2_grpc
from inferplane.node_agent.supervisor.manager import ReplicaManager
from inferplane.runtime import InvalidArgumentError

# Replica ids become path segments and directory names: keep them boring (RFC 1123 label).
_REPLICA_ID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DEFAULT_PAGE_SIZE = 100


def replica_id_from_name(name: str) -> str:
    """`replicas/{id}` → id. Raises InvalidArgumentError for anything else."""
    prefix, _, rid = name.partition("/")
    if prefix != "replicas" or not _REPLICA_ID.match(rid):
        raise InvalidArgumentError(f"name must be replicas/{{replica}}, got {name!r}", param="name")
    return rid


class NodeAgentServicer(nodeagent_pb2_grpc.NodeAgentServiceServicer):  # type: ignore[misc]
    """Starts, drains, stops and reports the replicas of this node.

    `node_status` builds the current NodeStatus (inventory + replicas). Each replica is
    reported with its replica process's own `inference_address` (issue 16).
    """

    def __init__(
        self,
        manager: ReplicaManager,
        node_status: Callable[[], nodeagent_pb2.NodeStatus],
    ) -> None:
        self._manager = manager
        self._node_status = node_status

    async def StartReplica(
        self, request: nodeagent_pb2.StartReplicaRequest, context: grpc.aio.ServicerContext
    ) -> nodeagent_pb2.StartReplicaResponse:
        if not _REPLICA_ID.match(request.replica_id):
            raise InvalidArgumentError(
                "replica_id must be lowercase letters, digits and '-' (max 63)",
                param="replica_id",
            )
        if not request.HasField("spec"):
            raise InvalidArgumentError("spec is required", param="spec")
        replica = await self._manager.start(request.replica_id, request.spec)
        return nodeagent_pb2.StartReplicaResponse(replica=replica.to_proto())

    async def DrainReplica(
        self, request: nodeagent_pb2.DrainReplicaRequest, context: grpc.aio.ServicerContext
    ) -> nodeagent_pb2.DrainReplicaResponse:
        rid = replica_id_from_name(request.name)
        grace = float(request.grace_period_seconds) if request.grace_period_seconds else None
        replica = await self._manager.drain(rid, grace)
        return nodeagent_pb2.DrainReplicaResponse(replica=replica.to_proto())

    async def StopReplica(
        self, request: nodeagent_pb2.StopReplicaRequest, context: grpc.aio.ServicerContext
    ) -> nodeagent_pb2.StopReplicaResponse:
        rid = replica_id_from_name(request.name)
        grace = float(request.grace_period_seconds) if request.grace_period_seconds else None
        replica = await self._manager.stop(rid, force=request.force, grace_seconds=grace)
        return nodeagent_pb2.StopReplicaResponse(replica=replica.to_proto())

    async def GetReplica(
        self, request: nodeagent_pb2.GetReplicaRequest, context: grpc.aio.ServicerContext
    ) -> nodeagent_pb2.GetReplicaResponse:
        replica = self._manager.get(replica_id_from_name(request.name))
        return nodeagent_pb2.GetReplicaResponse(replica=replica.to_proto())

    async def ListReplicas(
        self, request: nodeagent_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> nodeagent_pb2.ListReplicasResponse:
        size = request.page_size or _DEFAULT_PAGE_SIZE
        # The page token is the last id of the previous page (ids are listed in order).
        replicas = [r for r in self._manager.list() if r.replica_id > request.page_token]
        page = replicas[:size]
        more = len(replicas) > size
        return nodeagent_pb2.ListReplicasResponse(
            replicas=[r.to_proto() for r in page],
            next_page_token=page[-1].replica_id if more else "",
        )

    async def GetNodeStatus(
        self, request: nodeagent_pb2.GetNodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> nodeagent_pb2.GetNodeStatusResponse:
        return nodeagent_pb2.GetNodeStatusResponse(status=self._node_status())

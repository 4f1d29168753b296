"""`inferplane.nodeagent.v1.ReplicaProcessService`: the node-agent reads the replica's load and
drains it (proto/inferplane/nodeagent/v1/replica.proto)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.replica.state import Phase, ReplicaState


class ReplicaProcessServicer(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    """Load and drain of this process's replica.

    Args:
        state: the replica.
        drain: stops admission and turns health NOT_SERVING (idempotent).
    """

    def __init__(self, state: ReplicaState, drain: Callable[[], Awaitable[int]]) -> None:
        self._state = state
        self._drain = drain

    async def GetReplicaLoad(
        self, request: replica_pb2.GetReplicaLoadRequest, context: Any
    ) -> replica_pb2.GetReplicaLoadResponse:
        """Requests in flight, draining, engine ready."""
        state = self._state
        return replica_pb2.GetReplicaLoadResponse(
            replica_id=state.replica_id,
            in_flight_requests=state.in_flight,
            draining=state.phase is Phase.DRAINING,
            engine_ready=state.engine_ready,
        )

    async def StartReplicaDrain(
        self, request: replica_pb2.StartReplicaDrainRequest, context: Any
    ) -> replica_pb2.StartReplicaDrainResponse:
        """Stops admitting new requests; those in flight go on."""
        return replica_pb2.StartReplicaDrainResponse(in_flight_requests=await self._drain())

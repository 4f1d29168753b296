"""`inferplane.nodeagent.v1.ReplicaProcessService`: the node-agent reads the replica's load and
drains it; routers watch its engine state; the release runs its conformance checks
(proto/inferplane/nodeagent/v1/replica.proto)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.replica.server.conformance import ConformanceRunner
from inferplane.replica.server.continuation import Continuations
from inferplane.replica.server.state_stream import ReplicaStateStream
from inferplane.replica.state import Phase, ReplicaState
from inferplane.runtime import UnimplementedError


class ReplicaProcessServicer(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    """Load and drain of this process's replica, and its engine state for routers.

    Args:
        state: the replica.
        drain: stops admission and turns health NOT_SERVING (idempotent).
        state_stream: the engine state's producer (`server/state_stream.py`; None:
            WatchReplicaState is UNIMPLEMENTED).
        conformance: the conformance checks (`server/conformance.py`; None: RunConformance is
            UNIMPLEMENTED).
        artifacts: what the replica runs (`server/artifacts.py`), None while unknown; reported
            in GetReplicaLoad.
        continuations: continues siblings' streams (`server/continuation.py`; None:
            ContinueGeneration is UNIMPLEMENTED).
    """

    def __init__(
        self,
        state: ReplicaState,
        drain: Callable[[], Awaitable[int]],
        state_stream: ReplicaStateStream | None = None,
        conformance: ConformanceRunner | None = None,
        artifacts: Callable[[], replica_pb2.ReplicaArtifacts | None] = lambda: None,
        continuations: Continuations | None = None,
    ) -> None:
        self._continuations = continuations
        self._state = state
        self._drain = drain
        self._stream = state_stream
        self._conformance = conformance
        self._artifacts = artifacts

    async def GetReplicaLoad(
        self, request: replica_pb2.GetReplicaLoadRequest, context: Any
    ) -> replica_pb2.GetReplicaLoadResponse:
        """Requests in flight, draining, engine ready, and what the replica runs once known."""
        state = self._state
        return replica_pb2.GetReplicaLoadResponse(
            replica_id=state.replica_id,
            in_flight_requests=state.in_flight,
            # A dead engine's process still serving streams it moved to siblings drains them.
            draining=state.phase is Phase.DRAINING
            or (state.phase is Phase.DEAD and state.in_flight > 0),
            engine_ready=state.engine_ready,
            artifacts=self._artifacts(),
        )

    async def StartReplicaDrain(
        self, request: replica_pb2.StartReplicaDrainRequest, context: Any
    ) -> replica_pb2.StartReplicaDrainResponse:
        """Stops admitting new requests; those in flight go on."""
        return replica_pb2.StartReplicaDrainResponse(in_flight_requests=await self._drain())

    async def WatchReplicaState(
        self, request: replica_pb2.WatchReplicaStateRequest, context: Any
    ) -> AsyncIterator[replica_pb2.WatchReplicaStateResponse]:
        """A snapshot of the engine's state, then its changes (`ReplicaStateStream.watch`).

        Raises:
            UnimplementedError: this process has no state stream.
            ResourceExhaustedError: the router fell behind (code `replica_state_behind`).
        """
        if self._stream is None:
            raise UnimplementedError("this replica process does not stream its engine state")
        async for update in self._stream.watch(request.router_id):
            yield update

    async def RunConformance(
        self, request: replica_pb2.RunConformanceRequest, context: Any
    ) -> replica_pb2.RunConformanceResponse:
        """The conformance checks on this replica (`ConformanceRunner.run`), bounded by the
        request's `timeout_seconds`.

        Raises:
            UnimplementedError: this process has no conformance runner.
            InvalidArgumentError, FailedPreconditionError: see `ConformanceRunner.run`.
        """
        if self._conformance is None:
            raise UnimplementedError("this replica process does not run conformance checks")
        return replica_pb2.RunConformanceResponse(report=await self._conformance.run(request))

    async def ContinueGeneration(
        self, request: replica_pb2.ContinueGenerationRequest, context: Any
    ) -> AsyncIterator[replica_pb2.ContinueGenerationResponse]:
        """A sibling's stream continued on this replica's engine (`Continuations.serve`).

        Raises:
            UnimplementedError: this process continues no streams.
            FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError,
            UnavailableError: see `Continuations.serve`.
        """
        if self._continuations is None:
            raise UnimplementedError("this replica process does not continue streams")
        async for message in self._continuations.serve(request):
            yield message

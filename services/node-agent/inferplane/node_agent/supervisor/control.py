"""The supervisor's control client of a replica process: gRPC health and
`nodeagent.v1.ReplicaProcessService` (`GetReplicaLoad`, `StartReplicaDrain`) on the replica
process's own port. This and the process group are all the node-agent knows of a replica
process: no import of its code, so a node-agent upgraded while replicas run still supervises
them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.runtime.security.identity import NODE_AGENT, PeerSecurity

INFERENCE_SERVICE = "inferplane.inference.v1.InferenceService"
"""The gRPC health service name a replica process reports SERVING once its engine is ready."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica process's `GetReplicaLoad` answer: generation requests admitted and not yet
    ended, whether it is draining (admits nothing new), whether its engine is ready, and what
    it runs (`artifacts`, once its engine is ready; None before, or from a process that does
    not report them)."""

    in_flight_requests: int
    draining: bool
    engine_ready: bool
    artifacts: replica_pb2.ReplicaArtifacts | None = None


class ReplicaControlError(Exception):
    """The replica process did not answer a control call (unreachable, timed out, failed)."""


class ReplicaControl(Protocol):
    """The supervisor's connection to one replica process (`ReplicaProcessClient`; tests
    substitute in-memory ones)."""

    async def healthy(self) -> bool:
        """True when its gRPC health says SERVING (engine ready, not draining); False
        otherwise, including when it does not answer."""
        ...

    async def load(self) -> ReplicaLoad:
        """`GetReplicaLoad`. Raises ReplicaControlError when it does not answer."""
        ...

    async def start_drain(self) -> int:
        """`StartReplicaDrain` (idempotent); returns the requests in flight when it started.
        Raises ReplicaControlError when it does not answer."""
        ...

    async def close(self) -> None:
        """Closes the connection."""
        ...


class ReplicaProcessClient:
    """`ReplicaControl` over grpc.aio: gRPC health (service
    `inferplane.inference.v1.InferenceService`) and `nodeagent.v1.ReplicaProcessService` at
    the replica process's `address` (host:port); every call bounded by `timeout_seconds`.
    Create it on the event loop that uses it."""

    def __init__(
        self,
        address: str,
        *,
        timeout_seconds: float = 5.0,
        security: PeerSecurity | None = None,
    ) -> None:
        self.address = address
        self._timeout = timeout_seconds
        security = security or PeerSecurity.plaintext()
        # A replica process presents its node-agent's identity, at an address of this node.
        self._channel = security.aio_channel(address, security.server_options(NODE_AGENT))
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._control = replica_pb2_grpc.ReplicaProcessServiceStub(self._channel)

    async def healthy(self) -> bool:
        try:
            answer = await self._health.Check(
                health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=self._timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    async def load(self) -> ReplicaLoad:
        try:
            answer = await self._control.GetReplicaLoad(
                replica_pb2.GetReplicaLoadRequest(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise ReplicaControlError(
                f"GetReplicaLoad at {self.address}: {exc.code().name} {exc.details()}"
            ) from exc
        return ReplicaLoad(
            in_flight_requests=answer.in_flight_requests,
            draining=answer.draining,
            engine_ready=answer.engine_ready,
            artifacts=answer.artifacts if answer.HasField("artifacts") else None,
        )

    async def start_drain(self) -> int:
        try:
            answer = await self._control.StartReplicaDrain(
                replica_pb2.StartReplicaDrainRequest(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise ReplicaControlError(
                f"StartReplicaDrain at {self.address}: {exc.code().name} {exc.details()}"
            ) from exc
        return int(answer.in_flight_requests)

    async def close(self) -> None:
        await self._channel.close(grace=None)


ClientFactory = Callable[[str], ReplicaControl]
"""Makes the control client of a started replica process from `LaunchPlan.inference_address`."""

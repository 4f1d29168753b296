"""How the node-agent's control side is assembled; called from `app.build_app`.

parts = build_node_agent(settings)
App(..., servicers=[ServicerBinding("inferplane.nodeagent.v1.NodeAgentService",
                                    parts.servicer, add_NodeAgentServiceServicer_to_server),
                    ...InferenceService(directory=parts.manager)...],
    start=parts.start, drain=parts.drain, stop=parts.stop)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.agent.node import Inventory, probe_inventory
from inferplane.node_agent.agent.registration import Registrar
from inferplane.node_agent.agent.servicer import NodeAgentServicer
from inferplane.node_agent.engine.process import LAUNCHER_COMMAND, Spawner
from inferplane.node_agent.engine.supervisor import (
    ClientFactory,
    Clock,
    ReplicaManager,
    SupervisorConfig,
    SystemClock,
)
from inferplane.node_agent.settings import NodeAgentSettings

log = structlog.get_logger("inferplane.node_agent")

AGENT_VERSION = "0.1.0"


def supervisor_config(settings: NodeAgentSettings) -> SupervisorConfig:
    """The supervisor's knobs from the node-agent's settings."""
    return SupervisorConfig(
        data_dir=settings.data_dir.resolve(),
        engine_command=settings.engine_command or LAUNCHER_COMMAND,
        host="127.0.0.1",
        startup_timeout_seconds=settings.engine_startup_timeout_seconds,
        health_interval_seconds=settings.engine_health_interval_seconds,
        max_start_attempts=settings.engine_max_start_attempts,
        backoff_initial_seconds=settings.engine_backoff_initial_seconds,
        backoff_max_seconds=settings.engine_backoff_max_seconds,
        stop_timeout_seconds=settings.engine_stop_timeout_seconds,
        drain_grace_seconds=settings.drain_grace_seconds,
        cpu_cores_per_rank=settings.engine_cpu_cores_per_rank,
        cpu_reserved_cores=settings.engine_cpu_reserved_cores,
        cpu_engine_core_niceness=settings.engine_cpu_core_niceness,
        cpu_engine_autogroup_niceness=settings.engine_cpu_autogroup_niceness,
    )


def build_replica_manager(
    settings: NodeAgentSettings,
    *,
    clock: Clock | None = None,
    spawner: Spawner | None = None,
    client_factory: ClientFactory | None = None,
) -> ReplicaManager:
    """The replica supervisor (also the pipeline's `ReplicaDirectory`)."""
    return ReplicaManager(
        supervisor_config(settings), clock=clock, spawner=spawner, client_factory=client_factory
    )


@dataclasses.dataclass(slots=True)
class NodeAgentParts:
    """The control side, ready to be put into an `App`.

    `bound_port` is set by the composition root once the server is bound (port 0 in tests);
    it feeds `inference_address` in replica and node reports.
    """

    settings: NodeAgentSettings
    manager: ReplicaManager
    servicer: NodeAgentServicer
    inventory: Inventory
    registrar: Registrar | None
    bound_port: int = 0
    _tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    def address(self) -> str:
        if self.settings.advertise_address:
            return self.settings.advertise_address
        return f"{self.settings.host}:{self.bound_port or self.settings.port}"

    def node_status(self) -> nodeagent_pb2.NodeStatus:
        return nodeagent_pb2.NodeStatus(
            node=self.settings.node_name or socket.gethostname(),
            address=self.address(),
            gpus=self.inventory.gpus,
            cpu_count=self.inventory.cpu_count,
            memory_bytes=self.inventory.memory_bytes,
            replicas=[r.to_proto(self.address()) for r in self.manager.list()],
            agent_version=AGENT_VERSION,
        )

    async def start(self) -> None:
        """Starts the configured replicas (returns at once; they come up in the background)
        and the orchestrator registration."""
        for replica in self.settings.replicas:
            await self.manager.start(replica.id, replica.spec)
        if self.registrar is not None:
            self._tasks.append(asyncio.create_task(self.registrar.run(), name="registrar"))

    async def drain(self) -> None:
        """Shutdown began: stop admitting on every replica (in-flight RPCs keep running)."""
        await asyncio.gather(*(r.drain(0) for r in self.manager.list()), return_exceptions=True)

    async def stop(self) -> None:
        """The gRPC server stopped: stop every engine and the registration."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.manager.close()


def build_node_agent(
    settings: NodeAgentSettings,
    *,
    clock: Clock | None = None,
    spawner: Spawner | None = None,
    client_factory: ClientFactory | None = None,
    inventory: Callable[[], Inventory] = probe_inventory,
) -> NodeAgentParts:
    """Builds the replica manager, the NodeAgentService servicer and the registrar."""
    clock = clock or SystemClock()
    manager = build_replica_manager(
        settings, clock=clock, spawner=spawner, client_factory=client_factory
    )
    parts = NodeAgentParts(
        settings=settings,
        manager=manager,
        servicer=None,  # type: ignore[arg-type]  # set below: it needs the parts' callbacks
        inventory=inventory(),
        registrar=None,
    )
    parts.servicer = NodeAgentServicer(manager, parts.node_status, parts.address)
    if settings.orchestrator_address:
        parts.registrar = Registrar(
            settings.orchestrator_address,
            parts.node_status,
            heartbeat_interval_seconds=settings.heartbeat_interval_seconds,
            retry_max_seconds=settings.registration_retry_max_seconds,
            clock=clock,
        )
    return parts

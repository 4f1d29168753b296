"""How the node-agent is assembled; called from `app.build_app`.

parts = build_node_agent(settings)
App(..., servicers=[ServicerBinding("inferplane.nodeagent.v1.NodeAgentService",
                                    parts.servicer, add_NodeAgentServiceServicer_to_server)],
    start=parts.start, drain=parts.drain, stop=parts.stop)

The node-agent serves no InferenceService: each replica process does, on its own port
(issue 16), and is reported with that address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.node_agent.agent.capabilities import CpuInfo, node_capabilities, read_cpuinfo
from inferplane.node_agent.agent.node import Inventory, probe_inventory
from inferplane.node_agent.agent.registration import Registrar
from inferplane.node_agent.agent.servicer import NodeAgentServicer
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.node_agent.supervisor.engines import EngineCatalog, discover_engines
from inferplane.node_agent.supervisor.manager import ClientFactory, ReplicaManager, SupervisorConfig
from inferplane.node_agent.supervisor.process import (
    LAUNCHER_COMMAND,
    REPLICA_COMMAND,
    Spawner,
)
from inferplane.replica_contract import has_nvidia_gpu
from inferplane.runtime.security.identity import NODE_AGENT
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.node_agent")

AGENT_VERSION = "0.1.0"

#: How long shutdown waits for the registration's RPC in flight before cancelling it.
REGISTRAR_STOP_SECONDS = 5.0


def supervisor_config(settings: NodeAgentSettings) -> SupervisorConfig:
    """The supervisor's knobs from the node-agent's settings. Replica processes bind the
    agent's `host` and are reported at `advertise_address`'s host (else `host`); their
    engines and metrics stay on loopback."""
    return SupervisorConfig(
        data_dir=settings.data_dir.resolve(),
        replica_command=settings.replica_command or REPLICA_COMMAND,
        engine_command=settings.engine_command or LAUNCHER_COMMAND,
        replica=settings.replica_flags(),
        host="127.0.0.1",
        replica_host=settings.host,
        replica_advertise_host=advertised_host(settings),
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
        security=settings.security(NODE_AGENT),
    )


def advertised_host(settings: NodeAgentSettings) -> str:
    """The host part of `advertise_address` (`host:port`, `[v6]:port`); empty when unset."""
    if not settings.advertise_address:
        return ""
    return settings.advertise_address.rsplit(":", 1)[0]


def build_replica_manager(
    settings: NodeAgentSettings,
    *,
    clock: Clock | None = None,
    spawner: Spawner | None = None,
    client_factory: ClientFactory | None = None,
) -> ReplicaManager:
    """The replica supervisor, with the engines this node offers: this interpreter's and each
    of `settings.engine_envs` (`engines.discover_engines`; ConfigError for a folder that is no
    engine environment)."""
    config = supervisor_config(settings)
    cpu = (not has_nvidia_gpu()) if config.cpu is None else config.cpu
    return ReplicaManager(
        config,
        clock=clock,
        spawner=spawner,
        client_factory=client_factory,
        engines=EngineCatalog(discover_engines(settings.engine_envs, cpu=cpu)),
    )


@dataclasses.dataclass(slots=True)
class NodeAgentParts:
    """The control side, ready to be put into an `App`.

    `bound_port` is set by the composition root once the server is bound (port 0 in tests);
    it feeds the node's control `address` in node reports (each replica reports its own
    replica process's `inference_address`).
    """

    settings: NodeAgentSettings
    manager: ReplicaManager
    servicer: NodeAgentServicer
    inventory: Inventory
    registrar: Registrar | None
    bound_port: int = 0
    cpuinfo: CpuInfo = dataclasses.field(default_factory=read_cpuinfo)
    _tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    def address(self) -> str:
        """The node-agent's own (NodeAgentService) address, as the orchestrator reaches it."""
        if self.settings.advertise_address:
            return self.settings.advertise_address
        return f"{self.settings.host}:{self.bound_port or self.settings.port}"

    def node_status(self) -> nodeagent_pb2.NodeStatus:
        """This node as the orchestrator sees it: inventory, replicas, the engines it offers
        and its capabilities (`agent/capabilities.py`)."""
        return nodeagent_pb2.NodeStatus(
            node=self.settings.node_name or socket.gethostname(),
            address=self.address(),
            gpus=self.inventory.gpus,
            cpu_count=self.inventory.cpu_count,
            memory_bytes=self.inventory.memory_bytes,
            replicas=[r.to_proto() for r in self.manager.list()],
            agent_version=AGENT_VERSION,
            engines=self.manager.engines.to_proto(),
            capabilities=self.capabilities(),
        )

    def capabilities(self) -> nodeagent_pb2.NodeCapabilities:
        """What this node runs (`agent/capabilities.py`): reported to the orchestrator and
        checked by the manager before a start."""
        engines = self.manager.engines.to_proto()
        return node_capabilities(cpu_node=self.manager.cpu, engines=engines, cpuinfo=self.cpuinfo)

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
        """The gRPC server stopped: stop the registration (its RPC in flight ends first, at
        most `REGISTRAR_STOP_SECONDS`: `Registrar.stop`) and every replica process."""
        if self.registrar is not None:
            self.registrar.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=REGISTRAR_STOP_SECONDS)
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
    parts.servicer = NodeAgentServicer(manager, parts.node_status)
    manager.capabilities = parts.capabilities
    if settings.orchestrator_address:
        parts.registrar = Registrar(
            settings.orchestrator_address,
            parts.node_status,
            heartbeat_interval_seconds=settings.heartbeat_interval_seconds,
            retry_max_seconds=settings.registration_retry_max_seconds,
            clock=clock,
            channel_factory=settings.security(NODE_AGENT).aio_channel,
        )
    return parts

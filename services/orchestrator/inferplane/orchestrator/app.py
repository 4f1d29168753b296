"""Composition root of the orchestrator service: store, placement policy, control plane,
reconcile loop and rolling releases, routing table, Envoy's ADS server, servicers, the
liveness sweeper, and the leader lease that decides which of several orchestrators on one
database runs the loops (`leadership.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping

import structlog
from envoy.service.discovery.v3 import ads_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.edge import EdgeConfig
from inferplane.orchestrator.autoscale.loop import Autoscaler, AutoscalerMetrics, AutoscaleSettings
from inferplane.orchestrator.catalog.compat_check import CompatibilityCheck
from inferplane.orchestrator.catalog.sizing import SizingPolicy
from inferplane.orchestrator.control import ControlPlane
from inferplane.orchestrator.fleet.model import Liveness
from inferplane.orchestrator.leadership import (
    GrantsJournal,
    LeaderLease,
    LeaderOnlyAgents,
    Leadership,
    RoutingTableRelay,
    default_holder,
)
from inferplane.orchestrator.placement.registry import (
    PolicyFactory,
    build_policy,
    default_policies,
)
from inferplane.orchestrator.release.agents import GrpcNodeAgents, NodeAgents
from inferplane.orchestrator.release.gate import Gate, LatencyReader, ProbeGate, TelemetryLatency
from inferplane.orchestrator.release.gates import PerformanceGate
from inferplane.orchestrator.release.matrix import CompatibilityMatrix
from inferplane.orchestrator.release.observe import ReconcileSettings
from inferplane.orchestrator.release.performance import build_gate as performance_gate
from inferplane.orchestrator.release.reconciler import Reconciler
from inferplane.orchestrator.release.store import (
    MemoryReleaseStore,
    ReleaseStore,
    SqlReleaseStore,
)
from inferplane.orchestrator.routing import RoutingHub
from inferplane.orchestrator.servicer import DeploymentService, NodeService, RoutingService
from inferplane.orchestrator.settings import OrchestratorSettings
from inferplane.orchestrator.store.base import StateStore
from inferplane.orchestrator.store.lease import SqlLeaseStore, SqlRouterGrants, SqlRoutingTables
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.orchestrator.xds.cache import SnapshotCache
from inferplane.orchestrator.xds.edge import EdgeXds
from inferplane.orchestrator.xds.server import AggregatedDiscoveryService
from inferplane.runtime import App, ServicerBinding
from inferplane.runtime.security.identity import (
    ADMIN,
    EDGE,
    NODE_AGENT,
    ROUTER,
    TELEMETRY,
    PeerPolicy,
)
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.orchestrator")


@dataclasses.dataclass(slots=True)
class OrchestratorComponents:
    """Everything `build_app` wires, exposed so tests can reach the control plane and store."""

    settings: OrchestratorSettings
    clock: Clock
    store: StateStore
    control: ControlPlane
    agents: NodeAgents
    releases: ReleaseStore
    # The compatibility matrix and its enforcement (issue 30): `compat.matrix`.
    compat: CompatibilityCheck
    reconciler: Reconciler
    hub: RoutingHub
    xds_cache: SnapshotCache
    ads: AggregatedDiscoveryService
    leadership: Leadership
    lease_store: SqlLeaseStore
    relay: RoutingTableRelay
    grants: GrantsJournal
    autoscaler: Autoscaler | None = None
    registry: CollectorRegistry = dataclasses.field(default_factory=CollectorRegistry)
    edge: EdgeXds | None = None
    _leader_tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)
    _follower: asyncio.Task[None] | None = None
    _edge_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Migrates the schema, publishes the edge's xDS from the routing table, and joins the
        leader election (`leadership.py`) with one attempt before serving, so a lone
        orchestrator leads at once: the leader loads the persisted state and runs the liveness
        sweeper and the reconcile loop; a standby serves the routing table the leader stored."""
        await asyncio.to_thread(self.store.create_schema)
        await asyncio.to_thread(self.releases.create_schema)
        reconciled = self.reconciler.status
        autoscaler = self.autoscaler
        if autoscaler is None:
            self.control.set_status_provider(reconciled)
        else:
            self.control.set_status_provider(lambda d, s: autoscaler.status(d, reconciled(d, s)))
            self.hub.on_cold_demand(autoscaler.wake)
        self.control.subscribe(self.reconciler.wake)
        if self.edge is not None:
            await self.edge.set_routers(self.settings.edge_routers)
            # The replicas cluster follows the routing table (the picker picks from it).
            self._edge_task = asyncio.create_task(
                self.edge.follow(self.hub.watch()), name="edge-replicas"
            )
        await self.leadership.start(lead=self._lead, follow=self._follow)

    async def _lead(self) -> None:
        """Becomes the leader: the state as the database holds it now, then the control loop."""
        await _cancel(self._follower)
        self._follower = None
        # Only the leader splits the replicas' caps among routers (a new epoch: no share a
        # former leader granted can be renewed here), adopting what the previous term granted.
        adopted = None
        try:
            adopted = await self.grants.adoptable()
        except Exception as exc:  # then it waits out the routers' leases instead
            log.warning("router_grants_unreadable", error=str(exc))
        log.info(
            "router_grants_adopted" if adopted is not None else "router_grants_wait_leases",
            routers=len(adopted or {}),
        )
        self.hub.set_granting(True, adopted=adopted)
        await asyncio.to_thread(self.control.load)
        self.reconciler.load()
        self._leader_tasks = [
            asyncio.create_task(self.relay.publish_forever(), name="routing-table-store"),
            asyncio.create_task(self._sweep_forever(), name="liveness-sweep"),
        ]
        if self.settings.reconcile:
            self._leader_tasks.append(asyncio.create_task(self.reconciler.run(), name="reconcile"))
        if self.autoscaler is not None:
            self._leader_tasks.append(asyncio.create_task(self.autoscaler.run(), name="autoscale"))

    async def _follow(self) -> None:
        """Stands by: no control loop; the routing table the leader stored is served."""
        tasks, self._leader_tasks = self._leader_tasks, []
        self.hub.set_granting(False)  # routers' shares here are 0, their renewals refused
        for task in tasks:
            await _cancel(task)
        await self.reconciler.close()
        if self.autoscaler is not None:
            self.autoscaler.reset()
        if self._follower is None:
            self._follower = asyncio.create_task(
                self.relay.follow_forever(self.settings.reconcile_interval_seconds),
                name="routing-table-follow",
            )

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_seconds)
            try:
                await asyncio.to_thread(self.control.sweep)
            except Exception:  # a database hiccup must not stop liveness checks
                log.exception("liveness_sweep_failed")
            try:  # LoRA adapters drained (no router has a request for the base) or past grace
                await asyncio.to_thread(
                    self.control.sweep_adapters,
                    self.hub.quiet,
                    propagation_seconds=self.settings.drain_propagation_seconds,
                )
            except Exception:
                log.exception("adapter_sweep_failed")

    async def stop(self) -> None:
        """Stops the election and the loops, then releases the lease (a standby takes over
        within its renew interval) and closes the stores."""
        await self.leadership.stop()
        for task in (*self._leader_tasks, self._follower, self._edge_task):
            await _cancel(task)
        await self.reconciler.close()
        await self.agents.close()
        try:
            await asyncio.to_thread(self.leadership.release)
        except Exception:  # the database is gone: the lease expires on its own
            log.exception("leader_lease_release_failed")
        await asyncio.to_thread(self.lease_store.close)
        await asyncio.to_thread(self.store.close)

    def app(self) -> App:
        nodes = "/inferplane.orchestrator.v1.NodeService/"
        return App(
            component="orchestrator",
            registry=self.registry,
            peer_policy=PeerPolicy(
                {
                    # The catalogue and fleet operations: operators (CLI, `inferplane up`).
                    "/inferplane.orchestrator.v1.DeploymentService/": [ADMIN],
                    nodes: [ADMIN],
                    nodes + "RegisterNode": [NODE_AGENT],
                    nodes + "StreamHeartbeats": [NODE_AGENT],
                    # The routing table: routers pick from it, telemetry scrapes its replicas.
                    "/inferplane.orchestrator.v1.RoutingService/": [ROUTER, TELEMETRY, ADMIN],
                    # Envoy's configuration.
                    "/envoy.service.discovery.v3.AggregatedDiscoveryService/": [EDGE],
                }
            ),
            servicers=[
                ServicerBinding(
                    "inferplane.orchestrator.v1.DeploymentService",
                    DeploymentService(self.control, self.compat),
                    orchestrator_pb2_grpc.add_DeploymentServiceServicer_to_server,
                ),
                ServicerBinding(
                    "inferplane.orchestrator.v1.NodeService",
                    NodeService(self.control, self.compat),
                    orchestrator_pb2_grpc.add_NodeServiceServicer_to_server,
                ),
                ServicerBinding(
                    "inferplane.orchestrator.v1.RoutingService",
                    RoutingService(self.hub),
                    orchestrator_pb2_grpc.add_RoutingServiceServicer_to_server,
                ),
                ServicerBinding(
                    "envoy.service.discovery.v3.AggregatedDiscoveryService",
                    self.ads,
                    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server,
                ),
            ],
            start=self.start,
            stop=self.stop,
        )


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def sizing_policy(settings: OrchestratorSettings) -> SizingPolicy:
    return SizingPolicy(
        overhead_bytes_per_device=settings.overhead_bytes_per_device,
        overhead_fraction=settings.overhead_fraction,
        cpu_usable_memory_fraction=settings.cpu_usable_memory_fraction,
    )


def release_telemetry(settings: OrchestratorSettings) -> TelemetryLatency | None:
    """The canary's telemetry reader (`telemetry_address`, else the edge's), or None."""
    telemetry = settings.telemetry_address or settings.edge_telemetry_address
    if not telemetry:
        return None
    return TelemetryLatency(telemetry, security=settings.security("orchestrator"))


def build_components(
    settings: OrchestratorSettings,
    *,
    clock: Clock | None = None,
    lease_clock: Clock | None = None,
    store: StateStore | None = None,
    policies: Mapping[str, PolicyFactory] | None = None,
    agents: NodeAgents | None = None,
    gate: Gate | None = None,
    performance: PerformanceGate | None = None,
    latency: LatencyReader | None = None,
) -> OrchestratorComponents:
    """Builds the parts (no I/O beyond creating the data dir).

    The release pipeline's ports (issue 30): `performance`, the performance gate's runner
    (None: GuideLLM through the edge when the `benchmark_*` settings are set, else none: a
    profile asking for the gate fails its release); `latency`, telemetry read
    by revision for the canary (None: telemetry at the `telemetry_address` setting, or none).

    `lease_clock` times the leader lease (default: the system clock, also when `clock` is a
    fake one: a test that moves its fake clock by minutes must not depose the only
    orchestrator). Every SQL write is fenced by the lease once `start` ran (`leadership.py`).

    Raises:
        ConfigError: unknown placement policy (the message lists the known ones), or lease
            settings out of range (`leader_id` length, 0 < `leader_renew_seconds` <
            `leader_lease_seconds`).
    """
    clock = clock or SystemClock()
    policy = build_policy(settings.placement_policy, policies or default_policies())
    if not settings.database_url:
        settings.resolved_data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lease_store = SqlLeaseStore(settings.resolved_database_url)
    lease = LeaderLease(
        lease_store,
        holder=settings.leader_id or default_holder(),
        duration_seconds=settings.leader_lease_seconds,
        renew_interval_seconds=settings.leader_renew_seconds,
        clock=lease_clock or SystemClock(),
    )
    leadership = Leadership(lease)
    if store is None:
        store = SqlStateStore(settings.resolved_database_url, fence=leadership)
    control = ControlPlane(
        store,
        policy,
        sizing=sizing_policy(settings),
        liveness=Liveness(settings.heartbeat_interval_seconds, settings.missed_heartbeats),
        clock=clock,
        guard=leadership.require_leader,
    )
    control.set_lora_root(settings.resolved_lora_root)
    agents = LeaderOnlyAgents(
        agents
        or GrpcNodeAgents(
            timeout_seconds=settings.node_agent_timeout_seconds,
            probe_timeout_seconds=settings.warmup_timeout_seconds,
            security=settings.security("orchestrator"),
        ),
        leadership,
    )
    releases: ReleaseStore = (
        SqlReleaseStore(store.engine, fence=leadership)
        if isinstance(store, SqlStateStore)
        else MemoryReleaseStore()
    )
    compat = CompatibilityCheck(
        CompatibilityMatrix(store.engine, fence=leadership, clock=clock)
        if isinstance(store, SqlStateStore)
        else CompatibilityMatrix.in_memory(clock=clock)
    )
    control.set_compatibility_check(compat)
    # Router share leases run on real time, like the leader lease (see `lease_clock`).
    grants = GrantsJournal(
        SqlRouterGrants(lease_store.database, fence=leadership), lease, clock=clock
    )
    hub = RoutingHub(clock=lease_clock or SystemClock(), journal=grants)
    reconciler = Reconciler(
        control,
        agents,
        releases,
        hub,
        gate=gate or ProbeGate(agents, interval_seconds=settings.gate_probe_interval_seconds),
        clock=clock,
        performance=performance if performance is not None else performance_gate(settings),
        latency=latency or release_telemetry(settings),
        matrix=compat.matrix,
        settings=ReconcileSettings(
            interval_seconds=settings.reconcile_interval_seconds,
            propagation_seconds=settings.drain_propagation_seconds,
            observe_timeout_seconds=settings.node_agent_observe_timeout_seconds,
        ),
    )
    registry = CollectorRegistry()
    autoscaler = None
    if settings.autoscale:
        telemetry = settings.telemetry_address or settings.edge_telemetry_address
        autoscaler = Autoscaler(
            control,
            hub.demand,
            reconciler.ready_replicas,
            clock=clock,
            settings=AutoscaleSettings(
                interval_seconds=settings.autoscale_interval_seconds,
                grace_seconds=settings.autoscale_grace_seconds,
                ttft_window_seconds=settings.autoscale_ttft_window_seconds,
                ttft_interval_seconds=settings.autoscale_ttft_interval_seconds,
            ),
            latency=TelemetryLatency(telemetry, security=settings.security("orchestrator"))
            if telemetry
            else None,
            metrics=AutoscalerMetrics(registry),
        )
    cache = SnapshotCache()
    edge = None
    if settings.edge_routers and settings.edge_auth_address:
        edge = EdgeXds(
            cache,
            EdgeConfig(
                router_endpoints=settings.edge_routers,
                auth_endpoint=settings.edge_auth_address,
                console_endpoint=settings.edge_console_address or None,
                listen_host=settings.edge_listen_host,
                listen_port=settings.edge_listen_port,
                tls_cert_path=settings.edge_tls_cert_path,
                tls_key_path=settings.edge_tls_key_path,
                upstream_tls_dir=settings.edge_upstream_tls_dir,
                node_id=settings.edge_node_id,
                region=settings.edge_region,
                telemetry_endpoint=settings.edge_telemetry_address or None,
                telemetry_internal_token=settings.edge_telemetry_internal_token,
                # The platform's tracing settings (the orchestrator's own) for the edge too.
                otlp_traces_endpoint=settings.otlp_traces_endpoint or None,
                trace_sampling_percent=settings.trace_sampling_ratio * 100.0,
            ),
        )
    relay = RoutingTableRelay(
        hub, SqlRoutingTables(lease_store.database, fence=leadership), lease, clock=clock
    )
    return OrchestratorComponents(
        settings=settings,
        clock=clock,
        store=store,
        control=control,
        agents=agents,
        releases=releases,
        compat=compat,
        reconciler=reconciler,
        hub=hub,
        xds_cache=cache,
        ads=AggregatedDiscoveryService(cache),
        leadership=leadership,
        lease_store=lease_store,
        relay=relay,
        grants=grants,
        autoscaler=autoscaler,
        registry=registry,
        edge=edge,
    )


def build_app(settings: OrchestratorSettings, *, clock: Clock | None = None) -> App:
    """Wires the orchestrator service from its settings."""
    return build_components(settings, clock=clock).app()

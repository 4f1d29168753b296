"""Composition root of the router."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.router.v1 import outcome_pb2_grpc
from inferplane.router.adapter_affinity import AdapterAffinity
from inferplane.router.admission import Admission, AdmissionSettings, LoopScheduler
from inferplane.router.engine_state import EngineStates
from inferplane.router.features import FeatureExtractor
from inferplane.router.key_source import KeyTableMetrics, KeyTableWatch
from inferplane.router.keylimits import KeyLimiter
from inferplane.router.keys import KeyTable
from inferplane.router.kvfit import KvFit
from inferplane.router.kvindex import KvIndex
from inferplane.router.leases import CapLease
from inferplane.router.metrics import AdmissionCollector, RouterMetrics
from inferplane.router.outcomes import SERVICE_NAME as OUTCOME_SERVICE
from inferplane.router.outcomes import OutcomeService
from inferplane.router.picker.codec import SERVICE_NAME as PICKER_SERVICE
from inferplane.router.picker.gateway import GatewayMode, GatewayProcessor
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.picker.tracing import PickerTracing
from inferplane.router.policies import default_registry
from inferplane.router.replica_watch import ReplicaWatch
from inferplane.router.reporting import Reporter
from inferplane.router.routes import RouteTable, load_routes_file
from inferplane.router.servicer import ModelsService
from inferplane.router.settings import RouterSettings, resolve_auth_pepper
from inferplane.router.sources import OrchestratorRouteSource, RouteSource, StaticRouteSource
from inferplane.router.tokenize import PromptTokens
from inferplane.router.usage import AuthUsageSink, LoggingUsageSink, UsageSink, UsageSinkSettings
from inferplane.runtime import App, ConfigError, ErrorInterceptor, ServicerBinding, grpc_options
from inferplane.runtime.security.api_keys import SecretHasher
from inferplane.runtime.security.identity import ADMIN, EDGE, NODE_AGENT, PeerPolicy, PeerSecurity
from inferplane.runtime.time.clock import Clock, SystemClock
from inferplane.runtime.tracing import Tracing, TracingSettings
from inferplane.telemetry_client import RecordSink, SinkSettings


def router_id(settings: RouterSettings) -> str:
    """This router's id towards the orchestrator: `router_id`, else `host name:port`, so a
    router restarted in place takes its shares back at once instead of waiting for the
    lease of its previous process to run out (two live routers must never share an id)."""
    return settings.router_id or f"{socket.gethostname()}:{settings.port}"


def route_source(settings: RouterSettings, router: str = "") -> RouteSource:
    """The orchestrator's stream when `orchestrator_address` is set (this router's view with
    its shares of the caps when `router` is given), else the static file.

    Raises:
        ConfigError: the routes file is unreadable.
    """
    if settings.orchestrator_address:
        return OrchestratorRouteSource(
            settings.orchestrator_address,
            options=grpc_options(settings),
            security=settings.security("router"),
            initial_backoff_seconds=settings.orchestrator_backoff_seconds,
            max_backoff_seconds=settings.orchestrator_max_backoff_seconds,
            router_id=router,
        )
    table = load_routes_file(settings.routes_file) if settings.routes_file else RouteTable.of([])
    return StaticRouteSource(table)


@dataclasses.dataclass(slots=True)
class RouterApp(App):
    """The router's `App`, holding the parts tests and the picker reach.

    Attributes:
        key_table: the key table auth streams (`auth_address`); empty and never received
            without an auth address.
    """

    key_table: KeyTable = dataclasses.field(kw_only=True)
    engine_states: EngineStates | None = dataclasses.field(default=None, kw_only=True)
    kv_index: KvIndex | None = dataclasses.field(default=None, kw_only=True)


def key_table_source(
    settings: RouterSettings, clock: Clock, registry: CollectorRegistry, security: PeerSecurity
) -> tuple[KeyTable, KeyTableWatch | None]:
    """The key table and, with `auth_address`, the watch that fills it from auth (its
    metrics registered in `registry`).

    Raises:
        ConfigError: `auth_address` without auth's pepper (`auth_pepper` or
            `auth_pepper_file`), or a bad pepper.
    """
    pepper = resolve_auth_pepper(settings)
    if settings.auth_address and pepper is None:
        raise ConfigError(
            "setting 'auth_pepper' (or 'auth_pepper_file') is required with 'auth_address': "
            "the picker looks keys up by their hash under auth's pepper"
        )
    # Without auth the table is never filled: a throw-away pepper, since nothing matches.
    hasher = SecretHasher(pepper or secrets.token_bytes(32))
    table = KeyTable(hasher, clock, stale_after_seconds=settings.key_table_stale_seconds)
    if not settings.auth_address:
        return table, None
    KeyTableMetrics(registry, table)
    watch = KeyTableWatch(
        settings.auth_address,
        table,
        router_id=router_id(settings),
        internal_token=settings.auth_internal_token,
        security=security,
        options=grpc_options(settings),
        heartbeat_seconds=settings.key_table_heartbeat_seconds,
    )
    return table, watch


class GatewayListener:
    """The router's second endpoint-picker port for conformant gateways (`gateway_port`):
    its own gRPC server with `GatewayProcessor` and gRPC health (the protocol's readiness
    check), server TLS without a client certificate, or plaintext when the router is. The
    server is made in `start`, on the loop that serves it."""

    def __init__(
        self, picker: EndpointPicker, settings: RouterSettings, security: PeerSecurity
    ) -> None:
        self._picker = picker
        self._settings = settings
        self._security = security
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._stopping: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Binds `host:gateway_port` and serves.

        Raises:
            OSError: the port cannot be bound.
        """
        settings = self._settings
        server = self.server = grpc.aio.server(
            interceptors=[ErrorInterceptor("router-gateway")], options=grpc_options(settings)
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            GatewayProcessor(self._picker, GatewayMode(settings.gateway_node_port)), server
        )
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = f"{settings.host}:{settings.gateway_port}"
        if self._security.mtls:
            credentials = self._security.server_credentials(require_client=False)
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        await server.start()
        for name in ("", PICKER_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def drain(self) -> None:
        """Starts the graceful stop beside the main port's (requests in flight finish)."""
        if self._stopping is None and self.server is not None:
            self._stopping = asyncio.ensure_future(
                self.server.stop(self._settings.grace_period_seconds)
            )

    async def stop(self) -> None:
        self.drain()
        if self._stopping is not None:
            await self._stopping


def build_app(
    settings: RouterSettings,
    *,
    clock: Clock | None = None,
    source: RouteSource | None = None,
    usage: UsageSink | None = None,
    registry: CollectorRegistry | None = None,
    wall_clock: Callable[[], float] = time.time,
) -> RouterApp:
    """Wires the router: route source → admission (policies, caps, queues) → the endpoint
    picker (Envoy's ext_proc `ExternalProcessor`) and `ListModels` (`InferenceService`), plus
    the usage sink to auth (`auth_address`) and the record sink to telemetry
    (`telemetry_address`), both started with the app and flushed on stop.

    `usage` overrides the sink built from settings (tests). `clock` (monotonic) drives
    admission and the request timings; `wall_clock` stamps records.

    Raises:
        ConfigError: an unknown default policy, or a static table naming an unknown policy;
            `auth_address` without auth's pepper.
    """
    clock = clock or SystemClock()
    registry = registry or CollectorRegistry()
    security = settings.security("router")
    # The key table auth streams (`auth_address`), which the picker authenticates with.
    key_table, key_watch = key_table_source(settings, clock, registry, security)
    # The replicas' engine states and KV blocks, filled by the replica state watch
    # (`replica_watch.py`, `replica_state_watch`), read by precise_prefix and the lease's demand.
    engine_states = EngineStates(clock.monotonic)
    kv_index = KvIndex(settings.kv_index_max_entries)
    policies = default_registry(
        settings.default_policy,
        settings.load_factor,
        engine_states=engine_states,
        kv_index=kv_index,
    )
    # Admission by predicted KV fit (issue 29): each engine's reported KV room, this router's
    # reservations; re-examined at every report.
    kv_fit = (
        KvFit(
            engine_states,
            clock.monotonic,
            report_lag_seconds=settings.kv_fit_report_lag_seconds,
            candidates=settings.kv_fit_candidates,
            default_output_tokens=settings.kv_fit_default_output_tokens,
            bytes_per_token=settings.kv_fit_bytes_per_token,
        )
        if settings.kv_fit
        else None
    )
    admission = Admission(
        policies,
        AdmissionSettings(
            default_max_concurrency=settings.default_max_concurrency,
            queue_timeout_seconds=settings.queue_timeout_seconds,
            max_queue_per_deployment=settings.max_queue_per_deployment,
            retry_after_seconds=settings.retry_after_seconds,
            cold_start_retry_after_seconds=settings.cold_start_retry_after_seconds,
            max_cold_start_budget_seconds=settings.max_cold_start_budget_seconds,
            breaker_failures=settings.breaker_failures,
            breaker_open_seconds=settings.breaker_open_seconds,
        ),
        clock,
        LoopScheduler(),
        kv_fit=kv_fit,
        # LoRA: prefer replicas whose engine holds the request's adapter (issue 29).
        affinity=AdapterAffinity(engine_states, settings.load_factor),
    )
    if kv_fit is not None:
        engine_states.subscribe(admission.engine_changed)
    metrics = RouterMetrics(registry)
    registry.register(AdmissionCollector(admission, clock.monotonic))
    # Shared caps: the orchestrator's view for this router, admitted on under a lease.
    lease: CapLease | None = None
    if source is None and settings.orchestrator_address and settings.shared_caps:
        me = router_id(settings)
        source = route_source(settings, me)
        watch = source
        assert isinstance(watch, OrchestratorRouteSource)
        lease = CapLease(
            lambda: watch.address,  # renewals follow the watch to the leader
            me,
            admission,
            clock,
            security=security,
            options=grpc_options(settings),
            engine_states=engine_states,
        )
    source = source or route_source(settings)
    source.subscribe(admission.apply)  # a table that cannot be applied is never current
    replica_watch: ReplicaWatch | None = None
    if settings.watches_replica_state():  # one WatchReplicaState stream per replica
        replica_watch = ReplicaWatch(
            engine_states,
            kv_index,
            security=security,
            options=grpc_options(settings),
            router_id=router_id(settings),
            idle_timeout_seconds=settings.replica_state_idle_seconds,
            registry=registry,
        )
        source.subscribe(replica_watch.on_table)
    key_limits: KeyLimiter | None = None
    if key_watch is not None:  # the keys' limits, this router's share (`keylimits`)
        key_limits = KeyLimiter(clock, window_seconds=settings.key_limit_window_seconds)
        source.subscribe(key_limits.on_table)
    if lease is not None:
        source.subscribe(lease.on_table)
    auth_sink: AuthUsageSink | None = None
    if usage is None and settings.auth_address:
        usage = auth_sink = AuthUsageSink(
            UsageSinkSettings(
                target=settings.auth_address,
                internal_token=settings.auth_internal_token,
                capacity=settings.usage_buffer_capacity,
                batch_size=settings.usage_batch_size,
                flush_interval_seconds=settings.usage_flush_interval_seconds,
                security=security,
            ),
            registry,
            channel_options=grpc_options(settings),
            spool_path=Path(settings.usage_spool_path) if settings.usage_spool_path else None,
        )
    record_sink: RecordSink | None = None
    if settings.telemetry_address:
        record_sink = RecordSink(
            SinkSettings(target=settings.telemetry_address, security=security),
            registry,
            channel_options=grpc_options(settings),
        )
    usage = usage or LoggingUsageSink()
    records = record_sink.record if record_sink is not None else None
    features = FeatureExtractor(settings.prefix_block_bytes, settings.prefix_max_blocks)
    picker = EndpointPicker(
        source.current,
        admission,
        Reporter(usage, records, clock, wall_clock),
        features=features,
        settings=PickerSettings(
            fallbacks=settings.picker_fallbacks,
            keepalive_seconds=settings.picker_keepalive_seconds,
            timeout_margin_seconds=settings.picker_timeout_margin_seconds,
            outcome_address=settings.outcome_address or f"{settings.host}:{settings.port}",
            outcome_wait_seconds=settings.outcome_wait_seconds,
        ),
        metrics=metrics,
        # The picker authenticates every request on this table; without auth (no watch) it
        # authenticates none, and the edge's picker guard refuses them (fail closed).
        keys=key_table if key_watch is not None else None,
        key_limits=key_limits,
    )
    tracing = Tracing(TracingSettings.of(settings, "inferplane-router"))
    picker.tracing = PickerTracing(tracing)
    prompt_tokens: PromptTokens | None = None
    if replica_watch is not None:  # precise_prefix routes' prompts tokenized before admission
        prompt_tokens = PromptTokens(
            engine_states,
            default_policy=settings.default_policy,
            max_tokens=settings.precise_prefix_max_tokens,
            max_tokenizers=settings.tokenizer_cache_size,
        )
        picker.director.prompt_tokens = prompt_tokens
    gateway = GatewayListener(picker, settings, security) if settings.gateway_port else None

    async def start() -> None:
        if key_watch is not None:
            await key_watch.start()
        if auth_sink is not None:
            await auth_sink.start()
        if record_sink is not None:
            await record_sink.start()
        await source.start()
        if replica_watch is not None:
            await replica_watch.start()
        if lease is not None:
            await lease.start()
        if gateway is not None:
            await gateway.start()

    async def drain() -> None:
        if gateway is not None:
            gateway.drain()

    async def stop() -> None:
        if gateway is not None:
            await gateway.stop()
        if lease is not None:
            await lease.stop()  # gives the shares back (the server has stopped)
        if replica_watch is not None:
            await replica_watch.stop()
        if prompt_tokens is not None:
            prompt_tokens.close()
        await source.stop()
        # After the server stopped: every request has ended and handed over its report.
        if auth_sink is not None:
            await auth_sink.close()
        if record_sink is not None:
            await record_sink.close()
        await asyncio.to_thread(tracing.shutdown)  # the last spans leave
        if key_watch is not None:
            await key_watch.stop()

    return RouterApp(
        component="router",
        registry=registry,
        peer_policy=PeerPolicy(
            {
                # Envoy asks for picks; models are listed through the edge (or by operators).
                f"/{PICKER_SERVICE}/": [EDGE],
                "/inferplane.inference.v1.InferenceService/": [EDGE, ADMIN],
                # Replica processes report the outcome of streams that ended without trailers.
                f"/{OUTCOME_SERVICE}/": [NODE_AGENT],
            }
        ),
        servicers=[
            ServicerBinding(
                "inferplane.inference.v1.InferenceService",
                ModelsService(source.current, wall_clock),
                inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            ),
            ServicerBinding(
                PICKER_SERVICE,
                picker,
                external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server,
            ),
            ServicerBinding(
                OUTCOME_SERVICE,
                OutcomeService(picker),
                outcome_pb2_grpc.add_OutcomeServiceServicer_to_server,
            ),
        ],
        start=start,
        drain=drain,
        stop=stop,
        key_table=key_table,
        engine_states=engine_states,
        kv_index=kv_index,
    )

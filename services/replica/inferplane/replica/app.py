"""The replica process: one engine replica serving its own InferenceService (issue 16 B).

Life of the process (`ReplicaProcess.run`, exit codes in `EXIT_*`):
1. The gRPC port is bound and serving at once, health NOT_SERVING (the supervisor polls it).
2. The engine starts (`EngineHost.start`, bounded by `startup_timeout_seconds`) while the
   model's assets load; then health turns SERVING and requests are admitted.
3. SIGTERM/SIGINT: admission stops (new requests: UNAVAILABLE `replica_draining`), health
   NOT_SERVING; in-flight requests get `drain_grace_seconds`, the rest are aborted (their
   streams end with an error event), the server stops, the engine shuts down, exit 0.
   `StartReplicaDrain` does the first half only.
4. Engine death (a SIGKILLed EngineCore or Worker, a child engine that exits): in-flight
   streams end with an `engine_failed` error event, the process exits 1 so that the
   node-agent restarts the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.replica.engines.base import EngineClient
from inferplane.replica.engines.lora import AdapterRegistry
from inferplane.replica.engines.migration import Migrator, Origin
from inferplane.replica.hosts import EngineHost
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.server import InferenceServicer, StreamMetrics
from inferplane.replica.server.artifacts import ArtifactsInfo, replica_artifacts, template_text
from inferplane.replica.server.conformance import ConformanceRunner
from inferplane.replica.server.continuation import Continuations
from inferplane.replica.server.outcome import OutcomeSink, discard_outcome, record_sender
from inferplane.replica.server.response_store import ResponseStoreClient
from inferplane.replica.server.state_stream import (
    Admission,
    ReplicaStateStream,
    StateStreamCollector,
)
from inferplane.replica.service import ReplicaProcessServicer
from inferplane.replica.settings import ReplicaSettings
from inferplane.replica.state import Phase, ReplicaState, TrackedEngine
from inferplane.replica.tracing import ReplicaTracing
from inferplane.replica_contract import Transport, runs_on_cpu
from inferplane.routing_client import OutcomeReporter, OutcomeReporterSettings
from inferplane.runtime import (
    App,
    GcPauses,
    RunningServer,
    ServicerBinding,
    freeze_heap,
    grpc_options,
)
from inferplane.runtime.security.identity import (
    ADMIN,
    AUTH,
    EDGE,
    NODE_AGENT,
    ORCHESTRATOR,
    ROUTER,
    PeerPolicy,
)
from inferplane.runtime.service.metrics_http import ScrapedMetrics, serve_text_metrics
from inferplane.runtime.time.clock import Clock
from inferplane.runtime.tracing import Tracing, TracingSettings

#: Who may call a replica's InferenceService: the edge's Envoy, the orchestrator's warm-up
#: probe, operators, and the node-local Envoy of the gateway path (inferplane.edge
#: NodeEnvoyConfig), which presents its node-agent's identity.
INFERENCE_CALLERS: tuple[str, ...] = (EDGE, ORCHESTRATOR, ADMIN, NODE_AGENT)
#: Who may run a replica's conformance checks (RunConformance, issue 30): the orchestrator's
#: release gate and operators (`inferplane conformance`); never the edge (tenants' path).
CONFORMANCE_CALLERS: tuple[str, ...] = (ORCHESTRATOR, ADMIN)

log = structlog.get_logger("inferplane.replica")

INFERENCE_SERVICE = "inferplane.inference.v1.InferenceService"
REPLICA_SERVICE = "inferplane.nodeagent.v1.ReplicaProcessService"
HEALTH_NAMES = ("", INFERENCE_SERVICE)

EXIT_OK = 0
EXIT_ENGINE_DIED = 1
EXIT_START_FAILED = 3
ABORTED_WAIT_SECONDS = 5.0  # for the aborted streams to write their error events
DEAD_WAIT_SECONDS = 5.0  # for streams of a dead engine to end with their error events
# For streams of a dead engine that moved to siblings (issue 31) to end: the process serves
# them (it owns their client's stream) and exits when they did, or after this.
MIGRATED_WAIT_SECONDS = 600.0


class _Server(RunningServer):
    """The runtime's server (error interceptor, health, reflection, keepalive options), started
    NOT_SERVING: health follows the engine here, not the port."""

    async def start(self) -> None:
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()


class _Collect:
    """Exposes another registry's series through ours (vLLM's `vllm:*` for inproc)."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source

    def collect(self) -> Any:
        return self._source().collect()


class ReplicaProcess:
    """Wires one replica process (composition root) and runs it (`run`).

    Args:
        settings: the parsed command line.
        host: where the engine runs.
        assets: model assets (default: a fresh cache loading the spec's model).
        clock: the pipeline's clock (default: the system's).
        on_outcome: per-request records (default: to telemetry when `telemetry_address`).
        extra_metrics: another registry served with ours (vLLM's: in-process, or the child
            engine's endpoint).

    Every request that produced output and names its endpoint picker (`x-inferplane-picker`)
    is also reported to that picker (`self.outcomes`, an `OutcomeReporter`): the summary
    trailers alone are lost when a client closes right after `data: [DONE]`.
    """

    def __init__(
        self,
        settings: ReplicaSettings,
        host: EngineHost,
        *,
        assets: ModelAssetsCache | None = None,
        clock: Clock | None = None,
        on_outcome: OutcomeSink | None = None,
        extra_metrics: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.host = host
        self.registry = CollectorRegistry()
        if extra_metrics is not None:
            self.registry.register(_Collect(extra_metrics))
        self.state = ReplicaState(settings.flags.replica_id, settings.spec)
        self.security = settings.security(NODE_AGENT)
        self._assets = assets or ModelAssetsCache()
        self._sink: Any = None
        if on_outcome is None:
            on_outcome = self._telemetry() if settings.flags.telemetry_address else discard_outcome
        self.outcomes = OutcomeReporter(
            self.registry,
            OutcomeReporterSettings(security=self.security),
            # Pickers are reached at the address they put in the request (a pod IP): their
            # certificate is checked against the router identity.
            channel_options=[*grpc_options(settings), *self.security.server_options(ROUTER)],
        )
        self.response_store: ResponseStoreClient | None = None
        if settings.flags.response_store_address:
            # Auth owns the stored responses; its certificate is checked as auth's.
            address = settings.flags.response_store_address
            options = [*grpc_options(settings), *self.security.server_options(AUTH)]
            self.response_store = ResponseStoreClient(
                lambda: self.security.aio_channel(address, options)
            )
        # LoRA adapters (issue 29): the request's adapter checked and given an id; what the
        # engine holds, for routers (WatchReplicaState's loaded_adapters).
        self.adapters = AdapterRegistry(settings.spec, transport=settings.flags.transport)
        # Mid-stream migration (issue 31): a stream whose engine dies moves to a sibling of the
        # pick; siblings are replica processes, whose certificates are the node-agent's.
        self.migrator = Migrator(
            Origin(
                settings.flags.replica_id,
                settings.spec.revision,
                settings.spec.served_model_name,
            ),
            self.security,
            self.registry,
            channel_options=[*grpc_options(settings), *self.security.server_options(NODE_AGENT)],
        )
        self.inference = InferenceServicer(
            self.state,
            self._assets,
            clock=clock,
            on_outcome=on_outcome,
            strict_tool_calls=settings.flags.strict_tool_calls,
            owned_by=settings.flags.owned_by,
            metrics=StreamMetrics(self.registry),
            report_to_picker=self.outcomes.report,
            response_store=self.response_store,
            adapters=self.adapters,
            migrator=self.migrator,
        )
        # The engine's state for routers (WatchReplicaState): engine stats, KV blocks, queue.
        self.state_stream = ReplicaStateStream(
            lambda: getattr(self.host, "engine_state", None) or self.state.engine,
            lambda: Admission(self.state.in_flight, self.state.phase is Phase.DRAINING),
            loaded_adapters=self.adapters.loaded,
        )
        self.registry.register(StateStreamCollector(self.state_stream))
        # The platform's tracing (the node-agent's flags): each request's spans.
        self.tracing = Tracing(TracingSettings.of(settings, REPLICA_SERVICE_NAME))
        self.inference.tracing = ReplicaTracing(self.tracing, clock)
        # RunConformance (issue 30): replay and live requests through this process's own path.
        # What this replica runs (issue 30), known once the engine is ready (`_load_artifacts`).
        self.artifacts: replica_pb2.ReplicaArtifacts | None = None
        self._artifacts_info = ArtifactsInfo(self.registry)
        self.conformance = ConformanceRunner(
            self.state,
            self._assets,
            self.inference.CreateChatCompletion,
            artifacts=lambda: self.artifacts,
        )
        app = App(
            component="replica",
            registry=self.registry,
            peer_policy=PeerPolicy(
                {
                    f"/{INFERENCE_SERVICE}/": list(INFERENCE_CALLERS),
                    # Drain and load: the node-agent that started this process.
                    f"/{REPLICA_SERVICE}/": [NODE_AGENT],
                    # The engine's state: the routers (issue 29), this method only.
                    f"/{REPLICA_SERVICE}/WatchReplicaState": [ROUTER],
                    # The release's conformance gate (server/conformance.py).
                    f"/{REPLICA_SERVICE}/RunConformance": list(CONFORMANCE_CALLERS),
                    # A sibling replica process moving a stream here (issue 31).
                    f"/{REPLICA_SERVICE}/ContinueGeneration": [NODE_AGENT],
                }
            ),
            servicers=[
                ServicerBinding(
                    INFERENCE_SERVICE,
                    self.inference,
                    inference_pb2_grpc.add_InferenceServiceServicer_to_server,
                ),
                ServicerBinding(
                    REPLICA_SERVICE,
                    ReplicaProcessServicer(
                        self.state,
                        self.start_drain,
                        self.state_stream,
                        conformance=self.conformance,
                        artifacts=lambda: self.artifacts,
                        continuations=Continuations(self.state, self.adapters),
                    ),
                    replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server,
                ),
            ],
        )
        self.server = _Server(app, settings)
        self.port = self.server.port
        self._engine: TrackedEngine | None = None
        self._metrics_server: Any = None

    def _telemetry(self) -> OutcomeSink:
        from inferplane.telemetry_client import RecordSink, SinkSettings

        self._sink = RecordSink(
            SinkSettings(target=self.settings.flags.telemetry_address, security=self.security),
            self.registry,
            channel_options=grpc_options(self.settings),
        )
        deployment = self.settings.spec.deployment
        return record_sender(
            self._sink.record,
            node=self.settings.flags.node_name or socket.gethostname(),
            deployment_of=lambda _replica_id: deployment,
            wall_clock=time.time,
            revision=self.settings.spec.revision,
        )

    async def _serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        for name in HEALTH_NAMES:
            await self.server.health.set(name, status.SERVING if serving else status.NOT_SERVING)

    async def start_drain(self) -> int:
        """StartReplicaDrain: stop admitting, health NOT_SERVING. Returns the in-flight count."""
        in_flight = self.state.start_drain()
        await self._serving(False)
        log.info("replica_draining", replica=self.state.replica_id, in_flight=in_flight)
        return in_flight

    async def _start_engine(self) -> EngineClient:
        assets = asyncio.ensure_future(self._assets.get(self.settings.spec))
        try:
            engine = await self.host.start()
        finally:
            with contextlib.suppress(Exception):
                await assets
        await self._assets.get(self.settings.spec)  # a failed load fails the start
        await self._load_artifacts()
        return engine

    async def _load_artifacts(self) -> None:
        """`self.artifacts` and the `inferplane_replica_info` series (`server/artifacts.py`);
        a failure is logged and leaves them unknown (the replica still serves)."""
        spec = self.settings.spec
        try:
            assets = await self._assets.get(spec)
            self.artifacts = await asyncio.to_thread(
                replica_artifacts,
                spec,
                cpu=runs_on_cpu(self.settings.flags.device),
                chat_template=template_text(assets.tokenizer),
            )
        except Exception:
            log.exception("replica_artifacts_failed")
            return
        self._artifacts_info.set(self.artifacts, spec.revision)

    async def run(self, stop: asyncio.Event) -> int:
        """Serves until `stop` is set (graceful, exit 0), the engine dies (exit 1) or does
        not start (exit 3). Returns the exit code."""
        settings = self.settings
        await self.server.start()
        if settings.metrics_port:
            self._metrics_server = serve_text_metrics(
                settings.metrics_port, settings.flags.metrics_host, self.registry
            )
        if self._sink is not None:
            await self._sink.start()
        await self.outcomes.start()
        log.info("replica_listening", replica=settings.flags.replica_id, port=self.port)
        started = time.monotonic()
        starting = asyncio.ensure_future(
            asyncio.wait_for(self._start_engine(), settings.flags.startup_timeout_seconds)
        )
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(BaseException):
                    await starting
                return await self._close(EXIT_OK)
            try:
                client = starting.result()
            except Exception as exc:
                log.error("engine_start_failed", error=f"{type(exc).__name__}: {exc}")
                return await self._close(EXIT_START_FAILED)
            self._engine = TrackedEngine(client, self.host.check_soon)
            # inproc: vLLM's own list of the adapters it holds (else the most recently used).
            self.adapters.attach(
                getattr(client, "lora_ids", None) if self.adapters.enabled else None
            )
            self.state.set_ready(self._engine)
            if self.state.phase is Phase.READY:
                await self._serving(True)
            log.info(
                "replica_ready",
                replica=settings.flags.replica_id,
                transport=settings.flags.transport,
                startup_seconds=round(time.monotonic() - started, 2),
            )
            if settings.gc_freeze:
                log.info("gc_heap_frozen", objects=freeze_heap())
            dying = asyncio.ensure_future(self.host.wait_dead())
            try:
                await asyncio.wait({dying, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if dying.done() and not stopping.done():
                    return await self._died(dying.result())
                return await self._graceful()
            finally:
                dying.cancel()
        finally:
            stopping.cancel()

    async def _graceful(self) -> int:
        grace = self.settings.flags.drain_grace_seconds
        self.state.start_drain()
        await self.server.health.enter_graceful_shutdown()
        log.info("replica_stopping", in_flight=self.state.in_flight, grace_seconds=grace)
        if not await self.state.wait_idle(grace) and self._engine is not None:
            aborted = await self._engine.abort_all()
            log.warning("replica_aborted_in_flight", requests=aborted)
            await self.state.wait_idle(ABORTED_WAIT_SECONDS)
        return await self._close(EXIT_OK)

    async def _died(self, reason: str) -> int:
        log.error("engine_died", replica=self.settings.flags.replica_id, reason=reason)
        self.state.mark_dead()
        await self.server.health.enter_graceful_shutdown()
        await self.state.wait_idle(DEAD_WAIT_SECONDS)
        if self.migrator.active:  # streams moved to siblings: serve them to their end
            log.info("engine_died_streams_migrated", streams=self.migrator.active)
            await self.state.wait_idle(MIGRATED_WAIT_SECONDS)
        return await self._close(EXIT_ENGINE_DIED)

    async def _close(self, code: int) -> int:
        """Stops the server, then the engine (AsyncLLM's shutdown blocks: off the loop, and
        after the last stream), then the pickers' outcome reporter and the record sink (after
        the server: what the last requests reported is flushed)."""
        with contextlib.suppress(Exception):
            await self.server.health.enter_graceful_shutdown()
        await self.state_stream.close()
        await self.server.server.stop(self.settings.grace_period_seconds)
        try:
            await self.host.shutdown()
        except Exception:
            log.exception("engine_shutdown_failed")
        with contextlib.suppress(Exception):
            await self.outcomes.close()
        with contextlib.suppress(Exception):
            await self.migrator.close()
        if self.response_store is not None:
            with contextlib.suppress(Exception):
                await self.response_store.close()
        if self._sink is not None:
            with contextlib.suppress(Exception):
                await self._sink.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans leave
        log.info("replica_stopped", replica=self.settings.flags.replica_id, exit_code=code)
        return code


REPLICA_SERVICE_NAME = "inferplane-replica"
"""The replica process's `service.name` in its spans."""


def build_host(settings: ReplicaSettings) -> tuple[EngineHost, Callable[[], Any] | None]:
    """The engine host for `settings.flags.transport` and vLLM's series to serve with ours
    (its registry for inproc, the child engine's endpoint otherwise).

    For inproc this sets the engine environment first (`environment.engine_environment`: before
    vLLM is imported)."""
    from inferplane.replica.engines.child_state import ChildEngineState
    from inferplane.replica.engines.environment import apply_engine_environment, patch_vllm_version
    from inferplane.replica.hosts import ChildEngineHost, InprocHost, client_for
    from inferplane.replica_contract import Task, replica_task, runs_on_cpu

    # KV events where prefix caching serves routing: generating (decoder) engines only.
    generates = replica_task(settings.spec) == Task.GENERATE
    if settings.flags.transport != Transport.INPROC:
        transport, address = settings.flags.transport, settings.flags.engine_address
        url = settings.flags.engine_metrics_url
        # The engine's numbers from its metrics; KV events from vLLM's HTTP server's engine.
        events = generates and transport == Transport.HTTP_COMPLETIONS
        state = ChildEngineState(url, kv_events=events)
        host = ChildEngineHost(
            settings.engine_argv, lambda: client_for(transport, address), state=state
        )
        scraped = ScrapedMetrics(url) if url else None
        return host, (lambda: scraped) if scraped is not None else None
    from inferplane.replica.engines.inproc import engine_argv

    cpu = runs_on_cpu(settings.flags.device)
    apply_engine_environment(os.environ, cpu=cpu, cache_root=settings.flags.cache_root)
    patch_vllm_version(cpu)

    def vllm_registry() -> Any:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return get_prometheus_registry()

    argv = engine_argv(settings.spec, cpu=cpu, kv_cache_bytes=settings.kv_cache_bytes)
    tracing = TracingSettings.of(settings, REPLICA_SERVICE_NAME)
    if tracing.enabled:  # vLLM's own span per request, under the replica's (trace_headers)
        argv += ["--otlp-traces-endpoint", tracing.url]
    return InprocHost(argv, kv_events=generates), vllm_registry


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m inferplane.replica`: parses the command line, serves, exits."""
    from inferplane.replica.settings import parse_args
    from inferplane.runtime import ConfigError, configure_logging, loop_factory
    from inferplane.runtime.processes import procguard

    try:
        settings = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"replica: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.json_logs)
    if os.getpgrp() == os.getpid():
        # Dies with the node-agent; at exit, whatever vLLM left in our group goes too.
        procguard.guard_parent()
    host, extra = build_host(settings)

    async def serve() -> int:
        process = ReplicaProcess(settings, host, extra_metrics=extra)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        pauses = GcPauses(process.registry).install()
        try:
            return await process.run(stop)
        finally:
            pauses.close()

    with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
        return runner.run(serve())

"""Composition root of the telemetry service: store, metrics, engine scraper, alerts, servicer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
from envoy.service.accesslog.v3 import als_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2_grpc
from inferplane.routing_client import RoutingTableWatch
from inferplane.runtime import App, ServicerBinding
from inferplane.runtime.security.identity import (
    ADMIN,
    EDGE,
    NODE_AGENT,
    ORCHESTRATOR,
    ROUTER,
    PeerPolicy,
)
from inferplane.runtime.security.internal import InternalCallerGuard
from inferplane.runtime.time.clock import Clock, SystemClock
from inferplane.telemetry.alerts import Evaluator
from inferplane.telemetry.discovery import EngineDiscovery, TargetSource, targets_from_table
from inferplane.telemetry.domain import SloTargets
from inferplane.telemetry.edge_overhead import EdgeOverheadMetrics, EdgeOverheadService
from inferplane.telemetry.engines import EngineScraper, Fetch, HttpFetch
from inferplane.telemetry.ingest import Ingestor
from inferplane.telemetry.metrics import RecordMetrics
from inferplane.telemetry.servicer import TelemetryService
from inferplane.telemetry.settings import TelemetrySettings
from inferplane.telemetry.store import SampleStore

log = structlog.get_logger("inferplane.telemetry")

Sleep = Callable[[float], Awaitable[None]]


@dataclasses.dataclass(slots=True)
class TelemetryComponents:
    """Everything `build_app` wires, exposed so tests can drive scrapes and evaluations."""

    settings: TelemetrySettings
    clock: Clock
    registry: CollectorRegistry
    store: SampleStore
    metrics: RecordMetrics
    ingestor: Ingestor
    scraper: EngineScraper
    evaluator: Evaluator
    servicer: TelemetryService
    discovery: EngineDiscovery
    edge_overhead: EdgeOverheadService
    edge_overhead_metrics: EdgeOverheadMetrics
    target_source: TargetSource | None = None
    sleep: Sleep = asyncio.sleep
    run_loops: bool = True
    _fetch_close: Callable[[], Awaitable[None]] | None = None
    _tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    async def start(self) -> None:
        """Starts following the routing table (when there is a target source), the engine
        scrape loop and the alert evaluation loop (the loops only with `run_loops`; tests
        without them drive `scraper.scrape_once()` and `evaluator.evaluate()`)."""
        if self.target_source is not None:
            await self.target_source.start()
        if not self.run_loops:
            return
        if self.scraper.targets or self.target_source is not None:
            self._tasks.append(
                asyncio.create_task(
                    self.scraper.run(self.settings.engine_scrape_interval_seconds, self.sleep)
                )
            )
        self._tasks.append(asyncio.create_task(self._evaluate_forever()))

    async def _evaluate_forever(self) -> None:
        while True:
            await self.sleep(self.settings.evaluation_interval_seconds)
            try:
                self.evaluator.evaluate()
            except Exception:  # one bad evaluation must not stop alerting
                log.exception("alert_evaluation_failed")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.target_source is not None:
            await self.target_source.stop()
        if self._fetch_close is not None:
            await self._fetch_close()

    def app(self) -> App:
        service = "/inferplane.telemetry.v1.TelemetryService/"
        return App(
            component="telemetry",
            registry=self.registry,
            peer_policy=PeerPolicy(
                {
                    # Request records: routers and replica processes.
                    service + "RecordRequests": [ROUTER, NODE_AGENT],
                    # Queries: operators (`inferplane top`).
                    service: [ADMIN],
                    # A deployment's TTFT p99: the orchestrator's autoscaler (issue 29).
                    service + "QueryLatency": [ADMIN, ORCHESTRATOR],
                    # The edge's access log of routed requests (the edge overhead metric).
                    "/envoy.service.accesslog.v3.AccessLogService/": [EDGE],
                }
            ),
            servicers=[
                ServicerBinding(
                    "inferplane.telemetry.v1.TelemetryService",
                    self.servicer,
                    telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server,
                ),
                ServicerBinding(
                    "envoy.service.accesslog.v3.AccessLogService",
                    self.edge_overhead,
                    als_pb2_grpc.add_AccessLogServiceServicer_to_server,
                ),
            ],
            start=self.start,
            stop=self.stop,
        )


def build_components(
    settings: TelemetrySettings,
    *,
    clock: Clock | None = None,
    fetch: Fetch | None = None,
    sleep: Sleep = asyncio.sleep,
    run_loops: bool = True,
    target_source: TargetSource | None = None,
) -> TelemetryComponents:
    """Builds the parts (no I/O). Engine targets: the static ones plus those of
    `target_source`, by default the orchestrator's routing table when `orchestrator_address`
    is set.

    Raises:
        ConfigError: a malformed engine target or SLO override.
    """
    clock = clock or SystemClock()
    registry = CollectorRegistry()
    store = SampleStore(
        max_records=settings.max_records, retention_seconds=settings.retention_seconds
    )
    metrics = RecordMetrics(registry, settings.label_caps)
    sources = settings.sources
    ingestor = Ingestor(store, metrics, clock, sources, max_itl_gaps=settings.max_itl_gaps)
    fetch_close = None
    if fetch is None:
        http = HttpFetch()
        fetch, fetch_close = http, http.aclose
    scraper = EngineScraper(
        settings.parsed_engine_targets(),
        fetch,
        clock,
        window_seconds=settings.engine_window_seconds,
    )
    registry.register(scraper)  # type: ignore[arg-type]
    if target_source is None and settings.orchestrator_address:
        target_source = RoutingTableWatch(
            settings.orchestrator_address,
            targets_from_table,
            (),
            logger="inferplane.telemetry.discovery",
            security=settings.security("telemetry"),
        )
    discovery = EngineDiscovery(
        scraper,
        settings.parsed_engine_targets(),
        sd_file=Path(settings.engine_sd_file) if settings.engine_sd_file else None,
    )
    if target_source is not None:
        target_source.subscribe(discovery.update)
    table = settings.slo_table()
    default = settings.default_slo

    def slo(deployment: str) -> SloTargets:
        return table.get(deployment, default)

    evaluator = Evaluator(
        store,
        clock,
        slo=slo,
        engine_stats=scraper.all_stats,
        sources=sources,
        drift_policy=settings.drift_policy,
        slo_window_seconds=settings.slo_window_seconds,
    )
    servicer = TelemetryService(ingestor, store, evaluator.book, clock, sources)
    edge_overhead_metrics = EdgeOverheadMetrics(registry, settings.max_models)
    edge_overhead = EdgeOverheadService(
        edge_overhead_metrics, InternalCallerGuard(settings.internal_token)
    )
    return TelemetryComponents(
        settings=settings,
        clock=clock,
        registry=registry,
        store=store,
        metrics=metrics,
        ingestor=ingestor,
        scraper=scraper,
        evaluator=evaluator,
        servicer=servicer,
        discovery=discovery,
        edge_overhead=edge_overhead,
        edge_overhead_metrics=edge_overhead_metrics,
        target_source=target_source,
        sleep=sleep,
        run_loops=run_loops,
        _fetch_close=fetch_close,
    )


def build_app(settings: TelemetrySettings, *, clock: Clock | None = None) -> App:
    """Wires the telemetry service from its settings."""
    return build_components(settings, clock=clock).app()

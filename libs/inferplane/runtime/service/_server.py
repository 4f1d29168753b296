"""The start-up every service shares: health, reflection, metrics, logs, graceful shutdown.

A service's composition root returns an `App`: its servicers plus start/stop hooks. `serve`
runs it until SIGTERM or SIGINT, then: health turns NOT_SERVING, the server stops accepting
new RPCs, in-flight RPCs get `grace_period_seconds` to finish, `App.stop` runs, exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from inferplane.runtime.security.identity import ANY_IDENTITY, PeerPolicy
from inferplane.runtime.service._errors import ConfigError
from inferplane.runtime.service._gc import GcPauses, freeze_heap
from inferplane.runtime.service._interceptor import ErrorInterceptor, ServerMetrics
from inferplane.runtime.service._settings import ServiceSettings

# An app without a policy: any caller with a certificate from the CA.
_ANY_IDENTITY = PeerPolicy({}, default=(ANY_IDENTITY,))

log = structlog.get_logger("inferplane.runtime")


@dataclasses.dataclass(frozen=True, slots=True)
class ServicerBinding:
    """One servicer and how to add it: `add(servicer, server)` is the generated `add_*_to_server`.

    `name` is the full proto service name (for health and reflection).
    """

    name: str
    servicer: object
    add: Callable[[Any, grpc.aio.Server], None]


async def _noop() -> None:
    return None


@dataclasses.dataclass(slots=True)
class App:
    """What a composition root builds: servicers plus lifecycle hooks.

    `start` runs before the port accepts RPCs; `drain` runs when shutdown begins (while
    in-flight RPCs still run); `stop` runs after the gRPC server stopped. `peer_policy`: which
    identities may call which method under mutual TLS (None: any identity from the CA).
    """

    component: str
    servicers: Sequence[ServicerBinding]
    registry: CollectorRegistry
    peer_policy: PeerPolicy | None = None
    start: Callable[[], Awaitable[None]] = _noop
    drain: Callable[[], Awaitable[None]] = _noop
    stop: Callable[[], Awaitable[None]] = _noop


def configure_logging(level: str = "info", json_logs: bool = True) -> None:
    """Structured logs to stderr: JSON lines in production, readable lines on a terminal."""
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


# HTTP/2 keepalive (gRPC core's channel arguments). Every client of ours, and Envoy (its ADS and
# upstream clusters, edge/_ads.py and edge/_clusters.py: `connection_keepalive` 30 s), pings
# every KEEPALIVE_TIME_MS, also on idle connections. A gRPC server by default accepts a ping
# without data in between only every 5 minutes and answers the third early one with GOAWAY
# "too_many_pings", failing the calls in flight: a routing-table watch, an ADS stream or a
# record stream then died every ~90 s. Servers accept pings every MIN_PING_INTERVAL_MS.
KEEPALIVE_TIME_MS = 30_000
MIN_PING_INTERVAL_MS = 10_000


def grpc_options(settings: ServiceSettings) -> list[tuple[str, Any]]:
    """Channel/server options shared by servers and clients (message size limits, keepalive:
    see KEEPALIVE_TIME_MS)."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Server side: the keepalive pings above (and Envoy's) are welcome, idle or not.
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]


class RunningServer:
    """A started gRPC server; `port` is the bound port (useful with port 0)."""

    def __init__(self, app: App, settings: ServiceSettings) -> None:
        self.app = app
        self.settings = settings
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        metrics = ServerMetrics(app.registry)
        self.security = settings.security(app.component)
        policy = app.peer_policy or _ANY_IDENTITY
        authorize = policy.check if self.security.mtls else None
        self.server = grpc.aio.server(
            interceptors=[ErrorInterceptor(app.component, metrics, authorize=authorize)],
            options=grpc_options(settings),
        )
        for binding in app.servicers:
            binding.add(binding.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if settings.reflection:
            names = [b.name for b in app.servicers]
            reflection.enable_server_reflection(
                [
                    *names,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ],
                self.server,
            )
        self.port = self.security.add_port(self.server, f"{settings.host}:{settings.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {settings.host}:{settings.port}")
        self._metrics_server: Any = None

    async def start(self) -> None:
        if self.settings.metrics_port:
            self._metrics_server, _thread = start_http_server(
                self.settings.metrics_port, addr=self.settings.host, registry=self.app.registry
            )
        await self.app.start()
        await self.server.start()
        for binding in self.app.servicers:
            await self.health.set(binding.name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving",
            component=self.app.component,
            host=self.settings.host,
            port=self.port,
            metrics_port=self.settings.metrics_port or None,
            identity=self.security.name if self.security.mtls else None,
            transport="mtls" if self.security.mtls else "plaintext (development only)",
        )

    async def stop(self) -> None:
        log.info(
            "shutting_down",
            component=self.app.component,
            grace_period_seconds=self.settings.grace_period_seconds,
        )
        await self.health.enter_graceful_shutdown()
        await self.app.drain()
        await self.server.stop(self.settings.grace_period_seconds)
        await self.app.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        log.info("stopped", component=self.app.component)


LOOP_STALL_SECONDS = 10.0
"""How long a service's event loop may be blocked before every thread's Python stack is written
to stderr (the service's log): a blocked loop stops heartbeats and every RPC at once, and the
stacks say what held it."""


async def watch_loop_stalls(seconds: float = LOOP_STALL_SECONDS) -> None:
    """Re-arms `faulthandler.dump_traceback_later(seconds)` every `seconds / 10`: the dump
    happens (once per stall, from faulthandler's own thread, without the GIL) only if the loop
    did not come back here for `seconds`. Cancel it to stop watching."""
    try:
        while True:
            faulthandler.dump_traceback_later(seconds, repeat=False, file=sys.stderr)
            await asyncio.sleep(seconds / 10)
    finally:
        faulthandler.cancel_dump_traceback_later()


async def serve(
    app: App, settings: ServiceSettings, ready: Callable[[RunningServer], None] | None = None
) -> int:
    """Runs `app` until SIGTERM/SIGINT and shuts it down gracefully. Returns the exit code.
    While it serves, a loop blocked for `LOOP_STALL_SECONDS` dumps every thread's stack."""
    running = RunningServer(app, settings)
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    await running.start()
    if ready is not None:
        ready(running)
    watchdog = asyncio.create_task(watch_loop_stalls(), name="loop-stall-watchdog")
    try:
        await stop_event.wait()
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await running.stop()
    return 0


EVENT_LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop factory called `name` (a key of `EVENT_LOOPS`).

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    try:
        return EVENT_LOOPS[name]
    except KeyError:
        known = ", ".join(sorted(EVENT_LOOPS))
        raise ConfigError(f"setting 'event_loop': unknown loop {name!r} (known: {known})") from None


def _frozen() -> None:
    log.info("gc_heap_frozen", objects=freeze_heap())


def run(build: Callable[[Any], App], settings: ServiceSettings) -> None:
    """Entry point of a service's `__main__`: logs, builds the app, serves on the loop
    `settings.event_loop` names, exits. Once serving, the start-up heap is frozen out of the
    garbage collector's scans (unless `settings.gc_freeze` is off) and collection pauses are
    exported (`inferplane.runtime.service._gc`)."""
    configure_logging(settings.log_level, settings.json_logs)
    factory = loop_factory(settings.event_loop)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            app = build(settings)
            pauses = GcPauses(app.registry).install()
            try:
                # Serving from here on: what start-up built lives as long as the process.
                ready = (lambda _server: _frozen()) if settings.gc_freeze else None
                code = runner.run(serve(app, settings, ready=ready))
            finally:
                pauses.close()
    except KeyboardInterrupt:  # pragma: no cover - signal handlers normally catch it
        code = 0
    raise SystemExit(code)

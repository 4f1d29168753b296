"""The service base: settings precedence, error mapping, graceful shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.runtime import (
    ConfigError,
    ErrorInterceptor,
    GcPauses,
    NotFoundError,
    ResourceExhaustedError,
    ServerMetrics,
    ServiceSettings,
    freeze_heap,
    load_settings,
    loop_factory,
)
from inferplane.runtime.processes.ports import free_port


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DemoSettings(ServiceSettings):
    routes: tuple[str, ...] = ()
    ratio: float = 0.5


def test_settings_precedence_file_env_flags(tmp_path: Path) -> None:
    """Defaults < file < environment < flags, each typed; the result is frozen."""
    config = tmp_path / "c.yaml"
    config.write_text("demo:\n  port: 1000\n  ratio: 0.25\n  routes: [a, b]\n")
    env = {
        "INFERPLANE_DEMO_PORT": "2000",
        "INFERPLANE_DEMO_JSON_LOGS": "false",
        "INFERPLANE_DEMO_PLAINTEXT": "true",
    }
    s = load_settings(DemoSettings, service="demo", argv=["--config", str(config)], environ=env)
    assert (s.port, s.ratio, s.routes, s.json_logs) == (2000, 0.25, ("a", "b"), False)
    s = load_settings(
        DemoSettings,
        service="demo",
        argv=["--config", str(config), "--port", "3000", "--json-logs"],
        environ=env,
    )
    assert (s.port, s.json_logs) == (3000, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]


def test_settings_errors_name_the_problem(tmp_path: Path) -> None:
    """Unknown keys and wrong types fail at start-up with the setting's name."""
    config = tmp_path / "c.yaml"
    config.write_text("demo:\n  prot: 1\n")
    with pytest.raises(ConfigError, match="prot"):
        load_settings(DemoSettings, service="demo", argv=["--config", str(config)], environ={})
    with pytest.raises(ConfigError, match="'port'"):
        load_settings(DemoSettings, service="demo", argv=["--port", "x"], environ={})


class Failing(telemetry_pb2_grpc.TelemetryServiceServicer):  # type: ignore[misc]
    async def ListAlerts(self, request: Any, context: Any) -> Any:
        raise NotFoundError("no such deployment", code="deployment_not_found", param="name")

    async def QueryLatency(self, request: Any, context: Any) -> Any:
        raise ResourceExhaustedError("slow down", retry_after_seconds=2.4)

    async def RecordRequests(self, request_iterator: Any, context: Any) -> Any:
        raise RuntimeError("secret internal detail")


def test_errors_become_status_with_error_info_and_openai_trailers() -> None:
    """Domain errors map to their gRPC code, ErrorInfo and OpenAI trailers; unexpected
    exceptions become INTERNAL without leaking internals; metrics count each outcome."""

    async def scenario() -> None:
        registry = CollectorRegistry()
        server = grpc.aio.server(interceptors=[ErrorInterceptor("t", ServerMetrics(registry))])
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(Failing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListAlerts(telemetry_pb2.ListAlertsRequest())
                trailers = dict(info.value.trailing_metadata())
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert info.value.details() == "no such deployment"
                assert trailers["x-openai-error-code"] == "deployment_not_found"
                assert trailers["x-openai-error-param"] == "name"
                status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
                detail = error_details_pb2.ErrorInfo()
                status.details[0].Unpack(detail)
                assert (detail.reason, detail.domain) == ("DEPLOYMENT_NOT_FOUND", "inferplane.dev")

                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.QueryLatency(telemetry_pb2.QueryLatencyRequest())
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert dict(info.value.trailing_metadata())["retry-after"] == "2"

                async def records() -> Any:
                    yield telemetry_pb2.RecordRequestsRequest()

                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.RecordRequests(records())
                assert info.value.code() == grpc.StatusCode.INTERNAL
                assert "secret" not in (info.value.details() or "")
        finally:
            await server.stop(0)
        handled = registry.get_sample_value(
            "inferplane_grpc_server_handled_total",
            {
                "grpc_service": "inferplane.telemetry.v1.TelemetryService",
                "grpc_method": "ListAlerts",
                "grpc_code": "NOT_FOUND",
            },
        )
        assert handled == 1

    asyncio.run(scenario())


def _wait_serving(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing serving on port {port}")
            time.sleep(0.1)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_sigterm_lets_the_in_flight_call_finish_and_exits_zero(event_loop: str) -> None:
    """SIGTERM during a call: the call completes OK, new calls are refused, exit code 0, on
    either event loop a service can run on."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("slow_app.py")),
            str(port),
            "1.5",
            event_loop,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_serving(port)
        result: dict[str, Any] = {}

        def call() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
                result["response"] = stub.ListAlerts(telemetry_pb2.ListAlertsRequest(), timeout=10)

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError):
            telemetry_pb2_grpc.TelemetryServiceStub(channel).ListAlerts(
                telemetry_pb2.ListAlertsRequest(), timeout=2
            )
        thread.join(timeout=10)
        assert result["response"].alerts[0].kind == "done"
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.stderr.read() if proc.stderr else ""
    assert '"event": "stopped"' in stderr


def test_services_run_on_uvloop_by_default_and_unknown_loops_are_named() -> None:
    """The default loop is uvloop (the token path's per-I/O cost); a typo in `event_loop` is a
    ConfigError that lists the known loops, not a silent fallback."""
    loop = loop_factory(ServiceSettings().event_loop)()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    with pytest.raises(ConfigError, match="known: asyncio, uvloop"):
        loop_factory("uv-loop")


def test_freeze_heap_takes_survivors_out_of_full_collections() -> None:
    """After `freeze_heap`, what existed is frozen (not scanned by later collections) while
    garbage made afterwards is still collected: freezing never leaks new cycles."""
    import gc

    try:
        frozen = freeze_heap()
        assert frozen > 0
        cycle: list[Any] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # the new cycle is found
        # Nothing new was frozen (other threads may free frozen objects: the count only falls).
        assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_gc_pauses_are_exported_per_generation_and_close_removes_the_hook() -> None:
    """Each collection while `GcPauses` is installed is one observation of
    `inferplane_gc_pause_seconds{generation}`; after `close` the hook is gone."""
    import gc

    registry = CollectorRegistry()
    pauses = GcPauses(registry).install()

    def count(generation: str) -> float:
        value = registry.get_sample_value(
            "inferplane_gc_pause_seconds_count", {"generation": generation}
        )
        return value or 0.0

    try:
        gc.collect(0)
        gc.collect(2)
        assert count("0") >= 1 and count("2") >= 1
    finally:
        pauses.close()
    before = count("2")
    gc.collect(2)
    assert count("2") == before


@pytest.mark.parametrize("enabled", [False, True])
def test_reflection_is_served_only_when_enabled(enabled: bool) -> None:
    """Server reflection (a map of every method for whoever reaches the port) is off unless a
    service's settings turn it on; health is always served."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from inferplane.runtime import App, RunningServer

    async def scenario() -> None:
        app = App(component="demo", registry=CollectorRegistry(), servicers=[])
        server = RunningServer(app, ServiceSettings(reflection=enabled))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                call = stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
                if enabled:
                    names = [
                        s.name
                        for r in [await call.read()]
                        for s in r.list_services_response.service
                    ]
                    assert "grpc.health.v1.Health" in names
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call.read()
                    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_blocked_event_loop_dumps_every_threads_stack() -> None:
    """`watch_loop_stalls`: a loop blocked longer than the limit gets its threads' stacks
    written to stderr (what held it: here `time.sleep` in `blocking_call`); a loop that keeps
    coming back gets nothing."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import asyncio, sys, time
        from inferplane.runtime.service._server import watch_loop_stalls

        def blocking_call():
            time.sleep(1.5)

        async def main(block):
            watchdog = asyncio.create_task(watch_loop_stalls(0.5))
            await asyncio.sleep(0.2)
            if block:
                blocking_call()
            else:
                await asyncio.sleep(1.5)
            watchdog.cancel()

        asyncio.run(main(sys.argv[1] == "block"))
        """
    )
    blocked = subprocess.run(
        [sys.executable, "-c", script, "block"], capture_output=True, text=True, timeout=60
    )
    assert blocked.returncode == 0, blocked.stderr
    assert "Timeout (0:00:00.500000)!" in blocked.stderr
    assert "in blocking_call" in blocked.stderr
    fine = subprocess.run(
        [sys.executable, "-c", script, "idle"], capture_output=True, text=True, timeout=60
    )
    assert fine.returncode == 0 and "Timeout" not in fine.stderr, fine.stderr

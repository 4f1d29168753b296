"""Node inventory, settings of boot replicas, and orchestrator registration."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as orch
from inferplane.api.orchestrator.v1 import orchestrator_pb2_grpc
from inferplane.node_agent.agent.node import memory_bytes, parse_nvidia_smi, probe_inventory
from inferplane.node_agent.agent.registration import SWITCH_SECONDS, Registrar
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.runtime import ConfigError, load_settings
from inferplane.testing.clock import FakeClock

pytestmark = [pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_nvidia_smi_csv_is_parsed_in_bytes() -> None:
    gpus = parse_nvidia_smi(
        "0, GPU-aaa, NVIDIA H100 80GB HBM3, 81559, 1024\n"
        "1, GPU-bbb, NVIDIA H100 80GB HBM3, [Unknown Error], [Unknown Error]\n"
    )
    assert gpus[0].index == 0 and gpus[0].uuid == "GPU-aaa"
    assert gpus[0].memory_bytes == 81559 * 1024 * 1024 and gpus[0].healthy
    assert not gpus[1].healthy and gpus[1].memory_bytes == 0


def test_cpu_node_inventory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree: 1 kB\n")
    assert memory_bytes(meminfo) == 24576000 * 1024
    inv = probe_inventory()
    assert inv.cpu_count >= 1 and inv.memory_bytes > 0


def test_boot_replicas_come_from_the_yaml_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "node_agent:\n"
        "  replicas:\n"
        "    - id: kimi-tiny-0\n"
        "      served_model_name: kimi-tiny\n"
        "      model_source: /models/kimi-tiny\n"
        "      max_model_len: 2048\n"
        "      kv_cache_bytes: 1073741824\n"
        "      dtype: float32\n"
        "      extra_engine_args: ['--seed', '0']\n"
    )
    argv = ["--config", str(config), "--plaintext"]
    s = load_settings(NodeAgentSettings, service="node_agent", argv=argv)
    (replica,) = s.replicas
    assert replica.id == "kimi-tiny-0" and replica.spec.kv_cache_bytes == 1 << 30
    assert list(replica.spec.extra_engine_args) == ["--seed", "0"]
    config.write_text("node_agent:\n  replicas:\n    - id: x\n      model_sauce: /m\n")
    with pytest.raises(ConfigError, match="model_sauce"):
        load_settings(NodeAgentSettings, service="node_agent", argv=argv)


class PacedClock(FakeClock):
    """The shared `FakeClock` whose `sleep` also waits 10 ms of real time: the registrar under
    test talks to a real gRPC server on loopback, and a sleep that only yielded once would spin
    its retry and heartbeat loops far faster than that server answers."""

    async def sleep(self, seconds: float) -> None:
        await super().sleep(seconds)
        await asyncio.sleep(0.01)


class Orchestrator(orchestrator_pb2_grpc.NodeServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.registered: list[na.NodeStatus] = []
        self.beats: list[na.NodeStatus] = []

    async def RegisterNode(self, request, context):
        self.registered.append(request.status)
        return orch.RegisterNodeResponse(heartbeat_interval_seconds=1)

    async def StreamHeartbeats(self, request_iterator, context):
        async for beat in request_iterator:
            self.beats.append(beat.status)
            yield orch.StreamHeartbeatsResponse(condition="Ready")


async def _serve(
    servicer: orchestrator_pb2_grpc.NodeServiceServicer,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_NodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.mark.anyio
async def test_registration_and_heartbeats() -> None:
    orchestrator = Orchestrator()
    server, port = await _serve(orchestrator)
    status = na.NodeStatus(node="n1", cpu_count=2)
    registrar = Registrar(f"127.0.0.1:{port}", lambda: status, clock=PacedClock())
    task = asyncio.create_task(registrar.run())
    try:
        async with asyncio.timeout(10):
            while len(orchestrator.beats) < 3:
                await asyncio.sleep(0.02)
        assert orchestrator.registered[0].node == "n1" and registrar.registered
    finally:
        await _stop(registrar, task)
        await server.stop(0)


class StreamRecorder(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Keeps every stream-stream call the registrar makes."""

    def __init__(self) -> None:
        self.calls: list[grpc.aio.StreamStreamCall] = []

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        call = await continuation(client_call_details, request_iterator)
        self.calls.append(call)
        return call


@pytest.mark.anyio
async def test_stop_half_closes_the_heartbeat_stream_rather_than_cancelling_it() -> None:
    """The heartbeat stream ends with the orchestrator's OK after the node-agent's half-close,
    not CANCELLED, and `run()` returns once it ended: no call of the registrar is left to
    complete in gRPC core after the event loop that made it closed."""
    orchestrator = Orchestrator()
    server, port = await _serve(orchestrator)
    streams = StreamRecorder()
    registrar = Registrar(
        f"127.0.0.1:{port}",
        lambda: na.NodeStatus(node="n1"),
        clock=PacedClock(),
        channel_factory=lambda address: grpc.aio.insecure_channel(address, interceptors=[streams]),
    )
    task = asyncio.create_task(registrar.run())
    try:
        async with asyncio.timeout(10):
            while len(orchestrator.beats) < 2:
                await asyncio.sleep(0.02)
        registrar.stop()
        async with asyncio.timeout(5):
            await task
        assert [await call.code() for call in streams.calls] == [grpc.StatusCode.OK]
    finally:
        task.cancel()
        await server.stop(0)


@pytest.mark.anyio
async def test_an_orchestrator_without_node_service_never_crashes_the_agent() -> None:
    """Invariant: UNIMPLEMENTED (or no orchestrator at all) is retried later, not raised."""
    server, port = await _serve(orchestrator_pb2_grpc.NodeServiceServicer())
    clock = PacedClock()
    registrar = Registrar(
        f"127.0.0.1:{port}", lambda: na.NodeStatus(), clock=clock, retry_max_seconds=30
    )
    task = asyncio.create_task(registrar.run())
    try:
        async with asyncio.timeout(10):
            while registrar.attempts < 3:
                await asyncio.sleep(0.02)
        assert not task.done() and not registrar.registered
        assert clock.slept[:2] == [30, 30]
    finally:
        await _stop(registrar, task)  # its channel closes before the test's loop does
        await server.stop(0)
    unreachable = Registrar("127.0.0.1:1", lambda: na.NodeStatus(), clock=PacedClock())
    task = asyncio.create_task(unreachable.run())
    async with asyncio.timeout(10):
        while unreachable.attempts < 3:
            await asyncio.sleep(0.02)
    assert not task.done()
    await _stop(unreachable, task)


async def _stop(registrar: Registrar, task: asyncio.Task[None]) -> None:
    """Stops the registrar as the node-agent's shutdown does: no RPC of it is cancelled in
    flight, so none completes in gRPC core after this test's event loop closed (gRPC's poller
    would hand it to the next test's loop: `RuntimeError: Event loop is closed` there)."""
    registrar.stop()
    async with asyncio.timeout(15):  # RegisterNode's own deadline is 10 s
        await task


class Standby(orchestrator_pb2_grpc.NodeServiceServicer):  # type: ignore[misc]
    """A standby orchestrator: catalogue and fleet calls are refused, naming the leader."""

    def __init__(self) -> None:
        self.calls = 0

    async def RegisterNode(self, request, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not the leader; orch-2 leads")


@pytest.mark.anyio
async def test_a_node_agent_given_several_orchestrators_registers_with_the_leader() -> None:
    """Several orchestrators, comma-separated: a refusal (standby) or an unreachable one moves
    registration on to the next one at once, without the exponential backoff; the backoff
    applies only once all of them failed in a row."""
    standby, leader = Standby(), Orchestrator()
    (s_server, s_port), (l_server, l_port) = await _serve(standby), await _serve(leader)
    clock = PacedClock()
    registrar = Registrar(
        f"127.0.0.1:1, 127.0.0.1:{s_port},127.0.0.1:{l_port}",
        lambda: na.NodeStatus(node="n1"),
        clock=clock,
    )
    task = asyncio.create_task(registrar.run())
    try:
        async with asyncio.timeout(10):
            while len(leader.beats) < 2:
                await asyncio.sleep(0.02)
        assert registrar.registered and registrar.address == f"127.0.0.1:{l_port}"
        assert standby.calls == 1 and registrar.attempts == 3
        assert clock.slept[:2] == [SWITCH_SECONDS, SWITCH_SECONDS]
    finally:
        await _stop(registrar, task)
        await s_server.stop(0)
        await l_server.stop(0)
    # None answers: one pass at the switch pace, then the backoff, and round again.
    lost = Registrar(
        "127.0.0.1:1,127.0.0.1:2", lambda: na.NodeStatus(), clock=(clock := PacedClock())
    )
    task = asyncio.create_task(lost.run())
    async with asyncio.timeout(10):
        while lost.attempts < 5:
            await asyncio.sleep(0.02)
    await _stop(lost, task)
    assert clock.slept[:4] == [SWITCH_SECONDS, 1.0, SWITCH_SECONDS, 2.0]

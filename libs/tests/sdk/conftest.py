"""Real in-process servers for the SDK's tests, all under mutual TLS from one test CA: auth and
the orchestrator (their composition roots, SQLite in a tmp dir, a fake clock) and a replica's
InferenceService (the node-agent's real pipeline on the fixture models, with scripted engines
instead of vLLM). Each runs on its own event loop in a background thread, as in the services'
own tests."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.auth.app import build_components as build_auth
from inferplane.auth.settings import AuthSettings
from inferplane.orchestrator.app import build_components as build_orchestrator
from inferplane.orchestrator.settings import OrchestratorSettings
from inferplane.runtime import App, RunningServer, ServicerBinding, ServiceSettings
from inferplane.runtime.security.identity import (
    ADMIN,
    EDGE,
    NODE_AGENT,
    ORCHESTRATOR,
    ROUTER,
    PeerPolicy,
    PeerSecurity,
)
from inferplane.runtime.security.pki import LocalCA
from inferplane.sdk import Client, RetryPolicy
from inferplane.testing.clock import FakeClock
from inferplane.testing.loop import LoopThread

ADMIN_KEY = "sdk-test-bootstrap-admin-key-0123456789abcdef"
GB = 10**9
INFERENCE_SERVICE = "inferplane.inference.v1.InferenceService"
ANSWER = "Paris is the capital of France."


@dataclasses.dataclass(frozen=True)
class Pki:
    """The test CA's folder; `security(name)` is that identity's `PeerSecurity`."""

    directory: Path

    def security(self, name: str = ADMIN) -> PeerSecurity:
        return PeerSecurity(self.directory, name)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = LocalCA.ensure(directory)
    for name in ("auth", "orchestrator", NODE_AGENT, ADMIN, ROUTER, EDGE):
        ca.issue(name, dns_names=(name,), ip_addresses=("127.0.0.1",))
    return Pki(directory)


@contextlib.contextmanager
def serving(app: App, settings: ServiceSettings) -> Iterator[RunningServer]:
    """Runs `app` on its own loop thread until the block ends."""
    loop = LoopThread()
    try:

        async def start() -> RunningServer:
            server = RunningServer(app, settings)
            await server.start()
            return server

        server = loop.run(start())
        try:
            yield server
        finally:
            loop.run(server.stop())
    finally:
        loop.close()


@contextlib.contextmanager
def running_auth(pki: Pki, data_dir: Path, port: int = 0) -> Iterator[str]:
    """Auth (bootstrapped with ADMIN_KEY) on `port` (0: a free one); yields its address."""
    settings = AuthSettings(
        host="127.0.0.1",
        port=port,
        data_dir=data_dir,
        bootstrap_admin_key=ADMIN_KEY,
        grace_period_seconds=0.2,
        tls_dir=pki.directory,
    )
    components = build_auth(settings, clock=FakeClock())
    with serving(components.app(), settings) as server:
        yield f"127.0.0.1:{server.port}"


@contextlib.contextmanager
def running_orchestrator(pki: Pki, data_dir: Path, database_url: str = "") -> Iterator[str]:
    """The orchestrator (reconcile sweeps left to the tests; its database in `data_dir`
    unless `database_url` names one); yields its address."""
    settings = OrchestratorSettings(
        host="127.0.0.1",
        port=0,
        data_dir=data_dir,
        database_url=database_url,
        leader_id=f"orchestrator-{data_dir.name}",  # one process, several orchestrators
        grace_period_seconds=0.2,
        sweep_interval_seconds=3600.0,
        tls_dir=pki.directory,
    )
    components = build_orchestrator(settings, clock=FakeClock())
    with serving(components.app(), settings) as server:
        yield f"127.0.0.1:{server.port}"


@dataclasses.dataclass(frozen=True)
class Replica:
    """A running replica: its address, and the chat replica (`ready` False: it answers
    UNAVAILABLE, as one that is starting or draining does) and its engine."""

    address: str
    chat: Any
    engine: Any


@contextlib.contextmanager
def running_replica(pki: Pki, **engine_options: Any) -> Iterator[Replica]:
    """A replica's InferenceService (the node-agent's pipeline and the replica's identity
    policy) serving `kimi-tiny` (a scripted engine answering ANSWER; `engine_options` go to
    it) and `embed-tiny` (16-dimensional embeddings)."""
    from inferplane.replica.pipeline import ModelAssetsCache
    from inferplane.replica.testing.node import FakeNode
    from inferplane.replica.testing.pipeline import (
        FakeReplica,
        ScriptedEngine,
        TickingClock,
        embed_tiny_assets,
        embed_tiny_spec,
        kimi_tiny_assets,
        kimi_tiny_ids,
        kimi_tiny_spec,
        script,
    )

    assets = ModelAssetsCache()
    assets.put(kimi_tiny_assets(), "kimi_k2")
    assets.put(embed_tiny_assets(), None)
    engine = ScriptedEngine(
        script(kimi_tiny_ids("</think>" + ANSWER + "<|im_end|>"), per_increment=3),
        **engine_options,
    )
    replicas = [
        FakeReplica("chat-1", kimi_tiny_spec(), engine),
        FakeReplica("embed-1", embed_tiny_spec(), ScriptedEngine([], embedding_size=16)),
    ]
    servicer = FakeNode(replicas, assets, clock=TickingClock())
    app = App(
        component="replica",
        registry=CollectorRegistry(),
        # The replica process's rule for InferenceService (inferplane.replica.app).
        peer_policy=PeerPolicy({f"/{INFERENCE_SERVICE}/": [EDGE, ORCHESTRATOR, ADMIN]}),
        servicers=[
            ServicerBinding(
                INFERENCE_SERVICE,
                servicer,
                inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            )
        ],
    )
    settings = ServiceSettings(
        port=0, grace_period_seconds=0.2, tls_dir=pki.directory, identity=NODE_AGENT
    )
    with serving(app, settings) as server:
        yield Replica(f"127.0.0.1:{server.port}", replicas[0], engine)


def register_node(pki: Pki, orchestrator: str, name: str = "gpu-a", gpus: int = 2) -> None:
    """Registers a GPU node as its node-agent would (the node-agent's identity)."""
    status = nodeagent_pb2.NodeStatus(
        node=name,
        address="127.0.0.1:9",  # nothing listens: the reconcile loop's calls fail, harmlessly
        gpus=[
            nodeagent_pb2.Gpu(
                index=i,
                uuid=f"GPU-{name}-{i}",
                model="NVIDIA H100",
                memory_bytes=80 * GB,
                healthy=True,
            )
            for i in range(gpus)
        ],
        cpu_count=64,
        memory_bytes=512 * GB,
        agent_version="test",
    )
    with pki.security(NODE_AGENT).channel(orchestrator) as channel:
        orchestrator_pb2_grpc.NodeServiceStub(channel).RegisterNode(
            orchestrator_pb2.RegisterNodeRequest(status=status), timeout=10
        )


def llama8b(**overrides: Any) -> orchestrator_pb2.Deployment:
    """Llama-3.1-8B bf16 (28 GB per GPU with its KV budget: fits an 80 GB GPU)."""
    return orchestrator_pb2.Deployment(
        profile=orchestrator_pb2.DeploymentProfile(
            model_source="meta-llama/Llama-3.1-8B-Instruct",
            precision="bf16",
            parameter_count=8_030_000_000,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            max_model_len=8192,
            max_num_seqs=8,
        ),
        **overrides,
    )


FAST_RETRY = RetryPolicy(max_attempts=20, initial_backoff_seconds=0.05, max_backoff_seconds=0.2)


@pytest.fixture
def auth(pki: Pki, tmp_path: Path) -> Iterator[str]:
    with running_auth(pki, tmp_path / "auth") as address:
        yield address


@pytest.fixture
def orchestrator(pki: Pki, tmp_path: Path) -> Iterator[str]:
    with running_orchestrator(pki, tmp_path / "orchestrator") as address:
        yield address


@pytest.fixture
def client(pki: Pki, auth: str, orchestrator: str) -> Iterator[Client]:
    """An operator's client of auth and the orchestrator."""
    with Client(
        auth=auth, orchestrator=orchestrator, security=pki.security(), admin_key=ADMIN_KEY
    ) as c:
        yield c


@dataclasses.dataclass(frozen=True)
class Helpers:
    """The module's helpers as one fixture (test modules cannot import conftest by name)."""

    admin_key: str = ADMIN_KEY
    answer: str = ANSWER
    fast_retry: RetryPolicy = FAST_RETRY
    running_auth: Any = running_auth
    running_orchestrator: Any = running_orchestrator
    running_replica: Any = running_replica
    register_node: Any = register_node
    llama8b: Any = llama8b


@pytest.fixture
def fx() -> Helpers:
    return Helpers()

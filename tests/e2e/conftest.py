"""One real stack per test session: Envoy (configured over ADS), auth, router, orchestrator,
telemetry, a node-agent and the kimi-tiny deployment (one vLLM CPU replica started by the
orchestrator), on free loopback ports in a temporary data directory."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.localstack import Stack, StackConfig, StackError, running_stack
from inferplane.runtime.processes.ports import free_port, free_port_run

# Modules that start a stack of their own (their fixture is module-scoped).
OWN_STACK_MODULES = frozenset(
    {
        "test_two_replicas.py",
        "test_chaos.py",
        "test_edge_tls.py",
        "test_embeddings.py",
        "test_catalogue.py",
        "test_audio.py",
        "test_agents.py",
        "test_tracing.py",
        "test_autoscale.py",
        "test_lora.py",
        "test_release_pipeline.py",
        "test_speculative.py",
        "test_orchestrator_loss.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the modules with their own stack first: their engines are gone before the session
    stack starts, so two stacks never share the 2 cores (an idle vLLM CPU engine still costs
    CPU, and a loaded one needs both cores)."""
    items.sort(key=lambda item: item.path.name not in OWN_STACK_MODULES)


def local_config(data_dir: Path, **overrides: Any) -> StackConfig:
    """A stack in `data_dir` on free loopback ports; `overrides` are other StackConfig fields.
    Start-up may take 420 s: a rollout or a second engine starts beside a loaded one on two
    shared cores."""
    values: dict[str, Any] = {"startup_timeout_seconds": 420, **overrides}
    return StackConfig(
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5),
        metrics_base_port=free_port_run(5),
        envoy_admin_port=free_port(),
        **values,
    )


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # No engine_env: the node-agent binds the engine as `inferplane up` does (its
    # CpuCorePool: the free core to the first replica, a rollout's surge replica unbound).
    # The suite runs on each engine transport (scripts/test.sh runs it a second time).
    config = local_config(
        tmp_path_factory.mktemp("stack"),
        transport=os.environ.get("INFERPLANE_E2E_TRANSPORT", "inproc"),
    )
    with running_stack(config, print) as started:
        yield started


_restarts_seen: dict[str, int] = {}


@pytest.fixture(autouse=True)
def _session_stack_serving(request: pytest.FixtureRequest) -> None:
    """Before each test on the session stack: its kimi-tiny replica serves (waits up to 300 s,
    a replica restarting after an engine death included), and a restart since the last test
    is printed with its last error, so a test that fails after one says why."""
    if "stack" not in request.fixturenames or request.path.name in OWN_STACK_MODULES:
        return
    stack: Stack = request.getfixturevalue("stack")
    deadline = time.monotonic() + 300
    while True:
        try:
            replica = stack.serving_replica()
        except (StackError, grpc.RpcError) as exc:
            replica, problem = None, str(exc)
        if replica is not None and replica.state == nodeagent_pb2.Replica.STATE_READY:
            break
        if replica is not None:
            problem = f"replica {replica.name} is {nodeagent_pb2.Replica.State.Name(replica.state)}"
        assert time.monotonic() < deadline, f"the session stack does not serve: {problem}"
        time.sleep(1)
    seen = _restarts_seen.setdefault(replica.name, replica.restart_count)
    if replica.restart_count != seen:
        _restarts_seen[replica.name] = replica.restart_count
        print(
            f"session stack: {replica.name} restarted ({seen} -> {replica.restart_count}) "
            f"before {request.node.nodeid}; last error: {replica.last_error}"
        )


@pytest.fixture(scope="session")
def api_key(stack: Stack) -> str:
    return stack.create_api_key("e2e")


@pytest.fixture(scope="session")
def client(stack: Stack, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.config.base_url, api_key=api_key, max_retries=0, timeout=120
    )


def engine_core_pid(replica_pid: int, timeout: float = 10.0) -> int:
    """The pid of vLLM's engine core (`VLLM::EngineCore`) in a replica process's tree: the
    process to kill for "the engine died" (the replica process itself is `replica_pid`).

    Raises: AssertionError when none shows up within `timeout` seconds.
    """
    import time

    from inferplane.node_agent.supervisor.process import tree_pids

    deadline = time.monotonic() + timeout
    while True:
        for pid in tree_pids(replica_pid):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("VLLM::EngineCor"):
                return pid
        assert time.monotonic() < deadline, f"no engine core below replica process {replica_pid}"
        time.sleep(0.1)

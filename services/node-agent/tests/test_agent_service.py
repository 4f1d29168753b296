"""NodeAgentService end to end over gRPC on loopback, with fake replica processes
(inferplane.testing.fake_replica, each with a fake engine child) as real processes: boot
replicas from settings, start/drain/stop/get/list, each replica reported at its own replica
process's address (the node-agent serves no InferenceService), node status, clean shutdown."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.nodeagent.v1 import nodeagent_pb2_grpc
from inferplane.node_agent.app import build_app
from inferplane.node_agent.settings import NodeAgentSettings, ReplicaConfig
from inferplane.runtime import RunningServer

State = na.Replica.State
pytestmark = [pytest.mark.timeout(90), pytest.mark.anyio]
FAKE_REPLICA = (sys.executable, "-m", "inferplane.testing.fake_replica")
FAKE_ENGINE = (sys.executable, "-m", "inferplane.testing.fake_engine")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def wait_state(stub, name: str, state: int, timeout: float = 20) -> na.Replica:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while True:
            replica = (await stub.GetReplica(na.GetReplicaRequest(name=name))).replica
            if replica.state == state:
                return replica
            await asyncio.sleep(0.1)


async def serving(address: str, service: str = "") -> bool | None:
    """Whether gRPC health at `address` says SERVING for `service`; None: no such service."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
    return answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_node_agent_service(tmp_path: Path) -> None:
    settings = NodeAgentSettings(
        port=0,
        data_dir=tmp_path,
        json_logs=False,
        replica_command=FAKE_REPLICA,
        engine_command=FAKE_ENGINE,
        engine_health_interval_seconds=0.2,
        grace_period_seconds=1,
        node_name="node-a",
        replicas=(
            ReplicaConfig.from_mapping(
                {
                    "id": "boot-0",
                    "served_model_name": "fake",
                    "model_source": "/m/fake",
                    "transport": "grpc",
                }
            ),
        ),
    )
    server = RunningServer(build_app(settings), settings)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
    try:
        boot = await wait_state(stub, "replicas/boot-0", State.STATE_READY)
        assert boot.engine_pid > 0 and boot.spec.served_model_name == "fake"
        assert boot.metrics_url.startswith("http://127.0.0.1:")
        # The replica's own port, not the node-agent's, which serves no InferenceService.
        assert boot.inference_address.startswith("127.0.0.1:")
        assert boot.inference_address != f"127.0.0.1:{server.port}"
        assert await serving(boot.inference_address)
        assert (
            await serving(f"127.0.0.1:{server.port}", "inferplane.inference.v1.InferenceService")
            is None
        )

        spec = na.ReplicaSpec(served_model_name="other", model_source="/m/other", transport="grpc")
        started = await stub.StartReplica(na.StartReplicaRequest(replica_id="r-1", spec=spec))
        assert started.replica.name == "replicas/r-1"
        again = await stub.StartReplica(na.StartReplicaRequest(replica_id="r-1", spec=spec))
        assert again.replica.start_time == started.replica.start_time  # idempotent
        with pytest.raises(grpc.aio.AioRpcError) as err:
            other = na.ReplicaSpec(served_model_name="x", model_source="/m/x", transport="grpc")
            await stub.StartReplica(na.StartReplicaRequest(replica_id="r-1", spec=other))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await wait_state(stub, "replicas/r-1", State.STATE_READY)

        page = await stub.ListReplicas(na.ListReplicasRequest(page_size=1))
        assert [r.name for r in page.replicas] == ["replicas/boot-0"]
        rest = await stub.ListReplicas(na.ListReplicasRequest(page_token=page.next_page_token))
        assert [r.name for r in rest.replicas] == ["replicas/r-1"] and not rest.next_page_token

        status = (await stub.GetNodeStatus(na.GetNodeStatusRequest())).status
        assert status.node == "node-a" and status.cpu_count >= 1
        assert status.memory_bytes > 1 << 30
        assert len(status.replicas) == 2 and status.agent_version

        r1 = (await stub.GetReplica(na.GetReplicaRequest(name="replicas/r-1"))).replica
        drained = await stub.DrainReplica(
            na.DrainReplicaRequest(name="replicas/r-1", grace_period_seconds=1)
        )
        assert drained.replica.state == State.STATE_DRAINING
        assert drained.replica.inference_address == r1.inference_address
        async with asyncio.timeout(5):  # the replica process got StartReplicaDrain
            while await serving(r1.inference_address):
                await asyncio.sleep(0.05)
        stopped = await stub.StopReplica(na.StopReplicaRequest(name="replicas/r-1"))
        assert stopped.replica.state == State.STATE_STOPPED and stopped.replica.engine_pid == 0

        for name, code in [
            ("replicas/nope", grpc.StatusCode.NOT_FOUND),
            ("models/x", grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetReplica(na.GetReplicaRequest(name=name))
            assert err.value.code() == code
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StartReplica(na.StartReplicaRequest(replica_id="Bad_Id", spec=spec))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
        await server.stop()
    # Shutdown stopped every engine.
    assert (
        not Path(f"/proc/{boot.engine_pid}").exists()
        or "Z" in Path(f"/proc/{boot.engine_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    )

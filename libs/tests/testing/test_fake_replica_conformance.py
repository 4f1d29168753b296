"""The fake replica process's RunConformance (the release's conformance gate on fake stacks):
its configured report once ready, FAILED_PRECONDITION before, each request recorded."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.testing.fake_replica import FakeReplicaControl, serve_fake_replica


async def _scenario() -> None:
    control = FakeReplicaControl("r-1")
    server, address = await serve_fake_replica(control)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
            request = replica_pb2.RunConformanceRequest(live_requests=12, seed=1)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.RunConformance(request)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await control.set_ready()
            control.conformance_report = replica_pb2.ConformanceReport(
                replay_cases=3, replay_passed=2
            )
            response = await stub.RunConformance(request)
            assert (response.report.replay_cases, response.report.replay_passed) == (3, 2)
            assert [r.live_requests for r in control.conformance_requests] == [12, 12]
    finally:
        await server.stop(None)


def test_fake_replica_run_conformance() -> None:
    asyncio.run(_scenario())

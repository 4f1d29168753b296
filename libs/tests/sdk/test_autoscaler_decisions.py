"""`deployments.autoscaler_decisions` (ListAutoscalerDecisions) against a real orchestrator,
blocking and asyncio: a deployment's decisions (none before any load; the decisions a load
makes are read through the SDK in tests/e2e/test_autoscale.py), every deployment's, an unknown
deployment's NOT_FOUND; and the call is a read, retried on UNAVAILABLE."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.sdk import AsyncClient, Client, NotFoundError
from inferplane.sdk import _methods as m


def _autoscaled(fx: Any) -> orchestrator_pb2.Deployment:
    deployment = fx.llama8b(replicas=1, min_replicas=1, max_replicas=2)
    deployment.autoscaling.CopyFrom(orchestrator_pb2.Autoscaling(enabled=True))
    return deployment


def test_decisions_of_one_deployment_or_all(
    client: Client, pki: Any, orchestrator: str, fx: Any
) -> None:
    fx.register_node(pki, orchestrator, gpus=2)
    created = client.deployments.create("llama", _autoscaled(fx))
    assert created.autoscaling.enabled
    assert client.deployments.autoscaler_decisions("llama") == ()
    assert client.deployments.autoscaler_decisions("deployments/llama", page_size=5) == ()
    assert client.deployments.autoscaler_decisions() == ()
    with pytest.raises(NotFoundError):
        client.deployments.autoscaler_decisions("nope")
    assert m.LIST_AUTOSCALER_DECISIONS.retry  # a read


def test_async_decisions(pki: Any, orchestrator: str, fx: Any) -> None:
    fx.register_node(pki, orchestrator, gpus=2)

    async def scenario() -> None:
        async with AsyncClient(orchestrator=orchestrator, security=pki.security()) as c:
            await c.deployments.create("llama", _autoscaled(fx))
            assert await c.deployments.autoscaler_decisions("llama", page_size=3) == ()
            with pytest.raises(NotFoundError):
                await c.deployments.autoscaler_decisions("nope")

    asyncio.run(scenario())

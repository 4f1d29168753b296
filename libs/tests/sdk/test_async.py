"""`AsyncClient` does what `Client` does: keys, deployments, nodes, inference streams, errors
and retries, on grpc.aio."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.runtime.processes.ports import free_port
from inferplane.sdk import (
    AlreadyExistsError,
    AsyncClient,
    NotFoundError,
    UnavailableError,
)


def test_keys(pki: Any, auth: str, fx: Any) -> None:
    async def scenario() -> None:
        async with AsyncClient(auth=auth, security=pki.security(), admin_key=fx.admin_key) as c:
            created = [
                await c.keys.create(auth_pb2.ApiKey(tenant="async", scopes=["inference"]))
                for _ in range(3)
            ]
            listing = c.keys.list(tenant="async", page_size=2)
            pages = [page async for page in listing.pages()]
            assert [len(p.items) for p in pages] == [2, 1]
            names = sorted([k.name async for k in listing])
            assert names == sorted(k.api_key.name for k in created)

            key_id = created[0].api_key.name.removeprefix("api-keys/")
            assert (await c.keys.get(key_id)).name == created[0].api_key.name
            rotated = await c.keys.rotate(key_id)
            assert rotated.secret != created[0].secret
            revoked = await c.keys.revoke(key_id)
            assert revoked.state == auth_pb2.ApiKey.STATE_REVOKED
            await c.keys.delete(key_id)
            with pytest.raises(NotFoundError) as info:
                await c.keys.get(key_id)
            assert (info.value.http_status, info.value.code) == (404, "api_key_not_found")

    asyncio.run(scenario())


def test_deployments_and_nodes(pki: Any, orchestrator: str, fx: Any) -> None:
    fx.register_node(pki, orchestrator, gpus=2)

    async def scenario() -> None:
        async with AsyncClient(orchestrator=orchestrator, security=pki.security()) as c:
            created = await c.deployments.create("llama", fx.llama8b(replicas=2))
            with pytest.raises(AlreadyExistsError):
                await c.deployments.create("llama", fx.llama8b())
            assert (await c.deployments.get("llama")).name == created.name
            assert [d.name async for d in c.deployments.list()] == [created.name]
            replicas = [p.replica_id async for p in c.deployments.replicas("llama", page_size=1)]
            assert replicas == ["llama-0", "llama-1"]
            assert (await c.deployments.explain("llama"))[0].startswith("deployments/llama")
            update = orchestrator_pb2.Deployment(name="llama", replicas=1)
            assert (await c.deployments.update(update, ["replicas"])).replicas == 1

            assert [n.name async for n in c.nodes.list()] == ["nodes/gpu-a"]
            assert (await c.nodes.drain("gpu-a")).condition == "Draining"
            assert (await c.nodes.uncordon("gpu-a")).condition == "Ready"
            assert (await c.nodes.get("gpu-a")).unschedulable is False

            await c.deployments.delete("llama")
            with pytest.raises(NotFoundError):
                await c.deployments.get("llama")

    asyncio.run(scenario())


def test_inference_stream(pki: Any, fx: Any) -> None:
    hello = {"model": "kimi-tiny", "messages": [{"role": "user", "content": "hi"}]}
    with fx.running_replica(pki) as replica:

        async def scenario() -> None:
            async with AsyncClient(inference=replica.address, security=pki.security()) as c:
                response = await c.inference.chat(hello)
                stream = await c.inference.stream_chat(hello)
                text = "".join([ch.choices[0].delta.content async for ch in stream if ch.choices])
                assert text == response.choices[0].message.content.string_value == fx.answer
                embedded = await c.inference.embed({"model": "embed-tiny", "input": "hi"})
                assert len(embedded.data) == 1

        asyncio.run(scenario())


def test_unavailable_retried_then_served_and_create_not(pki: Any, tmp_path: Path, fx: Any) -> None:
    port = free_port()
    waits: list[float] = []

    with contextlib.ExitStack() as stack:

        async def sleep(seconds: float) -> None:
            if not waits:
                stack.enter_context(fx.running_auth(pki, tmp_path / "auth", port=port))
            waits.append(seconds)
            await asyncio.sleep(seconds)

        async def scenario() -> None:
            async with AsyncClient(
                auth=f"127.0.0.1:{port}",
                security=pki.security(),
                admin_key=fx.admin_key,
                retry=fx.fast_retry,
                sleep=sleep,
                timeout=20,
            ) as c:
                with pytest.raises(UnavailableError):
                    await c.keys.create(auth_pb2.ApiKey(tenant="t"))
                assert waits == []
                assert len([k async for k in c.keys.list()]) == 1
                assert waits

        asyncio.run(scenario())


def test_calls_reach_the_leader_among_several_orchestrators(
    pki: Any, tmp_path: Path, fx: Any
) -> None:
    """As `Client`'s (test_calls.py): the standby's NOT_LEADER sends a create on to the
    leader, and later calls go to the leader first."""
    url = f"sqlite:///{tmp_path}/orchestrator.db"
    with (
        fx.running_orchestrator(pki, tmp_path / "a", database_url=url) as leader,
        fx.running_orchestrator(pki, tmp_path / "b", database_url=url) as standby,
    ):

        async def scenario() -> None:
            async with AsyncClient(
                orchestrator=f"{standby},{leader}", security=pki.security(), retry=fx.fast_retry
            ) as c:
                created = await c.deployments.create("d", fx.llama8b())
                assert created.name == "deployments/d"
                assert [d.name async for d in c.deployments.list()] == ["deployments/d"]

        asyncio.run(scenario())

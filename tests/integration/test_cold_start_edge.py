"""Scale from zero through a real Envoy edge (issue 29): the router's picker holds a request
for a deployment with no replica past Envoy's 1 s ext_proc message timeout (its one
`override_message_timeout` extension, within the edge's `max_message_timeout`), sends it as
soon as the routing table brings a replica, and past the route's cold-start budget answers
the client a 503 with Retry-After and `deployment_cold_start` in OpenAI's error shape.

The pieces are `fabric.py`'s (real auth, telemetry, router and Envoy; fake
replica processes), with a routing table the test swaps as the orchestrator would.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest

from inferplane.router.app import build_app as build_router
from inferplane.router.routes import RouteTable
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import Listener
from inferplane.runtime import RunningServer
from inferplane.wire import SSE_DONE

from .fabric import MODEL, Fabric, _body, _eventually

pytestmark = pytest.mark.timeout(120)
SHORT = "kimi-tiny-short"  # the same deployment's budget cut to 2 s (another deployment id)


class SwappedSource:
    """A `RouteSource` whose table the test replaces (`swap`), as the orchestrator's watch
    does when a replica becomes ready."""

    def __init__(self, table: RouteTable) -> None:
        self._table = table
        self._listeners: list[Listener] = []

    def current(self) -> RouteTable:
        return self._table

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)
        listener(self._table)

    def swap(self, table: RouteTable) -> None:
        self._table = table
        for listener in self._listeners:
            listener(table)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class ColdFabric(Fabric):
    """`Fabric` whose router starts with the model at zero replicas (scale to zero)."""

    source: SwappedSource

    async def start_router(self) -> None:
        warm = self.table.routes[MODEL]
        cold = dataclasses.replace(
            warm, endpoints=(), scale_to_zero=True, cold_start_budget_seconds=20
        )
        short = dataclasses.replace(
            cold, model=SHORT, deployment=SHORT, cold_start_budget_seconds=2
        )
        self.warm = RouteTable.of([warm, short], version="warm")
        self.source = SwappedSource(RouteTable.of([cold, short], version="cold"))
        settings = RouterSettings(
            host="127.0.0.1",
            port=self.router_port,
            grace_period_seconds=0.5,
            auth_address=f"127.0.0.1:{self.auth_server.port}",
            auth_pepper_file=str(self.tmp_path / "auth" / "auth-pepper"),
            telemetry_address=f"127.0.0.1:{self.telemetry_server.port}",
            cold_start_retry_after_seconds=4,
        )
        self.router = RunningServer(build_router(settings, source=self.source), settings)
        await self.router.start()

    def cold_waiting(self, deployment: str) -> float:
        assert self.router is not None
        value = self.router.app.registry.get_sample_value(
            "inferplane_router_cold_waiting_requests", {"deployment": deployment}
        )
        return value or 0.0


def test_a_request_held_past_envoys_message_timeout_is_served_when_a_replica_comes(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        fabric = ColdFabric(tmp_path)
        await fabric.start()
        try:
            _, secret = await fabric.key()
            headers = {"authorization": f"Bearer {secret}"}
            async with httpx.AsyncClient(timeout=60) as client:
                held = asyncio.ensure_future(
                    client.post(f"{fabric.url}/v1/chat/completions", json=_body(), headers=headers)
                )
                await _eventually(lambda: fabric.cold_waiting(MODEL) == 1)
                await asyncio.sleep(2.0)  # twice Envoy's 1 s message timeout
                assert not held.done(), "the held request was answered while cold"
                fabric.source.swap(fabric.warm)  # a replica is ready
                response = await held
                assert response.status_code == 200, response.text
                assert response.content.endswith(SSE_DONE)
                assert fabric.replicas[0].calls == 1
                assert fabric.cold_waiting(MODEL) == 0

                short = {**_body(), "model": SHORT}
                started = asyncio.get_running_loop().time()
                refused = await client.post(
                    f"{fabric.url}/v1/chat/completions", json=short, headers=headers
                )
                waited = asyncio.get_running_loop().time() - started
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "4"
                error = refused.json()["error"]
                assert error["code"] == "deployment_cold_start"
                assert error["type"] == "server_error" and "starting" in error["message"]
                assert waited >= 1.9  # held for its 2 s budget, not refused at once
        finally:
            await fabric.stop()

    asyncio.run(scenario())

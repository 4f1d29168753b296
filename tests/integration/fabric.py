"""The data path without an engine, for the integration tests: a real Envoy edge, the real
router as its endpoint picker, real auth and telemetry in front of small fake replica processes
that stream SSE and end every response with summary trailers (`Fabric`, `FakeReplica`), and the
helpers that drive it (`_run`, `_stream`, `_events`, `_eventually`). Used by
`test_picker_reports.py`, `test_cold_start_edge.py` and `test_edge_hostile_path.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.auth.app import AuthComponents
from inferplane.auth.app import build_components as build_auth
from inferplane.auth.domain import SCOPE_INFERENCE, KeySpec, Limits
from inferplane.auth.settings import AuthSettings
from inferplane.edge import EdgeConfig, Endpoint, EnvoyProcess
from inferplane.router.app import build_app as build_router
from inferplane.router.routes import Endpoint as RouteEndpoint
from inferplane.router.routes import ModelRoute, RouteTable
from inferplane.router.settings import RouterSettings
from inferplane.router.sources import StaticRouteSource
from inferplane.routing_client import OutcomeReporter
from inferplane.runtime import ErrorInterceptor, InferplaneError, RunningServer
from inferplane.runtime.processes.ports import free_port
from inferplane.telemetry.app import TelemetryComponents
from inferplane.telemetry.app import build_components as build_telemetry
from inferplane.telemetry.settings import TelemetrySettings
from inferplane.telemetry.store import Query, Sample
from inferplane.testing.clock import FakeClock
from inferplane.wire import SSE_DONE, ResponseSummary, sse_error, sse_event
from inferplane.wire.headers import PICKER, SERVED_BY

MODEL = "kimi-tiny"
PROMPT_TOKENS = 7
WORDS = 13


class FakeReplica(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """A replica process: streams `WORDS` SSE chunks and ends with summary trailers. The first
    message's text picks the behaviour: "fail" sends an error event after two words, "hang"
    waits after its first word (until cancelled), "slow" spaces words by 0.2 s."""

    def __init__(self, replica_id: str, outcomes: OutcomeReporter) -> None:
        self.replica_id = replica_id
        self.outcomes = outcomes
        self.calls = 0
        self.cancelled = asyncio.Event()
        # Seconds between `data: [DONE]` and the trailers: a real replica finishing its own
        # bookkeeping; long enough for a client that closes at [DONE] to close first.
        self.trailer_delay = 0.0

    def _report(self, context: Any, summary: ResponseSummary) -> None:
        """What a replica process does after a request it produced output for: report the
        summary to the picker named in the request (`x-inferplane-picker`)."""
        metadata = dict(context.invocation_metadata())
        if metadata.get(PICKER) and metadata.get("x-request-id"):
            self.outcomes.report(metadata[PICKER], metadata["x-request-id"], summary)

    async def StreamChatCompletionEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.calls += 1
        mode = request.request.messages[0].content.string_value
        summary = ResponseSummary(
            replica_id=self.replica_id, prompt_tokens=PROMPT_TOKENS, ttft_seconds=0.004
        )
        await context.send_initial_metadata(((SERVED_BY, self.replica_id),))
        await asyncio.sleep(0.004)  # "prefill"
        yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=_chunk("", role=True))
        try:
            for i in range(WORDS):
                if mode == "fail" and i == 2:
                    failed = dataclasses.replace(
                        summary,
                        completion_tokens=2,
                        finish_reason="error",
                        error_code="engine_failed",
                    )
                    context.set_trailing_metadata(failed.to_metadata())
                    self._report(context, failed)
                    yield httpbody_pb2.HttpBody(
                        data=sse_error("the engine failed", "server_error", "engine_failed", None)
                    )
                    return
                if mode == "hang" and i == 1:
                    await asyncio.sleep(60)
                if mode == "slow":
                    await asyncio.sleep(0.2)
                yield httpbody_pb2.HttpBody(data=_chunk(f"w{i} "))
        except asyncio.CancelledError:
            self.cancelled.set()
            self._report(context, dataclasses.replace(summary, finish_reason="abort"))
            raise
        done = dataclasses.replace(summary, completion_tokens=WORDS, finish_reason="stop")
        context.set_trailing_metadata(done.to_metadata())
        self._report(context, done)
        yield httpbody_pb2.HttpBody(data=SSE_DONE)
        if self.trailer_delay:
            await asyncio.sleep(self.trailer_delay)


def _chunk(text: str, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"content": text}
    if role:
        delta["role"] = "assistant"
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    return sse_event(json.dumps(chunk).encode())


class Fabric:
    """The running pieces; `url` is the edge."""

    def __init__(
        self,
        tmp_path: Path,
        replicas: int = 1,
        dead_replica: bool = False,
        edge: dict[str, Any] | None = None,
        route: dict[str, Any] | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.edge_overrides = edge or {}
        self.route_overrides = route or {}  # ModelRoute fields (max_model_len, tokenizer)
        self.clock = FakeClock()
        self.outcomes = OutcomeReporter(CollectorRegistry())
        self.replicas = [FakeReplica(f"replica-{i}", self.outcomes) for i in range(replicas)]
        self.dead_port = free_port() if dead_replica else 0
        self.router_port = free_port()
        self._servers: list[grpc.aio.Server] = []
        self.router: RunningServer | None = None
        self.envoy: EnvoyProcess | None = None

    async def start(self) -> None:
        await self.outcomes.start()
        auth_settings = AuthSettings(
            host="127.0.0.1",
            port=0,
            data_dir=self.tmp_path / "auth",
            limits_store="memory",
            grace_period_seconds=0,
        )
        self.auth: AuthComponents = build_auth(auth_settings, clock=self.clock)
        self.auth_server = RunningServer(self.auth.app(), auth_settings)
        await self.auth_server.start()
        tel_settings = TelemetrySettings(host="127.0.0.1", port=0, grace_period_seconds=0)
        self.telemetry: TelemetryComponents = build_telemetry(tel_settings, run_loops=False)
        self.telemetry_server = RunningServer(self.telemetry.app(), tel_settings)
        await self.telemetry_server.start()
        addresses, ids = [], []
        for replica in self.replicas:
            server = grpc.aio.server(interceptors=[ErrorInterceptor("fake-replica")])
            inference_pb2_grpc.add_InferenceServiceServicer_to_server(replica, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self._servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
            ids.append(replica.replica_id)
        if self.dead_port:
            addresses.insert(0, f"127.0.0.1:{self.dead_port}")
            ids.insert(0, "replica-dead")
        self.table = RouteTable.of(
            [
                ModelRoute(
                    MODEL,
                    tuple(
                        RouteEndpoint(a, rid, node="node-a")
                        for a, rid in zip(addresses, ids, strict=True)
                    ),
                    **self.route_overrides,
                )
            ]
        )
        await self.start_router()
        config = EdgeConfig(
            router_endpoints=(Endpoint("127.0.0.1", self.router_port),),
            auth_endpoint=Endpoint("127.0.0.1", self.auth_server.port),
            telemetry_endpoint=Endpoint("127.0.0.1", self.telemetry_server.port),
            replica_endpoints=tuple(Endpoint.parse(a) for a in addresses),
            listen_port=free_port(),
            admin_port=free_port(),
            **self.edge_overrides,
        )
        self.url = f"http://127.0.0.1:{config.listen_port}"
        self.envoy = EnvoyProcess.from_config(config, self.tmp_path / "envoy", concurrency=1)
        await asyncio.to_thread(self.envoy.start)

    async def start_router(self) -> None:
        settings = RouterSettings(
            host="127.0.0.1",
            port=self.router_port,
            grace_period_seconds=0.5,
            auth_address=f"127.0.0.1:{self.auth_server.port}",
            # Auth's pepper: the picker looks keys up in the key table auth streams.
            auth_pepper_file=str(self.tmp_path / "auth" / "auth-pepper"),
            telemetry_address=f"127.0.0.1:{self.telemetry_server.port}",
        )
        self.router = RunningServer(
            build_router(settings, source=StaticRouteSource(self.table)), settings
        )
        await self.router.start()

    async def stop_router(self) -> None:
        assert self.router is not None
        await self.router.stop()
        self.router = None

    async def stop(self) -> None:
        if self.envoy is not None:
            await asyncio.to_thread(self.envoy.stop)
        if self.router is not None:
            await self.router.stop()
        for server in self._servers:
            await server.stop(0)
        await self.outcomes.close()
        await self.telemetry_server.stop()
        await self.auth_server.stop()

    async def key(self, limits: Limits | None = None) -> tuple[str, str]:
        """A new key, once the router's key table (auth's feed) knows it."""
        key, secret = await self.auth.manager.create(
            KeySpec(tenant="acme", scopes=(SCOPE_INFERENCE,), limits=limits or Limits(0, 0, 0)),
            "test",
        )

        def known() -> bool:
            assert self.router is not None
            table = self.router.app.key_table  # type: ignore[attr-defined]
            try:
                table.authenticate({"authorization": f"Bearer {secret}"}, "/v1/chat/completions")
            except InferplaneError:
                return False
            return True

        await _eventually(known)
        return key.key_id, secret

    def accounted(self) -> float:
        value = self.auth.registry.get_sample_value(
            "inferplane_auth_usage_requests_total", {"outcome": "accounted"}
        )
        return value or 0.0

    def edge_overhead(self, stat: str, **labels: str) -> float:
        """`inferplane_edge_overhead_seconds_<stat>` in telemetry (from the edge's access log),
        or `inferplane_edge_log_entries_total` with `stat="entries"`."""
        name = (
            "inferplane_edge_log_entries_total"
            if stat == "entries"
            else f"inferplane_edge_overhead_seconds_{stat}"
        )
        value = self.telemetry.registry.get_sample_value(name, labels)
        return value or 0.0

    def records(self) -> list[Sample]:
        return list(self.telemetry.store.select(Query(0, math.inf, source="router")))


async def _run(tmp_path: Path, body: Callable[[Fabric], Any], **kwargs: Any) -> None:
    fabric = Fabric(tmp_path, **kwargs)
    await fabric.start()
    try:
        await body(fabric)
    finally:
        await fabric.stop()


def _body(text: str = "hi") -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": text}]}


async def _stream(
    client: httpx.AsyncClient, url: str, secret: str, text: str = "hi"
) -> tuple[int, bytes]:
    headers = {"authorization": f"Bearer {secret}"}
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=_body(text), headers=headers
    ) as response:
        return response.status_code, await response.aread()


def _events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of an SSE body (without `[DONE]`)."""
    return [
        json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")
    ]


async def _eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)

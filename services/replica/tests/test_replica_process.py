"""The replica process's life over real gRPC (ReplicaProcess with a fake engine host): health
follows the engine, drain stops admission but lets in-flight requests finish, shutdown aborts
what outlives the grace with an error event, engine death ends streams with engine_failed and
exits non-zero, picked requests are reported to their picker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.api.router.v1 import outcome_pb2, outcome_pb2_grpc
from inferplane.replica.app import EXIT_ENGINE_DIED, EXIT_OK, ReplicaProcess
from inferplane.replica.engines.base import EngineError, EngineOutput, SamplingParams
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.settings import ReplicaSettings, parse_args
from inferplane.replica.testing.pipeline import kimi_tiny_assets, kimi_tiny_ids, kimi_tiny_spec
from inferplane.replica_contract import ReplicaFlags
from inferplane.runtime import OPENAI_ERROR_CODE_KEY
from inferplane.wire import ResponseSummary, completion_request_from_dict
from inferplane.wire.headers import PICKER

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
IDS = kimi_tiny_ids("Here is a short note about Paris. I hope it helps.<|im_end|>")


class HeldEngine:
    """Streams `IDS` one per increment but holds every request after `hold_at` increments
    until `release`; `abort` ends a held stream with finish_reason abort (as vLLM does), `kill`
    fails every stream (a dead engine core)."""

    def __init__(self, hold_at: int = 2) -> None:
        self._hold_at = hold_at
        self.go = asyncio.Event()
        self.held = asyncio.Event()
        self._aborted: set[str] = set()
        self._wake = asyncio.Event()
        self._dead = False

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        for i, token in enumerate(IDS):
            if i == self._hold_at:
                self.held.set()
                while not (self.go.is_set() or request_id in self._aborted or self._dead):
                    self._wake.clear()
                    await self._wake.wait()
            if self._dead:
                raise EngineError("engine core died", retryable=i == 0)
            if request_id in self._aborted:
                yield EngineOutput((), True, "abort", 5, 0, i)
                return
            await asyncio.sleep(0)
            last = i == len(IDS) - 1
            yield EngineOutput((token,), last, "stop" if last else None, 5, 0, i + 1)

    def release(self) -> None:
        self.go.set()
        self._wake.set()

    def kill(self) -> None:
        self._dead = True
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self._wake.set()

    async def healthy(self) -> bool:
        return not self._dead

    async def close(self) -> None:
        return None


class FakeHost:
    """An engine host whose start completes on `started.set()` and whose engine dies on
    `die()`."""

    def __init__(self, engine: HeldEngine) -> None:
        self.engine = engine
        self.started = asyncio.Event()
        self.dead = asyncio.Event()
        self.shut_down = False

    async def start(self) -> HeldEngine:
        await self.started.wait()
        return self.engine

    async def wait_dead(self) -> str:
        await self.dead.wait()
        return "the engine core was killed"

    def check_soon(self) -> None:
        return None

    def die(self) -> None:
        self.engine.kill()
        self.dead.set()

    async def shutdown(self) -> None:
        self.shut_down = True


class FakePicker(outcome_pb2_grpc.OutcomeServiceServicer):  # type: ignore[misc]
    """The router's OutcomeService (served by `run_process` at `address`): records each
    reported (request id, summary)."""

    def __init__(self) -> None:
        self.address = ""
        self.outcomes: list[tuple[str, ResponseSummary]] = []

    async def ReportOutcomes(self, request: Any, context: Any) -> Any:
        self.outcomes.extend(
            (o.request_id, ResponseSummary.from_metadata(dict(o.summary))) for o in request.outcomes
        )
        return outcome_pb2.ReportOutcomesResponse(matched=len(request.outcomes))


class Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.inference = inference_pb2_grpc.InferenceServiceStub(channel)
        self.control = replica_pb2_grpc.ReplicaProcessServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def status(self, service: str = "") -> int:
        response = await self.health.Check(health_pb2.HealthCheckRequest(service=service))
        return response.status

    async def load(self) -> replica_pb2.GetReplicaLoadResponse:
        return await self.control.GetReplicaLoad(replica_pb2.GetReplicaLoadRequest())

    def events(self, metadata: Sequence[tuple[str, str]] = ()) -> Any:
        request = completion_request_from_dict({"model": "kimi-tiny", "prompt": "Paris?"})
        return self.inference.StreamCompletionEvents(
            pb.StreamCompletionEventsRequest(request=request), metadata=tuple(metadata)
        )


def run_process(
    body: Callable[[Client, FakeHost, asyncio.Event], Awaitable[None]],
    *,
    drain_grace: float = 5.0,
    picker: FakePicker | None = None,
) -> int:
    """Runs a ReplicaProcess on a free port with a FakeHost; `body` drives it; returns the
    process's exit code. A `picker` is served (on a free port) until the process exited."""
    settings = ReplicaSettings.of(
        ReplicaFlags(replica_id="r1", drain_grace_seconds=drain_grace), kimi_tiny_spec()
    )

    async def scenario() -> int:
        assets = ModelAssetsCache()
        assets.put(kimi_tiny_assets(), "kimi_k2")
        host = FakeHost(HeldEngine())
        process = ReplicaProcess(settings, host, assets=assets)
        stop = asyncio.Event()
        picker_server = grpc.aio.server()
        if picker is not None:
            outcome_pb2_grpc.add_OutcomeServiceServicer_to_server(picker, picker_server)
            picker.address = f"127.0.0.1:{picker_server.add_insecure_port('127.0.0.1:0')}"
            await picker_server.start()
        running = asyncio.ensure_future(process.run(stop))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{process.port}") as channel:
                await body(Client(channel), host, stop)
                code = await asyncio.wait_for(running, 20)
        finally:
            await picker_server.stop(0)
        assert host.shut_down
        return code

    return asyncio.run(scenario())


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.01)


async def read_all(call: Any) -> list[Any]:
    """The rest of a call read with `read()` (a call read once that way cannot be iterated)."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


def last_event(bodies: Sequence[Any]) -> bytes:
    return [e for e in b"".join(b.data for b in bodies).split(b"\n\n") if e][-1]


def test_health_is_not_serving_until_the_engine_is_ready_then_serving() -> None:
    """The port answers while the engine starts: health NOT_SERVING (both "" and
    InferenceService), load says engine not ready, a request is UNAVAILABLE replica_not_ready
    (Envoy retries elsewhere); once the engine is up, SERVING and requests run."""

    async def body(client: Client, host: FakeHost, stop: asyncio.Event) -> None:
        assert await client.status() == NOT_SERVING
        assert await client.status("inferplane.inference.v1.InferenceService") == NOT_SERVING
        assert not (await client.load()).engine_ready
        assert not (await client.load()).HasField("artifacts")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in client.events():
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(info.value.trailing_metadata())[OPENAI_ERROR_CODE_KEY] == "replica_not_ready"
        host.engine.release()
        host.started.set()
        await until(lambda: _is(client.status(), SERVING))
        load = await client.load()
        assert (load.replica_id, load.engine_ready, load.draining) == ("r1", True, False)
        # What it runs, reported with the load once ready (issue 30; server/artifacts.py).
        assert load.artifacts.engine_version and load.artifacts.parser == "kimi_k2/kimi_k2"
        assert load.artifacts.model_digest.startswith("sha256:")
        assert last_event([b async for b in client.events()]) == b"data: [DONE]"
        stop.set()

    assert run_process(body) == EXIT_OK


async def _is(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish() -> None:
    """StartReplicaDrain: health NOT_SERVING, GetReplicaLoad counts the in-flight request and
    says draining, a new request gets UNAVAILABLE replica_draining (with the summary's replica),
    and the request in flight still completes with [DONE]."""

    async def body(client: Client, host: FakeHost, stop: asyncio.Event) -> None:
        host.started.set()
        await until(lambda: _is(client.status(), SERVING))
        call = client.events()
        first = await call.read()
        await host.engine.held.wait()
        assert (await client.load()).in_flight_requests == 1
        drained = await client.control.StartReplicaDrain(replica_pb2.StartReplicaDrainRequest())
        assert drained.in_flight_requests == 1
        assert await client.status() == NOT_SERVING
        load = await client.load()
        assert (load.draining, load.in_flight_requests, load.engine_ready) == (True, 1, True)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in client.events():
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        trailers = info.value.trailing_metadata()
        assert dict(trailers)[OPENAI_ERROR_CODE_KEY] == "replica_draining"
        assert ResponseSummary.from_metadata(trailers).replica_id == "r1"
        host.engine.release()
        rest = await read_all(call)
        assert last_event([first, *rest]) == b"data: [DONE]"
        assert (await client.load()).in_flight_requests == 0
        stop.set()

    assert run_process(body) == EXIT_OK


def test_shutdown_aborts_what_outlives_the_drain_grace_with_an_error_event() -> None:
    """SIGTERM (the stop event): requests still running after drain_grace_seconds are aborted
    in the engine and their SSE streams end with an error event, not a reset; exit code 0 and
    the engine is shut down."""

    async def body(client: Client, host: FakeHost, stop: asyncio.Event) -> None:
        host.started.set()
        await until(lambda: _is(client.status(), SERVING))
        call = client.events()
        bodies = [await call.read()]
        await host.engine.held.wait()
        stop.set()
        bodies += await read_all(call)
        error = json.loads(last_event(bodies).removeprefix(b"data: "))["error"]
        assert error["code"] == "engine_failed" and "shut down" in error["message"]
        assert await call.code() == grpc.StatusCode.OK
        summary = ResponseSummary.from_metadata(await call.trailing_metadata())
        assert (summary.finish_reason, summary.error_code) == ("error", "engine_failed")

    assert run_process(body, drain_grace=0.2) == EXIT_OK


def test_engine_death_ends_streams_with_an_error_event_and_exits_non_zero() -> None:
    """The engine dies mid-stream: the stream ends with an engine_failed error event, health
    goes NOT_SERVING, and the process exits non-zero so that the node-agent restarts it."""

    async def body(client: Client, host: FakeHost, stop: asyncio.Event) -> None:
        host.started.set()
        await until(lambda: _is(client.status(), SERVING))
        call = client.events()
        bodies = [await call.read()]
        await host.engine.held.wait()
        host.die()
        bodies += await read_all(call)
        error = json.loads(last_event(bodies).removeprefix(b"data: "))["error"]
        assert error["code"] == "engine_failed"

    assert run_process(body) == EXIT_ENGINE_DIED


def test_picked_requests_are_reported_to_their_picker_up_to_the_last_one_at_shutdown() -> None:
    """The process reports each picked request to the picker its `x-inferplane-picker` names: a
    completed one (stop), and one aborted at shutdown (error) whose report has reached the
    picker by the time the process exits (the reporter closes after the server stopped)."""
    picker = FakePicker()

    async def body(client: Client, host: FakeHost, stop: asyncio.Event) -> None:
        def picked(request_id: str) -> tuple[tuple[str, str], ...]:
            return (("x-request-id", request_id), (PICKER, picker.address))

        host.started.set()
        await until(lambda: _is(client.status(), SERVING))
        host.engine.release()
        assert last_event([b async for b in client.events(picked("done"))]) == b"data: [DONE]"
        host.engine.go.clear()
        call = client.events(picked("cut"))
        bodies = [await call.read()]
        await host.engine.held.wait()
        stop.set()
        bodies += await read_all(call)
        assert b"engine_failed" in last_event(bodies)

    assert run_process(body, drain_grace=0.2, picker=picker) == EXIT_OK
    finished = {rid: (s.finish_reason, s.replica_id) for rid, s in picker.outcomes}
    assert finished == {"done": ("stop", "r1"), "cut": ("error", "r1")}


def test_command_line_contract(tmp_path: Any) -> None:
    """The supervisor's command line parses into settings: spec from proto JSON, the engine
    command after `--`; a child transport without its engine command is refused."""
    from google.protobuf import json_format

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json_format.MessageToJson(kimi_tiny_spec()))
    s = parse_args(
        [
            "--replica-id",
            "r9",
            "--spec-file",
            str(spec_file),
            "--port",
            "1234",
            "--transport",
            "grpc",
            "--engine-address",
            "127.0.0.1:5555",
            "--drain-grace-seconds",
            "7",
            "--plaintext",
            "--",
            "python",
            "-m",
            "x",
        ]
    )
    assert (s.flags.replica_id, s.port, s.flags.transport, s.flags.engine_address) == (
        "r9",
        1234,
        "grpc",
        "127.0.0.1:5555",
    )
    assert s.spec.served_model_name == "kimi-tiny" and s.engine_argv == ("python", "-m", "x")
    assert s.flags.drain_grace_seconds == 7.0 and s.flags.startup_timeout_seconds == 180.0
    from inferplane.runtime import ConfigError

    with pytest.raises(ConfigError):
        parse_args(
            [
                "--replica-id",
                "r",
                "--spec-file",
                str(spec_file),
                "--transport",
                "grpc",
                "--plaintext",
            ]
        )
    with pytest.raises(SystemExit):  # no identity and no explicit development flag
        parse_args(["--replica-id", "r", "--spec-file", str(spec_file)])

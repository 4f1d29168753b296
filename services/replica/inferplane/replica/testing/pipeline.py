"""Small hand-written fakes of the engine interface, for tests and benchmarks (no mocks).

`ScriptedEngine` replays scripted `EngineOutput`s (token ids produced by a real tokenizer from
scripted model output) and records what the pipeline asked of it, aborts included; its `embed`
returns `fake_embedding`s (deterministic unit vectors, cut to `dimensions` as a Matryoshka
pooler does). Given a `FakeKvCache` (`inferplane.testing.fake_kv`), its generations hold KV
blocks, wait and get preempted as vLLM's would, and it reports them (`engine_stats`: the
replica's `WatchReplicaState` streams them as it streams a real engine's).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import cache
from typing import Any

import grpc

from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.parsers import PlainSession
from inferplane.replica.engines.base import (
    Admitted,
    EngineError,
    EngineOutput,
    SamplingParams,
)
from inferplane.replica.engines.engine_stats import UNKNOWN, EngineStats
from inferplane.replica.engines.kv_events import KvBlockIndex
from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache, load_model_assets
from inferplane.replica.pipeline.generate import Generation
from inferplane.replica_contract import Task, Transport
from inferplane.runtime import ErrorInterceptor, UnavailableError
from inferplane.testing.clock import FakeClock
from inferplane.testing.fake_http_engine import fake_embedding
from inferplane.testing.fake_kv import FakeKvCache


def script(
    token_ids: Sequence[int],
    *,
    per_increment: int = 1,
    finish_reason: str = "stop",
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    matched_stop: str | int | None = None,
    separate_finish: bool = False,
) -> list[EngineOutput]:
    """Token ids → the increments an engine would stream: `per_increment` ids each, cumulative
    counts, the last one `finished` with `finish_reason`. With `separate_finish` the finish
    comes as an extra increment without ids, as vLLM's gRPC stream sends it (the chunks, then a
    `complete` message)."""
    if separate_finish:
        body = script(
            token_ids,
            per_increment=per_increment,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
        )
        body = [
            EngineOutput(
                o.token_ids, False, None, o.prompt_tokens, o.cached_tokens, o.completion_tokens
            )
            for o in body
        ]
        return [
            *body,
            EngineOutput(
                (), True, finish_reason, prompt_tokens, cached_tokens, len(token_ids), matched_stop
            ),
        ]
    outputs: list[EngineOutput] = []
    ids = list(token_ids)
    for start in range(0, max(len(ids), 1), per_increment):
        chunk = tuple(ids[start : start + per_increment])
        last = start + per_increment >= len(ids)
        outputs.append(
            EngineOutput(
                token_ids=chunk,
                finished=last,
                finish_reason=finish_reason if last else None,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached_tokens,
                completion_tokens=min(start + per_increment, len(ids)),
                matched_stop=matched_stop if last else None,
            )
        )
    return outputs


class ScriptedEngine:
    """An `EngineClient` that replays `outputs` for every request.

    Args:
        outputs: the increments to stream.
        fail_at: raise `EngineError` instead of streaming the increment at this index
            (`embed`: 0 fails it).
        rejects: that error is the engine refusing the request (`EngineError.rejected`).
        block_at: wait forever before this index (until cancelled): a slow engine
            (`embed`: 0 blocks it).
        delay: seconds to sleep before each increment (and before an `embed` answers; 0
            still yields to the loop).
        embedding_size: the length of `embed`'s vectors (`fake_embedding`).
        kv: the engine's KV cache model (None: no KV model, the engine reports nothing).

    Attributes:
        requests: `(request_id, prompt_ids, params)` of every `generate` call.
        embeddings: `(request_id, inputs, dimensions)` of every `embed` call.
        cancelled: request ids whose iteration (or `embed`) was cancelled or closed before
            finishing.
        aborted: request ids passed to `abort`.
    """

    def __init__(
        self,
        outputs: Sequence[EngineOutput] | Callable[[SamplingParams], Sequence[EngineOutput]],
        *,
        fail_at: int | None = None,
        rejects: bool = False,
        block_at: int | None = None,
        delay: float = 0.0,
        embedding_size: int = 64,
        kv: FakeKvCache | None = None,
    ) -> None:
        self._outputs = outputs
        self.kv = kv
        self._fail_at = fail_at
        self._rejects = rejects
        self._block_at = block_at
        self._delay = delay
        self.embedding_size = embedding_size
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.embeddings: list[tuple[str, list[list[int]], int | None]] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.blocked = asyncio.Event()
        self.closed = False

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        self.requests.append((request_id, list(prompt_ids), params))
        outputs = self._outputs(params) if callable(self._outputs) else self._outputs
        done = False
        kv = self.kv
        if kv is not None:
            try:
                await kv.start(request_id, len(prompt_ids), sum(len(o.token_ids) for o in outputs))
            except ValueError as exc:
                raise EngineError(str(exc), rejected=True) from exc
        try:
            for i, out in enumerate(outputs):
                if kv is not None:
                    for _token in out.token_ids:
                        await kv.step(request_id)
                if i == self._fail_at:
                    if self._rejects:
                        raise EngineError("the schema does not compile", rejected=True)
                    raise EngineError("engine process died", retryable=i == 0)
                if i == self._block_at:
                    self.blocked.set()
                    await asyncio.Event().wait()
                await asyncio.sleep(self._delay)
                if out.finished:
                    done = True
                yield out
        finally:
            if kv is not None:
                kv.finish(request_id)
            if not done:
                self.cancelled.append(request_id)

    def engine_stats(self) -> EngineStats:
        """The KV model's state (`engine_stats.ReportsEngineState`; zeros without one)."""
        kv = self.kv
        if kv is None:
            return UNKNOWN
        return EngineStats(
            block_size=kv.block_size,
            total_kv_blocks=kv.total_kv_blocks,
            free_kv_blocks=kv.free_kv_blocks,
            running_requests=kv.running_requests,
            waiting_requests=kv.waiting_requests,
            preemptions_total=kv.preemptions_total,
        )

    @property
    def kv_blocks(self) -> KvBlockIndex | None:
        """No KV events from this fake."""
        return None

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        self.embeddings.append((request_id, [list(ids) for ids in inputs], dimensions))
        if self._fail_at == 0:
            if self._rejects:
                raise EngineError("dimensions not supported", rejected=True)
            raise EngineError("engine process died", retryable=True)
        try:
            if self._block_at == 0:
                self.blocked.set()
                await asyncio.Event().wait()
            await asyncio.sleep(self._delay)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        return [fake_embedding(ids, self.embedding_size, dimensions) for ids in inputs]

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        self.closed = True


class FakeReplica:
    """A `LocalReplica`: admits while `ready`, counts requests in flight."""

    def __init__(self, replica_id: str, spec: nodeagent_pb2.ReplicaSpec, engine: object) -> None:
        self._id = replica_id
        self._spec = spec
        self._engine = engine
        self.ready = True
        self.in_flight = 0
        self.admitted = 0
        # What each admitted request is charged (the real replica meters it: gpu_share.py).
        self.gpu_seconds_per_request = 0.0

    @property
    def replica_id(self) -> str:
        return self._id

    @property
    def spec(self) -> nodeagent_pb2.ReplicaSpec:
        return self._spec

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self._engine

    @asynccontextmanager
    async def _admit(self) -> AsyncIterator[Admitted]:
        if not self.ready:
            raise UnavailableError(f"replica {self._id} is not ready", code="replica_not_ready")
        self.in_flight += 1
        self.admitted += 1
        admitted = Admitted()
        try:
            yield admitted
        finally:
            self.in_flight -= 1
            admitted.gpu_seconds = self.gpu_seconds_per_request

    def admit(self):  # type: ignore[no-untyped-def]
        return self._admit()


class TickingClock(FakeClock):
    """The shared `FakeClock`, advancing `step` seconds on every `monotonic()` reading: a
    scripted engine's increments then arrive `step` apart without anyone sleeping or calling
    `advance`, so TTFT and inter-token latencies are known, non-zero numbers. Wall time starts
    at `wall` (epoch seconds: the `created` of responses and model entries)."""

    def __init__(self, wall: float = 1_700_000_000.0, step: float = 0.01) -> None:
        super().__init__(start=datetime.fromtimestamp(wall, UTC))
        self.step = step

    def monotonic(self) -> float:
        self.advance(self.step)
        return super().monotonic()


def kimi_tiny_generation(
    engine: Any, *, request_id: str = "cmpl-1", clock: TickingClock | None = None
) -> Generation:
    """A `Generation` of the fixture model on `engine` (prompt `[1, 2, 3]`, 16 tokens at
    most, no parser), arriving now on `clock` (default: a fresh `TickingClock`)."""
    clock = clock or TickingClock()
    assets = kimi_tiny_assets()
    return Generation(
        engine=engine,
        request_id=request_id,
        prompt_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=16),
        backend=assets.backend,
        stop_token_ids=assets.eos_token_ids,
        session=PlainSession(),
        clock=clock,
        started=clock.monotonic(),
    )


@asynccontextmanager
async def serve_inference(
    servicer: inference_pb2_grpc.InferenceServiceServicer,
) -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    """Serves `servicer` on a loopback port behind the runtime's ErrorInterceptor and yields a
    client stub: the real gRPC path, in process."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor("replica")])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield inference_pb2_grpc.InferenceServiceStub(channel)
    finally:
        await server.stop(0)


# -- the fixture model, served by the pipeline over real gRPC ---------------------------------


def kimi_tiny_spec() -> nodeagent_pb2.ReplicaSpec:
    """A replica spec for models/kimi-tiny with the kimi_k2 parser (2048-token context): a
    fresh copy on every call, the caller's to change."""
    spec = nodeagent_pb2.ReplicaSpec()
    spec.CopyFrom(_kimi_tiny_spec())
    return spec


@cache
def _kimi_tiny_spec() -> nodeagent_pb2.ReplicaSpec:
    from inferplane.fixtures import kimi_tiny

    return nodeagent_pb2.ReplicaSpec(
        deployment=kimi_tiny.SERVED_MODEL_NAME,
        served_model_name=kimi_tiny.SERVED_MODEL_NAME,
        model_source=str(kimi_tiny.model_path()),
        max_model_len=2048,
        reasoning_parser="kimi_k2",
        tool_parser="kimi_k2",
        revision="rev-1",
    )


@cache
def kimi_tiny_assets() -> ModelAssets:
    """The fixture model's real assets (tokenizer, parser), loaded once per process."""
    return load_model_assets(_kimi_tiny_spec())


def kimi_tiny_ids(text: str) -> list[int]:
    """The ids the fixture model emits for `text` (its real tokenizer; markers are one id)."""
    # The fast backend directly: same ids, and no "longer than the model" warning for benches.
    return list(kimi_tiny_assets().backend.encode(text, add_special_tokens=False).ids)


def embed_tiny_spec() -> nodeagent_pb2.ReplicaSpec:
    """A replica spec for models/embed-tiny with task `embed` (512-token context, no parser):
    a fresh copy on every call, the caller's to change."""
    from inferplane.fixtures import embed_tiny

    return nodeagent_pb2.ReplicaSpec(
        deployment=embed_tiny.SERVED_MODEL_NAME,
        served_model_name=embed_tiny.SERVED_MODEL_NAME,
        model_source=str(embed_tiny.model_path()),
        max_model_len=embed_tiny.MAX_MODEL_LEN,
        task=Task.EMBED,
        revision="rev-1",
    )


def whisper_tiny_spec() -> nodeagent_pb2.ReplicaSpec:
    """A replica spec for models/whisper-tiny with task `transcribe` (448 decoder tokens,
    float32, no parser, `inproc`): a fresh copy on every call, the caller's to change."""
    from inferplane.fixtures import whisper_tiny

    return nodeagent_pb2.ReplicaSpec(
        deployment=whisper_tiny.SERVED_MODEL_NAME,
        served_model_name=whisper_tiny.SERVED_MODEL_NAME,
        model_source=str(whisper_tiny.model_path()),
        max_model_len=whisper_tiny.MAX_MODEL_LEN,
        dtype="float32",
        task=Task.TRANSCRIBE,
        transport=Transport.INPROC,
        revision="rev-1",
    )


@cache
def embed_tiny_assets() -> ModelAssets:
    """The embedding fixture's real assets (tokenizer, Matryoshka sizes), loaded once."""
    return load_model_assets(embed_tiny_spec())


def run_scenario(
    engine: ScriptedEngine,
    body: Callable[[inference_pb2_grpc.InferenceServiceStub], Awaitable[None]],
    *,
    replicas: Sequence[FakeReplica] | None = None,
    **servicer_options: Any,
) -> None:
    """Serves the fixture model on one replica ("r1", or `replicas`) whose engine is `engine`,
    runs `body` with a client stub, then lets scheduled outcome deliveries run. Replicas of
    `embed_tiny_spec()` get the embedding fixture's assets. One replica is served by the
    replica's own server; several by a `FakeNode` (each its own server, chosen by model)."""
    from inferplane.replica.server import InferenceServicer
    from inferplane.replica.testing.node import FakeNode

    assets = ModelAssetsCache()
    assets.put(kimi_tiny_assets(), "kimi_k2")
    replicas = replicas or [FakeReplica("r1", kimi_tiny_spec(), engine)]
    if any(r.spec.task == Task.EMBED for r in replicas):
        assets.put(embed_tiny_assets(), None)
    servicer_options.setdefault("clock", TickingClock())
    servicer: inference_pb2_grpc.InferenceServiceServicer
    if len(replicas) == 1:
        servicer = InferenceServicer(replicas[0], assets, **servicer_options)
    else:
        servicer = FakeNode(replicas, assets, **servicer_options)

    async def scenario() -> None:
        async with serve_inference(servicer) as stub:
            await body(stub)
        await asyncio.sleep(0)

    asyncio.run(scenario())

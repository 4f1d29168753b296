"""The replica process's one replica: admission, load, drain, and its engine's requests.

`ReplicaState` is the server's one `LocalReplica` (`inferplane.replica.server` takes it
directly: the endpoint picker already chose this replica for the request's model, aliases
included); `admit` decides whether it may run now.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import Any, TypeVar

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica.engines.base import (
    Admitted,
    EngineClient,
    EngineError,
    EngineOutput,
    SamplingParams,
    SpeechEngine,
    SpeechParams,
    SpeechResult,
    SpeechUsage,
)
from inferplane.replica.pipeline.gpu_share import GpuShareMeter, replica_gpu_share
from inferplane.runtime import UnavailableError

T = TypeVar("T")


class Phase(enum.Enum):
    """Where the replica is in its life: STARTING → READY → DRAINING, or → DEAD."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class _NoEngine:
    """The engine slot before start-up finished (never reached: admit refuses first)."""

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        raise EngineError("the engine is not started", retryable=True)

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        raise EngineError("the engine is not started", retryable=True)

    async def abort(self, request_id: str) -> None:
        return None

    async def healthy(self) -> bool:
        return False

    async def close(self) -> None:
        return None


class TrackedEngine:
    """The engine as the pipeline sees it here: knows the requests in flight, so that shutdown
    can abort them (their streams then end with an error event, not a reset), and reports an
    engine failure at once (`on_failure`: the watchdog checks the engine then).

    Generations are tracked per request, not per token: `generate` hands out the inner
    engine's own stream, and the `Generation` reports the request's end (`TracksRequests`:
    `was_shut` at its finish, `release` when it leaves; an `EngineError` there counts as a
    failure). Embeddings and speech run as tasks `abort_all` can cancel.
    """

    def __init__(self, inner: EngineClient, on_failure: Callable[[], object]) -> None:
        self.inner = inner
        self._on_failure = on_failure
        self._active: set[str] = set()
        self._shut: set[str] = set()
        self._embeddings: dict[str, asyncio.Future[Any]] = {}
        self._speech_ids = itertools.count()

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """The inner engine's stream for `request_id`, which is in flight until its
        generation calls `release`."""
        self._active.add(request_id)
        return self.inner.generate(request_id, prompt_token_ids, params)

    def was_shut(self, request_id: str) -> bool:
        """True when `abort_all` aborted `request_id`."""
        return request_id in self._shut

    def release(self, request_id: str, *, failed: bool) -> None:
        """`request_id` left its generation; `failed`: with an EngineError (reported to
        `on_failure`)."""
        self._active.discard(request_id)
        self._shut.discard(request_id)
        if failed:
            self._on_failure()

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        """The inner engine's `embed`, run as a task `abort_all` can cancel (cancelling aborts
        it in the engine); a request cut short that way raises EngineError."""
        return await self._cancellable(
            request_id, self.inner.embed(request_id, inputs, dimensions=dimensions)
        )

    async def transcribe(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> SpeechResult:
        """The inner engine's `transcribe` (`api.SpeechEngine`), run as a task `abort_all`
        can cancel, like `embed`.

        Raises:
            EngineError: the inner engine serves no speech, failed, or the replica shut down.
        """
        inner = self._speech_engine()
        request_id = f"speech-{next(self._speech_ids)}"
        result: SpeechResult = await self._cancellable(
            request_id, inner.transcribe(wav, params, usage)
        )
        return result

    async def _cancellable(self, request_id: str, work: Awaitable[T]) -> T:
        """Runs `work` as a task `abort_all` can cancel (it is kept under `request_id`); a
        request cut short that way raises a retryable EngineError, an EngineError of the
        engine counts as a failure."""
        task = asyncio.ensure_future(work)
        self._embeddings[request_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if request_id in self._shut and not (current and current.cancelling()):
                raise EngineError(
                    "the replica shut down before the request finished", retryable=True
                ) from None
            raise
        except EngineError:
            self._on_failure()
            raise
        finally:
            del self._embeddings[request_id]
            self._shut.discard(request_id)

    async def transcribe_stream(
        self, wav: bytes, params: SpeechParams, usage: SpeechUsage
    ) -> AsyncIterator[str]:
        """The inner engine's `transcribe_stream`; after `abort_all` the next piece of text
        ends it with an EngineError (its stream then ends with an error event)."""
        inner = self._speech_engine()
        request_id = f"speech-{next(self._speech_ids)}"
        self._active.add(request_id)
        try:
            async with aclosing(inner.transcribe_stream(wav, params, usage)) as stream:
                async for text in stream:
                    if request_id in self._shut:
                        raise EngineError("the replica shut down before the request finished")
                    yield text
        except EngineError:
            self._on_failure()
            raise
        finally:
            self._active.discard(request_id)
            self._shut.discard(request_id)

    def _speech_engine(self) -> SpeechEngine:
        if not isinstance(self.inner, SpeechEngine):
            raise EngineError("this engine transport serves no speech-to-text", rejected=True)
        return self.inner

    async def abort_all(self) -> int:
        """Aborts every request in flight; returns how many."""
        ids = list(self._active)
        self._shut.update(ids)
        for request_id in ids:
            if not request_id.startswith("speech-"):  # vLLM's own ids for those
                await self.inner.abort(request_id)
        for request_id, task in list(self._embeddings.items()):
            self._shut.add(request_id)
            task.cancel()
        return len(ids) + len(self._embeddings)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def healthy(self) -> bool:
        return await self.inner.healthy()

    async def close(self) -> None:
        await self.inner.close()


class ReplicaState:
    """This process's replica (`LocalReplica`).

    Args:
        replica_id: the replica id.
        spec: what it runs.
        on_phase: called with the new phase after each change (health follows it).
        monotonic: seconds, for the GPU-seconds each request is charged.
    """

    def __init__(
        self,
        replica_id: str,
        spec: nodeagent_pb2.ReplicaSpec,
        on_phase: Callable[[Phase], object] = lambda _phase: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._id = replica_id
        self._spec = spec
        self._on_phase = on_phase
        self._gpu = GpuShareMeter(replica_gpu_share(spec), monotonic)
        self._engine: EngineClient = _NoEngine()
        self.phase = Phase.STARTING
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- LocalReplica --------------------------------------------------------------------------

    @property
    def replica_id(self) -> str:
        return self._id

    @property
    def spec(self) -> nodeagent_pb2.ReplicaSpec:
        return self._spec

    @property
    def engine(self) -> EngineClient:
        return self._engine

    @asynccontextmanager
    async def _admitted(self) -> AsyncIterator[Admitted]:
        self.in_flight += 1
        self._idle.clear()
        admitted = Admitted()
        token = self._gpu.start()
        try:
            yield admitted
        finally:
            admitted.gpu_seconds = self._gpu.end(token)
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    def admit(self) -> AbstractAsyncContextManager[Admitted]:
        """Counts a generation request in flight (and its GPU-seconds: `Admitted`).

        Raises:
            UnavailableError: draining (code replica_draining), not started yet
                (replica_not_ready) or its engine died (engine_failed); Envoy retries these on
                the next endpoint.
        """
        phase = self.phase
        if phase is not Phase.READY:
            if phase is Phase.DRAINING:
                raise UnavailableError(f"replica {self._id} is draining", code="replica_draining")
            if phase is Phase.DEAD:
                raise UnavailableError(
                    f"the engine of replica {self._id} failed",
                    reason="ENGINE_FAILED",
                    code="engine_failed",
                )
            raise UnavailableError(f"replica {self._id} is not ready", code="replica_not_ready")
        return self._admitted()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def engine_ready(self) -> bool:
        return self.phase in (Phase.READY, Phase.DRAINING)

    def set_ready(self, engine: EngineClient) -> None:
        """The engine answers: admit requests (unless a drain began meanwhile)."""
        self._engine = engine
        if self.phase is Phase.STARTING:
            self._set(Phase.READY)

    def start_drain(self) -> int:
        """Stops admitting (idempotent; a dead replica stays dead). Returns the in-flight
        count."""
        if self.phase in (Phase.STARTING, Phase.READY):
            self._set(Phase.DRAINING)
        return self.in_flight

    def mark_dead(self) -> None:
        """The engine died: admit nothing more."""
        if self.phase is not Phase.DEAD:
            self._set(Phase.DEAD)

    async def wait_idle(self, timeout_seconds: float) -> bool:
        """Waits until no request is in flight; False when `timeout_seconds` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_seconds)
        except TimeoutError:
            return False
        return True

    def _set(self, phase: Phase) -> None:
        self.phase = phase
        self._on_phase(phase)

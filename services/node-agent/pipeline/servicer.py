"""inferplane.inference.v1.InferenceService for the replicas of this node.

Proto ⇄ pipeline only: validation and rendering live in `requests`, generation in `generate`,
message shapes in `chunks`. Errors are raised as `InferplaneError`s; the runtime's
`ErrorInterceptor` turns them into gRPC status and OpenAI trailers. The `*Events` SSE methods
belong to the router and stay UNIMPLEMENTED here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import structlog

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.node_agent.engine.api import (
    EngineError,
    LocalReplica,
    ReplicaDirectory,
    SamplingParams,
)
from inferplane.node_agent.pipeline import chunks
from inferplane.node_agent.pipeline.assets import ModelAssets, ModelAssetsCache
from inferplane.node_agent.pipeline.generate import Generation
from inferplane.node_agent.pipeline.outcome import (
    Clock,
    OutcomeSink,
    RequestOutcome,
    SystemClock,
    discard_outcome,
)
from inferplane.node_agent.pipeline.requests import ChatPlan, plan_chat, plan_completion
from inferplane.parsers import ToolCallVerdict, ToolValidator
from inferplane.runtime import (
    InferplaneError,
    InternalError,
    NotFoundError,
    UnavailableError,
)

log = structlog.get_logger("inferplane.node_agent.pipeline")

REPLICA_METADATA_KEY = "x-inferplane-replica"
"""Request metadata that pins a replica (the router sets it to the replica id it chose)."""
REQUEST_ID_METADATA_KEY = "x-request-id"

Context = Any  # grpc.aio.ServicerContext


def _new_id() -> str:
    return uuid.uuid4().hex


class _Tracker:
    """Collects one request's outcome and hands it to the sink after the response."""

    __slots__ = (
        "api",
        "code",
        "gen",
        "model",
        "replica",
        "started",
        "status",
        "stream",
        "verdicts",
    )

    def __init__(self, api: str, stream: bool, model: str, started: float) -> None:
        self.api = api
        self.stream = stream
        self.model = model
        self.started = started
        self.replica = ""
        self.status = "ok"
        self.code = ""
        self.gen: Generation | None = None
        self.verdicts: tuple[ToolCallVerdict, ...] = ()


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """Serves chat and text completions on this node's replicas, and their model list.

    Args:
        directory: finds READY replicas per model (the engine supervisor's view).
        assets: model assets (tokenizer, parser, eos ids, context length) per model source.
        clock: time source for `created` and latencies.
        on_outcome: receives a `RequestOutcome` per request, after the response (default:
            dropped). Must be cheap; it runs on the event loop.
        strict_tool_calls: a tool call that fails validation against the request's tools ends
            the request with an error instead of being returned as OpenAI would return it.
        owned_by: `owned_by` of ListModels entries.
        new_id: returns a fresh unique id (hex) for completion and engine request ids.
    """

    def __init__(
        self,
        directory: ReplicaDirectory,
        assets: ModelAssetsCache,
        *,
        clock: Clock | None = None,
        on_outcome: OutcomeSink = discard_outcome,
        strict_tool_calls: bool = False,
        owned_by: str = "inferplane",
        new_id: Callable[[], str] = _new_id,
    ) -> None:
        self._directory = directory
        self._assets = assets
        self._clock = clock or SystemClock()
        self._on_outcome = on_outcome
        self._strict = strict_tool_calls
        self._owned_by = owned_by
        self._new_id = new_id
        # The spec carries no creation time for a model; the agent's start is stable for its
        # lifetime (see the pipeline README: a contract addition would fix this).
        self._created = int(self._clock.time())

    # -- RPCs ----------------------------------------------------------------------------------

    async def CreateChatCompletion(
        self, request: pb.CreateChatCompletionRequest, context: Context
    ) -> pb.CreateChatCompletionResponse:
        """A chat completion, whole (usage always included)."""
        req = request.request
        track = _Tracker("chat", False, req.model, self._clock.monotonic())
        try:
            replica, assets = await self._replica(req.model, context, track)
            plan = plan_chat(req, assets)
            gen = self._chat_generation(replica, assets, plan, "chatcmpl-", track)
            async with replica.admit(), aclosing(gen.steps()) as steps:
                try:
                    async for _ in steps:
                        pass
                except EngineError as exc:
                    raise _engine_failed(exc) from exc
            result = gen.result()
            track.verdicts = self._validate(plan, result.tool_calls)
            return chunks.chat_completion(
                gen.request_id,
                int(self._clock.time()),
                replica.spec.served_model_name,
                replica.spec.revision,
                result,
                gen.finish_reason or "stop",
                _usage(gen),
            )
        except BaseException as exc:
            _failed(track, exc)
            raise
        finally:
            self._emit(track, context)

    async def StreamChatCompletion(
        self, request: pb.StreamChatCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamChatCompletionResponse]:
        """A chat completion as typed chunks; a failure after the first chunk ends the stream
        with an error status (never a silent truncation)."""
        req = request.request
        track = _Tracker("chat", True, req.model, self._clock.monotonic())
        try:
            replica, assets = await self._replica(req.model, context, track)
            plan = plan_chat(req, assets)
            gen = self._chat_generation(replica, assets, plan, "chatcmpl-", track)
            out = chunks.ChatChunks(
                gen.request_id,
                int(self._clock.time()),
                replica.spec.served_model_name,
                replica.spec.revision,
            )
            async with replica.admit(), aclosing(gen.steps()) as steps:
                first = True
                try:
                    async for step in steps:
                        if first:
                            first = False
                            yield out.role()
                        if step.finish_reason is not None and self._strict:
                            track.verdicts = self._validate(plan, gen.result().tool_calls)
                        if not step.empty:
                            yield out.step(step)
                except EngineError as exc:
                    raise _engine_failed(exc) from exc
            if not self._strict:
                track.verdicts = self._validate(plan, gen.result().tool_calls)
            if plan.include_usage:
                yield out.usage(_usage(gen))
        except BaseException as exc:
            _failed(track, exc)
            raise
        finally:
            self._emit(track, context)

    async def CreateCompletion(
        self, request: pb.CreateCompletionRequest, context: Context
    ) -> pb.CreateCompletionResponse:
        """A text completion, whole (no chat template, no parsing)."""
        req = request.request
        track = _Tracker("completion", False, req.model, self._clock.monotonic())
        try:
            replica, assets = await self._replica(req.model, context, track)
            plan = plan_completion(req, assets)
            gen = self._completion_generation(replica, assets, plan.prompt_ids, plan, track)
            async with replica.admit(), aclosing(gen.steps()) as steps:
                try:
                    async for _ in steps:
                        pass
                except EngineError as exc:
                    raise _engine_failed(exc) from exc
            return chunks.completion(
                gen.request_id,
                int(self._clock.time()),
                replica.spec.served_model_name,
                replica.spec.revision,
                plan.echo_text + gen.result().content,
                gen.finish_reason or "stop",
                _usage(gen),
            )
        except BaseException as exc:
            _failed(track, exc)
            raise
        finally:
            self._emit(track, context)

    async def StreamCompletion(
        self, request: pb.StreamCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        """A text completion as typed chunks."""
        req = request.request
        track = _Tracker("completion", True, req.model, self._clock.monotonic())
        try:
            replica, assets = await self._replica(req.model, context, track)
            plan = plan_completion(req, assets)
            gen = self._completion_generation(replica, assets, plan.prompt_ids, plan, track)
            out = chunks.CompletionChunks(
                gen.request_id,
                int(self._clock.time()),
                replica.spec.served_model_name,
                replica.spec.revision,
            )
            async with replica.admit(), aclosing(gen.steps()) as steps:
                first = True
                try:
                    async for step in steps:
                        text = step.content
                        if first:
                            first = False
                            text = plan.echo_text + text
                        if text or step.finish_reason is not None:
                            yield out.text(text, step.finish_reason)
                except EngineError as exc:
                    raise _engine_failed(exc) from exc
            if plan.include_usage:
                yield out.usage(_usage(gen))
        except BaseException as exc:
            _failed(track, exc)
            raise
        finally:
            self._emit(track, context)

    async def StreamChatCompletionEvents(
        self, request: pb.StreamChatCompletionEventsRequest, context: Context
    ) -> AsyncIterator[Any]:
        """SSE bytes are the router's job (it owns the edge-facing stream): UNIMPLEMENTED."""
        raise NotImplementedError
        yield  # pragma: no cover - makes this an async generator like the other streams

    async def StreamCompletionEvents(
        self, request: pb.StreamCompletionEventsRequest, context: Context
    ) -> AsyncIterator[Any]:
        """SSE bytes are the router's job: UNIMPLEMENTED."""
        raise NotImplementedError
        yield  # pragma: no cover - makes this an async generator like the other streams

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        """The node's served models, one entry per served_model_name."""
        response = pb.ListModelsResponse(object="list")
        seen: set[str] = set()
        for spec in self._directory.known_models():
            name = spec.served_model_name or spec.deployment
            if not name or name in seen:
                continue
            seen.add(name)
            model = response.data.add(
                id=name, object="model", created=self._created, owned_by=self._owned_by
            )
            if spec.max_model_len:
                model.max_model_len = spec.max_model_len
        return response

    # -- helpers -------------------------------------------------------------------------------

    async def _replica(
        self, model: str, context: Context, track: _Tracker
    ) -> tuple[LocalReplica, ModelAssets]:
        """The replica to run on (pinned by metadata, else the least loaded) and its assets.

        Raises:
            NotFoundError: no replica on this node serves `model` (code model_not_found).
            UnavailableError: it is served here but no replica is ready (or the pinned one).
        """
        ready = self._directory.ready_replicas(model)
        if not ready:
            known = any(
                model in (s.served_model_name, s.deployment) for s in self._directory.known_models()
            )
            if not model or not known:
                raise NotFoundError(
                    f"The model '{model}' does not exist or you do not have access to it.",
                    reason="MODEL_NOT_FOUND",
                    code="model_not_found",
                    param="model",
                )
            raise UnavailableError(
                f"no ready replica serves '{model}' on this node", code="no_ready_replica"
            )
        replica: LocalReplica | None = ready[0]
        pinned = _metadata(context, REPLICA_METADATA_KEY).removeprefix("replicas/")
        if pinned:
            replica = next((r for r in ready if r.replica_id == pinned), None)
        if replica is None:
            raise UnavailableError(
                f"replica '{pinned}' is not ready to serve '{model}'", code="no_ready_replica"
            )
        track.replica = replica.replica_id
        track.model = replica.spec.served_model_name or model
        return replica, await self._assets.get(replica.spec)

    def _chat_generation(
        self,
        replica: LocalReplica,
        assets: ModelAssets,
        plan: ChatPlan,
        prefix: str,
        track: _Tracker,
    ) -> Generation:
        gen = Generation(
            engine=replica.engine,
            request_id=prefix + self._new_id(),
            prompt_ids=plan.prompt.token_ids,
            params=with_stream_floor(plan.params, replica.spec.stream_interval),
            backend=assets.backend,
            stop_token_ids=assets.eos_token_ids,
            parser=assets.parser,
            thinking=plan.prompt.thinking,
            history_tool_calls=plan.history_tool_calls,
            tool_calls_allowed=plan.tool_calls_allowed,
            clock=self._clock,
            started=track.started,
        )
        track.gen = gen
        return gen

    def _completion_generation(
        self,
        replica: LocalReplica,
        assets: ModelAssets,
        prompt_ids: list[int],
        plan: Any,
        track: _Tracker,
    ) -> Generation:
        gen = Generation(
            engine=replica.engine,
            request_id="cmpl-" + self._new_id(),
            prompt_ids=prompt_ids,
            params=with_stream_floor(plan.params, replica.spec.stream_interval),
            backend=assets.backend,
            stop_token_ids=assets.eos_token_ids,
            parser=None,
            thinking=False,
            clock=self._clock,
            started=track.started,
        )
        track.gen = gen
        return gen

    def _validate(self, plan: ChatPlan, calls: Any) -> tuple[ToolCallVerdict, ...]:
        """Verdicts on the response's tool calls; in strict mode an invalid call is an error.

        Raises:
            InternalError: strict mode and a call is invalid (code invalid_tool_call): the model
                produced it, not the client.
        """
        if not calls:
            return ()
        verdicts = tuple(ToolValidator(plan.tools).validate(calls))
        bad = [v for v in verdicts if not v.valid]
        if bad and self._strict:
            detail = "; ".join(f"call {v.index} ({v.name}): {v.reason}: {v.message}" for v in bad)
            raise InternalError(
                f"the model produced an invalid tool call: {detail}",
                reason="INVALID_TOOL_CALL",
                code="invalid_tool_call",
            )
        return verdicts

    def _emit(self, track: _Tracker, context: Context) -> None:
        """Hands the outcome to the sink after this handler returns (never on the token path)."""
        if self._on_outcome is discard_outcome:
            return
        gen = track.gen
        outcome = RequestOutcome(
            request_id=gen.request_id if gen else "",
            model=track.model,
            replica_id=track.replica,
            api=track.api,
            stream=track.stream,
            status=track.status,
            error_code=track.code,
            finish_reason=(gen.finish_reason or "") if gen else "",
            prompt_tokens=gen.prompt_tokens if gen else 0,
            completion_tokens=gen.completion_tokens if gen else 0,
            cached_tokens=gen.cached_tokens if gen else 0,
            reasoning_tokens=gen.reasoning_tokens if gen else 0,
            ttft_seconds=gen.ttft_seconds if gen else None,
            itl_seconds=tuple(gen.itl_seconds) if gen else (),
            e2e_seconds=self._clock.monotonic() - track.started,
            tool_call_verdicts=track.verdicts,
            marker_leaked=gen.result().marker_leaked if gen else False,
            dropped_tool_calls=gen.dropped_tool_calls if gen else 0,
            request_header_id=_metadata(context, REQUEST_ID_METADATA_KEY),
        )
        asyncio.get_running_loop().call_soon(_deliver, self._on_outcome, outcome)


def with_stream_floor(params: SamplingParams, floor: int) -> SamplingParams:
    """`params` with the replica's stream interval as the floor of the request's (vLLM clamps
    a request's `stream_interval` to the engine's the same way)."""
    if floor > (params.stream_interval or 1):
        return dataclasses.replace(params, stream_interval=floor)
    return params


def _deliver(sink: OutcomeSink, outcome: RequestOutcome) -> None:
    try:
        sink(outcome)
    except Exception:
        log.exception("outcome_sink_failed", request_id=outcome.request_id)


def _failed(track: _Tracker, exc: BaseException) -> None:
    if isinstance(exc, InferplaneError):
        track.status, track.code = "error", exc.code
    elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
        track.status = "cancelled"
    else:
        track.status, track.code = "error", "internal_error"


def _engine_failed(exc: EngineError) -> UnavailableError:
    """An engine failure. Before any chunk the router may retry elsewhere (UNAVAILABLE is its
    retry signal); after one it ends the stream with this status instead of truncating it."""
    return UnavailableError(
        f"the engine failed: {exc}", reason="ENGINE_FAILED", code="engine_failed"
    )


def _usage(gen: Generation) -> pb.Usage:
    return chunks.usage(
        gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.reasoning_tokens
    )


def _metadata(context: Context, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""

"""inferplane.inference.v1.InferenceService: render → generate → parse → chunks → SSE, and
embeddings.

Served by each replica process over its one replica (issue 16 B) and, until the supervisor
moves, by the node-agent over its replicas. Proto ⇄ pipeline only: validation and rendering
live in `requests`, generation in `generate`, message shapes in `chunks`, SSE framing in `sse`,
embeddings' rules and response in `embeddings`. A replica serves one task (`ReplicaSpec.task`):
chat and text completions (`generate`) or embeddings (`embed`); a request for the other task
is INVALID_ARGUMENT naming `model`.

Every RPC runs through one template (`_serve`): pick the replica, admit, produce messages, and
end the response with trailing metadata summarising it (`inferplane.wire.ResponseSummary`:
usage, finish reason, TTFT, replica, error code), which the endpoint picker reads from Envoy
instead of the body. Errors are `InferplaneError`s; the template sets the summary trailers and
re-raises, and the runtime's `ErrorInterceptor` aborts with the error's status and OpenAI
trailers, keeping the summary (anything unexpected becomes a generic INTERNAL the same way).

Messages are produced lazily: grpc.aio pulls the next one only after the previous one is
written, so while the writer is busy the engine's increments wait, and the next message carries
all of them (AsyncLLM's output collector merges DELTA outputs the consumer has not taken; see
`coalesce` for the transports that need help). `StreamMetrics` counts messages per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from functools import partial
from typing import Any, TypeVar

import structlog
from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry, Histogram

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.parsers import PlainSession, ToolCallVerdict, ToolValidator
from inferplane.replica.engines.base import (
    Admitted,
    EngineError,
    LocalReplica,
    ReplicaDirectory,
    SamplingParams,
    SpeechEngine,
    SpeechUsage,
)
from inferplane.replica.pipeline import chunks
from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache
from inferplane.replica.pipeline.audio import AudioError, decode_audio
from inferplane.replica.pipeline.embeddings import (
    embedding_response,
    needs_thread,
    plan_embedding,
)
from inferplane.replica.pipeline.generate import Generation, OutputSession, Step
from inferplane.replica.pipeline.outcome import OutcomeSink, RequestOutcome, discard_outcome
from inferplane.replica.pipeline.requests import plan_chat, plan_completion
from inferplane.replica.pipeline.speech import (
    TRANSCRIBE as TRANSCRIBE_ENDPOINT,
)
from inferplane.replica.pipeline.speech import (
    TRANSLATE as TRANSLATE_ENDPOINT,
)
from inferplane.replica.pipeline.speech import (
    SpeechRequest,
    duration_usage,
    render,
    speech_request,
)
from inferplane.replica.pipeline.sse import sse_bodies
from inferplane.replica_contract import Task, replica_task
from inferplane.runtime import (
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from inferplane.runtime.clock import Clock, SystemClock
from inferplane.wire import (
    PICKER_KEY,
    REPLICA_KEY,
    ResponseSummary,
    chunk_to_json,
    completion_chunk_to_json,
)

log = structlog.get_logger("inferplane.replica.pipeline")

REPLICA_METADATA_KEY = "x-inferplane-replica"
"""Request metadata that pins a replica (the router sets it to the replica id it chose)."""
REQUEST_ID_METADATA_KEY = "x-request-id"
KEY_ID_METADATA_KEY = "x-inferplane-key-id"  # set by auth's Check at the edge

Context = Any  # grpc.aio.ServicerContext
M = TypeVar("M")
Body = Callable[[LocalReplica, ModelAssets], AsyncIterator[Any]]
#: Audio forms larger than this are parsed in a thread (python-multipart is pure Python).
_INLINE_FORM_BYTES = 1 << 20


def json_bytes(payload: Any) -> bytes:
    """Compact UTF-8 JSON of an event (the speech stream's `transcript.text.*` events)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


ReportToPicker = Callable[[str, str, ResponseSummary], None]
"""`(picker address, request id, summary)`: hands a finished request's summary to the endpoint
picker that picked it (`inferplane.routing_client.OutcomeReporter.report`). Must not block."""


def _new_id() -> str:
    return uuid.uuid4().hex


class StreamMetrics:
    """Messages written per streamed request (`inferplane_replica_stream_messages`, a
    histogram by api and framing: its `_sum / _count` is the benchmark's messages per request).
    A stream that keeps up gets one message per engine step; fewer, fuller ones mean the
    writer was busy and deltas were coalesced."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.messages = Histogram(
            "inferplane_replica_stream_messages",
            "gRPC messages written per streamed request (role and usage chunks included).",
            ["api", "framing"],
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
        )


@dataclasses.dataclass(slots=True)
class _Embedded:
    """One embeddings or speech request's facts (it has no `Generation`): its engine request
    id, its tokens (an embedding's inputs; a transcription's decoder prompt and generated
    text), and the time from arrival to the engine's first result ("TTFT")."""

    request_id: str
    prompt_tokens: int
    seconds: float | None = None
    completion_tokens: int = 0


class _Tracker:
    """Collects one request's outcome: the summary trailers and the telemetry record."""

    __slots__ = (
        "admitted",
        "api",
        "code",
        "embedded",
        "framing",
        "gen",
        "messages",
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
        self.framing = "typed" if stream else "unary"
        self.model = model
        self.started = started
        self.replica = ""
        self.status = "ok"
        self.code = ""
        self.messages = 0
        self.gen: Generation | None = None
        self.embedded: _Embedded | None = None
        self.verdicts: tuple[ToolCallVerdict, ...] = ()
        self.admitted: Admitted | None = None  # its GPU-seconds once it left the replica

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, InferplaneError):
            self.status, self.code = "error", exc.code
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.status = "cancelled"
        else:
            self.status, self.code = "error", "internal_error"

    def summary(self) -> ResponseSummary:
        """The trailers' view: finish_reason "error" once output had started and the request
        failed (an SSE error event or an error status mid-stream), "abort" for a client gone.
        An embeddings request that succeeded says "stop", its inputs' tokens and, as TTFT,
        the time to its result."""
        gpu = self.admitted.gpu_seconds if self.admitted is not None else 0.0
        if self.embedded is not None:
            embedded = self.embedded
            finish = {"ok": "stop", "cancelled": "abort"}.get(self.status, "")
            return ResponseSummary(
                replica_id=self.replica,
                prompt_tokens=embedded.prompt_tokens,
                completion_tokens=embedded.completion_tokens,
                finish_reason=finish,
                ttft_seconds=embedded.seconds or 0.0,
                gpu_seconds=gpu,
                error_code=self.code,
            )
        gen = self.gen
        if self.status == "cancelled":
            finish = "abort"
        elif self.status == "error":
            finish = "error" if gen is not None and gen.started_output else ""
        else:
            finish = (gen.finish_reason or "") if gen is not None else ""
        if gen is None:
            return ResponseSummary(
                replica_id=self.replica, finish_reason=finish, gpu_seconds=gpu, error_code=self.code
            )
        return ResponseSummary(
            replica_id=self.replica,
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=gen.completion_tokens,
            cached_tokens=gen.cached_tokens,
            reasoning_tokens=gen.session.reasoning_tokens,
            finish_reason=finish,
            ttft_seconds=gen.ttft_seconds or 0.0,
            gpu_seconds=gpu,
            error_code=self.code,
        )


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """Serves chat and text completions (typed or SSE) and embeddings on replicas, and their
    model list.

    Args:
        directory: finds READY replicas per model (a replica process: its one replica).
        assets: model assets (tokenizer, parser, eos ids, context length) per model source.
        clock: time source for `created` and latencies.
        on_outcome: receives a `RequestOutcome` per request, after the response (default:
            dropped). Must be cheap; it runs on the event loop.
        strict_tool_calls: a tool call that fails validation against the request's tools ends
            the request with an error instead of being returned as OpenAI would return it.
        owned_by: `owned_by` of ListModels entries.
        new_id: returns a fresh unique id (hex) for completion, embedding and engine request
            ids.
        metrics: counts messages per streamed request (None: not counted).
        report_to_picker: receives `(picker address, request id, summary)` for every request
            that produced output and names its picker (`x-inferplane-picker`) and id
            (`x-request-id`), however it ended; the summary equals the trailers'. The picker
            reads the trailers too, but loses them when the client closes right after
            `data: [DONE]`. Called on the event loop after the handler returned; None: no
            reports.
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
        metrics: StreamMetrics | None = None,
        report_to_picker: ReportToPicker | None = None,
    ) -> None:
        self._directory = directory
        self._assets = assets
        self._clock = clock or SystemClock()
        self._on_outcome = on_outcome
        self._strict = strict_tool_calls
        self._owned_by = owned_by
        self._new_id = new_id
        self._metrics = metrics
        self._report_to_picker = report_to_picker
        # The spec carries no creation time for a model; the process start is stable for its
        # lifetime (see the pipeline README: a contract addition would fix this).
        self._created = int(self._clock.time())

    # -- RPCs ----------------------------------------------------------------------------------

    async def CreateChatCompletion(
        self, request: pb.CreateChatCompletionRequest, context: Context
    ) -> pb.CreateChatCompletionResponse:
        """A chat completion, whole (usage always included)."""
        track = self._track("chat", False, request.request.model)
        body = partial(self._chat_whole, request.request, track)
        return await _only(self._serve(track, context, body))

    async def StreamChatCompletion(
        self, request: pb.StreamChatCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamChatCompletionResponse]:
        """A chat completion as typed chunks; a failure after the first chunk ends the stream
        with an error status (never a silent truncation)."""
        track = self._track("chat", True, request.request.model)
        body = partial(self._chat_chunks, request.request, track)
        async for chunk in self._serve(track, context, body):
            yield chunk

    async def StreamChatCompletionEvents(
        self, request: pb.StreamChatCompletionEventsRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """A chat completion as OpenAI's SSE bytes (`pipeline/sse.py`): a failure after the
        first byte ends the stream with an error event and status OK."""
        track = self._track("chat", True, request.request.model)
        typed = partial(self._chat_chunks, request.request, track)
        body = partial(self._events, typed, chunk_to_json, track)
        async for message in self._serve(track, context, body):
            yield message

    async def CreateCompletion(
        self, request: pb.CreateCompletionRequest, context: Context
    ) -> pb.CreateCompletionResponse:
        """A text completion, whole (no chat template, no parsing)."""
        track = self._track("completion", False, request.request.model)
        body = partial(self._completion_whole, request.request, track)
        return await _only(self._serve(track, context, body))

    async def StreamCompletion(
        self, request: pb.StreamCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        """A text completion as typed chunks."""
        track = self._track("completion", True, request.request.model)
        body = partial(self._completion_chunks, request.request, track)
        async for chunk in self._serve(track, context, body):
            yield chunk

    async def StreamCompletionEvents(
        self, request: pb.StreamCompletionEventsRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """A text completion as OpenAI's SSE bytes (see StreamChatCompletionEvents)."""
        track = self._track("completion", True, request.request.model)
        typed = partial(self._completion_chunks, request.request, track)
        body = partial(self._events, typed, completion_chunk_to_json, track)
        async for message in self._serve(track, context, body):
            yield message

    async def CreateEmbedding(
        self, request: pb.CreateEmbeddingRequest, context: Context
    ) -> pb.CreateEmbeddingResponse:
        """Embeddings of the request's inputs (`pipeline/embeddings.py` has the rules), on a
        replica whose task is `embed`: the same template as the generation RPCs (admission,
        summary trailers with the inputs' tokens, finish_reason "stop" and the time to the
        result as TTFT, the picker report, one record)."""
        track = self._track("embedding", False, request.request.model)
        body = partial(self._embedding, request.request, track)
        return await _only(self._serve(track, context, body, task=Task.EMBED))

    async def CreateTranscription(
        self, request: pb.CreateTranscriptionRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """`POST /v1/audio/transcriptions` (the client's multipart form as `request.body`) on
        a replica whose task is `transcribe`: `pipeline/speech.py` has the form's rules and
        the answer's formats, `pipeline/audio.py` the decoding."""
        async for body in self._speech(request.body, TRANSCRIBE_ENDPOINT, context):
            yield body

    async def CreateTranslation(
        self, request: pb.CreateTranslationRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """`POST /v1/audio/translations`: as CreateTranscription, into English."""
        async for body in self._speech(request.body, TRANSLATE_ENDPOINT, context):
            yield body

    async def _speech(
        self, http: httpbody_pb2.HttpBody, endpoint: str, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """The speech template: the form read (in a thread when the upload is large: parsing
        25 MB costs tens of ms), then the common request template with `_speech_body`."""
        if len(http.data) > _INLINE_FORM_BYTES:
            speech = await asyncio.to_thread(speech_request, http.content_type, http.data, endpoint)
        else:
            speech = speech_request(http.content_type, http.data, endpoint)
        api = "transcription" if endpoint == TRANSCRIBE_ENDPOINT else "translation"
        track = self._track(api, speech.stream, speech.model)
        body = partial(self._speech_body, speech, track)
        async for message in self._serve(track, context, body, task=Task.TRANSCRIBE):
            yield message

    async def _speech_body(
        self, speech: SpeechRequest, track: _Tracker, replica: LocalReplica, assets: ModelAssets
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        engine = replica.engine
        if not isinstance(engine, SpeechEngine):
            raise UnavailableError(
                "this replica's engine transport cannot serve speech-to-text",
                code="bad_replica_config",
            )
        try:
            audio = await asyncio.to_thread(decode_audio, speech.file.data)
        except AudioError as exc:
            raise InvalidArgumentError(str(exc), param="file", code="invalid_file_format") from exc
        wav = audio.wav_bytes()
        spent = track.embedded = _Embedded("audio-" + self._new_id(), 0)
        usage = SpeechUsage()
        try:
            if not speech.stream:
                try:
                    result = await engine.transcribe(wav, speech.params, usage)
                except EngineError as exc:
                    raise _engine_error(exc) from exc
                spent.seconds = self._clock.monotonic() - track.started
                content_type, data = render(speech, result, audio.seconds)
                yield httpbody_pb2.HttpBody(content_type=content_type, data=data)
                return
            track.framing = "sse"
            events = self._speech_events(engine, wav, speech, audio.seconds, usage, track)
            async with aclosing(sse_bodies(events, json_bytes, on_error=track.fail)) as bodies:
                async for message in bodies:
                    yield message
        finally:
            spent.prompt_tokens = usage.prompt_tokens
            spent.completion_tokens = usage.completion_tokens

    async def _speech_events(
        self,
        engine: SpeechEngine,
        wav: bytes,
        speech: SpeechRequest,
        seconds: float,
        usage: SpeechUsage,
        track: _Tracker,
    ) -> AsyncIterator[dict[str, Any]]:
        """OpenAI's transcript events: one `transcript.text.delta` per piece of text, then
        `transcript.text.done`; an engine failure is an `InferplaneError` (an error event once
        text was sent, `sse_bodies`)."""
        pieces: list[str] = []
        try:
            async with aclosing(engine.transcribe_stream(wav, speech.params, usage)) as stream:
                async for text in stream:
                    if not pieces and track.embedded is not None:
                        track.embedded.seconds = self._clock.monotonic() - track.started
                    pieces.append(text)
                    yield {"type": "transcript.text.delta", "delta": text}
        except EngineError as exc:
            raise _engine_error(exc) from exc
        yield {
            "type": "transcript.text.done",
            "text": "".join(pieces).strip(),
            "usage": duration_usage(seconds),
        }

    # -- the request template --------------------------------------------------------------

    def _track(self, api: str, stream: bool, model: str) -> _Tracker:
        return _Tracker(api, stream, model, self._clock.monotonic())

    async def _serve(
        self, track: _Tracker, context: Context, body: Body, *, task: str = Task.GENERATE
    ) -> AsyncIterator[Any]:
        """The one template of every RPC but ListModels: replica → its task is `task` →
        admit → `body`'s messages → summary trailers → outcome record. Failures end the RPC
        with their status, the OpenAI trailers and the summary; a client gone leaves a summary
        with "abort". A request that produced output is also reported to its picker
        (`_report`), with the same summary.
        """
        summary: ResponseSummary | None = None
        try:
            replica, assets = await self._replica(track.model, context, track)
            _check_task(replica, task, track.model)
            async with replica.admit() as admitted, aclosing(body(replica, assets)) as messages:
                track.admitted = admitted
                async for message in messages:
                    if not track.messages:
                        # The response headers name the replica (the picker learns which
                        # endpoint of its list answered); sent with the first message, not
                        # before: Envoy retries a request elsewhere only until it has seen
                        # response headers, so an error before any output must stay a
                        # trailers-only response.
                        await context.send_initial_metadata(((REPLICA_KEY, replica.replica_id),))
                    track.messages += 1
                    yield message
        except BaseException as exc:
            # Errors, client cancels and bugs alike: the runtime's ErrorInterceptor turns an
            # error into its status and OpenAI trailers and keeps these summary trailers.
            track.fail(exc)
            summary = track.summary()
            _set_trailers(context, summary)
            raise
        else:
            summary = track.summary()
            _set_trailers(context, summary)
        finally:
            if self._metrics is not None and track.stream:
                self._metrics.messages.labels(track.api, track.framing).observe(track.messages)
            if summary is not None and track.messages:
                self._report(context, summary, track.model)
            self._emit(track, context)

    def _report(self, context: Context, summary: ResponseSummary, model: str) -> None:
        """Hands the summary of a request that produced output to the picker named in its
        `x-inferplane-picker`, after this handler returns (the status is not delayed). Only
        the replica that started a response reports it (Envoy never retries after response
        headers); a request that failed before any output is left to the picker's reading of
        the trailers-only response, which Envoy may retry elsewhere. Without the picker header
        or `x-request-id` (direct callers: tests, warm-up probes) nothing is reported."""
        report = self._report_to_picker
        if report is None:
            return
        try:
            picker = _metadata(context, PICKER_KEY)
            request_id = _metadata(context, REQUEST_ID_METADATA_KEY)
            key_id = _metadata(context, KEY_ID_METADATA_KEY)
        except Exception:  # never fail a request over its report
            log.debug("picker_report_metadata_unreadable", exc_info=True)
            return
        if picker and request_id:
            # The key and model let a restarted router account a request it never saw.
            summary = dataclasses.replace(summary, key_id=key_id, model=model)
            asyncio.get_running_loop().call_soon(_report_to, report, picker, request_id, summary)

    # -- message producers (the bodies the template runs) -----------------------------------

    async def _chat_chunks(
        self,
        req: pb.ChatCompletionRequest,
        track: _Tracker,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.StreamChatCompletionResponse]:
        plan = plan_chat(
            req, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
        )
        gen = self._generation(replica, assets, plan, "chatcmpl-", track, chat=True)
        out = chunks.ChatChunks(
            gen.request_id,
            int(self._clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
        )
        first = True
        async with aclosing(_steps(gen)) as steps:
            async for step in steps:
                if first:
                    first = False
                    yield out.role()
                if step.finish_reason is not None and self._strict:
                    track.verdicts = self._validate(plan.tools, gen.session.result().tool_calls)
                if not step.empty:
                    yield out.step(step)
        if not self._strict:
            track.verdicts = self._validate(plan.tools, gen.session.result().tool_calls)
        if plan.include_usage:
            yield out.usage(_usage(gen))

    async def _chat_whole(
        self,
        req: pb.ChatCompletionRequest,
        track: _Tracker,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateChatCompletionResponse]:
        plan = plan_chat(
            req, assets, constrain_tool_choice_auto=replica.spec.constrain_tool_choice_auto
        )
        gen = self._generation(replica, assets, plan, "chatcmpl-", track, chat=True)
        await _drain(gen)
        result = gen.session.result()
        track.verdicts = self._validate(plan.tools, result.tool_calls)
        yield chunks.chat_completion(
            gen.request_id,
            int(self._clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
            result,
            gen.finish_reason or "stop",
            _usage(gen),
        )

    async def _completion_chunks(
        self, req: pb.CompletionRequest, track: _Tracker, replica: LocalReplica, assets: ModelAssets
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        plan = plan_completion(req, assets)
        gen = self._generation(replica, assets, plan, "cmpl-", track, chat=False)
        out = chunks.CompletionChunks(
            gen.request_id,
            int(self._clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
        )
        first = True
        async with aclosing(_steps(gen)) as steps:
            async for step in steps:
                text = step.content
                if first:
                    first = False
                    text = plan.echo_text + text
                if text or step.finish_reason is not None:
                    yield out.text(text, step.finish_reason)
        if plan.include_usage:
            yield out.usage(_usage(gen))

    async def _completion_whole(
        self, req: pb.CompletionRequest, track: _Tracker, replica: LocalReplica, assets: ModelAssets
    ) -> AsyncIterator[pb.CreateCompletionResponse]:
        plan = plan_completion(req, assets)
        gen = self._generation(replica, assets, plan, "cmpl-", track, chat=False)
        await _drain(gen)
        yield chunks.completion(
            gen.request_id,
            int(self._clock.time()),
            replica.spec.served_model_name,
            replica.spec.revision,
            plan.echo_text + gen.session.result().content,
            gen.finish_reason or "stop",
            _usage(gen),
        )

    async def _embedding(
        self,
        req: pb.EmbeddingRequest,
        track: _Tracker,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[pb.CreateEmbeddingResponse]:
        if needs_thread(req):  # a large batch: tokenizing it would stall the event loop
            plan = await asyncio.to_thread(plan_embedding, req, assets)
        else:
            plan = plan_embedding(req, assets)
        embedded = track.embedded = _Embedded("embd-" + self._new_id(), plan.prompt_tokens)
        try:
            vectors = await replica.engine.embed(
                embedded.request_id, plan.inputs, dimensions=plan.dimensions
            )
        except EngineError as exc:
            raise _engine_error(exc) from exc
        embedded.seconds = self._clock.monotonic() - track.started
        yield embedding_response(vectors, plan, replica.spec.served_model_name or track.model)

    def _events(
        self,
        typed: Body,
        to_json: Callable[[Any], bytes],
        track: _Tracker,
        replica: LocalReplica,
        assets: ModelAssets,
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """`typed`'s chunks as SSE bodies; a failure after the first byte is recorded on
        `track` (the summary and the record say error) and becomes the stream's error event."""
        track.framing = "sse"
        return sse_bodies(typed(replica, assets), to_json, on_error=track.fail)

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

    def _generation(
        self,
        replica: LocalReplica,
        assets: ModelAssets,
        plan: Any,
        prefix: str,
        track: _Tracker,
        *,
        chat: bool,
    ) -> Generation:
        session: OutputSession = PlainSession()
        if chat and assets.parser is not None:
            session = assets.parser.start(
                plan.prompt.thinking,
                history_tool_calls=plan.history_tool_calls,
                tool_calls=plan.tool_calls_allowed,
                tools=plan.tools,
                max_tool_calls=plan.max_tool_calls,
                constrained=plan.calls_constrained,
            )
        gen = Generation(
            engine=replica.engine,
            request_id=prefix + self._new_id(),
            prompt_ids=plan.prompt.token_ids if chat else plan.prompt_ids,
            params=with_stream_floor(plan.params, replica.spec.stream_interval),
            backend=assets.backend,
            stop_token_ids=assets.eos_token_ids,
            session=session,
            clock=self._clock,
            started=track.started,
        )
        track.gen = gen
        return gen

    def _validate(self, tools: Sequence[Any], calls: Any) -> tuple[ToolCallVerdict, ...]:
        """Verdicts on the response's tool calls; in strict mode an invalid call is an error.

        Raises:
            InternalError: strict mode and a call is invalid (code invalid_tool_call): the model
                produced it, not the client.
        """
        if not calls:
            return ()
        verdicts = tuple(ToolValidator(tools).validate(calls))
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
        if track.embedded is not None:
            embedded = track.embedded
            outcome = RequestOutcome(
                request_id=embedded.request_id,
                model=track.model,
                replica_id=track.replica,
                api=track.api,
                stream=False,
                status=track.status,
                error_code=track.code,
                finish_reason="stop" if track.status == "ok" else "",
                prompt_tokens=embedded.prompt_tokens,
                ttft_seconds=embedded.seconds,
                e2e_seconds=self._clock.monotonic() - track.started,
                request_header_id=_metadata(context, REQUEST_ID_METADATA_KEY),
            )
            asyncio.get_running_loop().call_soon(_deliver, self._on_outcome, outcome)
            return
        gen = track.gen
        session = gen.session if gen else None
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
            reasoning_tokens=session.reasoning_tokens if session else 0,
            ttft_seconds=gen.ttft_seconds if gen else None,
            itl_seconds=tuple(gen.itl_seconds) if gen else (),
            e2e_seconds=self._clock.monotonic() - track.started,
            tool_call_verdicts=track.verdicts,
            marker_leaked=session.result().marker_leaked if session else False,
            dropped_tool_calls=session.dropped_tool_calls if session else 0,
            request_header_id=_metadata(context, REQUEST_ID_METADATA_KEY),
        )
        asyncio.get_running_loop().call_soon(_deliver, self._on_outcome, outcome)


def with_stream_floor(params: SamplingParams, floor: int) -> SamplingParams:
    """`params` with the replica's stream interval as the floor of the request's (vLLM clamps
    a request's `stream_interval` to the engine's the same way)."""
    if floor > (params.stream_interval or 1):
        return dataclasses.replace(params, stream_interval=floor)
    return params


async def _steps(gen: Generation) -> AsyncIterator[Step]:
    """`gen`'s steps, an engine failure turned into its status (`_engine_failed`)."""
    async with aclosing(gen.steps()) as steps:
        try:
            async for step in steps:
                yield step
        except EngineError as exc:
            raise _engine_error(exc) from exc


async def _drain(gen: Generation) -> None:
    async with aclosing(_steps(gen)) as steps:
        async for _ in steps:
            pass


async def _only(messages: AsyncIterator[M]) -> M:
    """The single message of a unary body (run through the streaming template)."""
    result: M | None = None
    async for message in messages:
        result = message
    assert result is not None  # a body either yields its response or raises
    return result


def _set_trailers(context: Context, summary: ResponseSummary) -> None:
    try:
        context.set_trailing_metadata(summary.to_metadata())
    except Exception:  # the RPC is already gone (a cancelled call): nobody reads them
        log.debug("trailers_not_set", exc_info=True)


def _deliver(sink: OutcomeSink, outcome: RequestOutcome) -> None:
    try:
        sink(outcome)
    except Exception:
        log.exception("outcome_sink_failed", request_id=outcome.request_id)


def _report_to(
    report: ReportToPicker, picker: str, request_id: str, summary: ResponseSummary
) -> None:
    try:
        report(picker, request_id, summary)
    except Exception:
        log.exception("picker_report_failed", picker=picker, request_id=request_id)


def _check_task(replica: LocalReplica, task: str, model: str) -> None:
    """Refuses a request for the other task than the replica's (OpenAI answers a model used
    on the wrong endpoint with a 400 naming `model`).

    Raises:
        InvalidArgumentError: param `model`, code `unsupported_model`.
    """
    try:
        served = replica_task(replica.spec)
    except ValueError as exc:
        raise UnavailableError(str(exc), code="bad_replica_config") from exc
    if served == task:
        return
    if task == Task.EMBED:
        message = (
            f"'{model}' is not an embedding model and thus not supported in the "
            "v1/embeddings endpoint."
        )
    elif task == Task.TRANSCRIBE:
        message = (
            f"'{model}' is not a speech-to-text model and thus not supported in the "
            "v1/audio/transcriptions and v1/audio/translations endpoints."
        )
    elif served == Task.TRANSCRIBE:
        message = (
            f"'{model}' is a speech-to-text model and thus not supported in this endpoint; "
            "use v1/audio/transcriptions or v1/audio/translations."
        )
    else:
        message = (
            f"'{model}' is an embedding model and thus not supported in the chat and text "
            "completion endpoints; use v1/embeddings."
        )
    raise InvalidArgumentError(message, param="model", code="unsupported_model")


def _engine_error(exc: EngineError) -> InferplaneError:
    """An engine error as the client sees it: the engine refusing the request is the
    client's fault (a 400, never retried, never a failure); anything else `_engine_failed`."""
    if exc.rejected:
        return InvalidArgumentError(
            f"the request was rejected by the engine: {exc}",
            code="invalid_request" if exc.param is None else "invalid_value",
            param=exc.param,
        )
    return _engine_failed(exc)


def _engine_failed(exc: EngineError) -> UnavailableError:
    """An engine failure. Before any chunk the router may retry elsewhere (UNAVAILABLE is its
    retry signal); after one it ends the stream with this status instead of truncating it."""
    return UnavailableError(
        f"the engine failed: {exc}", reason="ENGINE_FAILED", code="engine_failed"
    )


def _usage(gen: Generation) -> pb.Usage:
    return chunks.usage(
        gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.session.reasoning_tokens
    )


def _metadata(context: Context, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""

"""inferplane.inference.v1.InferenceService over the replica process's one replica: the RPC
shims and the one request template (`_serve`).

Proto ⇄ pipeline only: the bodies are in `bodies.py` (chat, completions, embeddings) and
`speech.py`; validation and rendering live in `pipeline/requests.py`, generation in
`pipeline/generate.py`, message shapes in `pipeline/chunks.py`, SSE framing in
`pipeline/sse.py`. A replica serves one task (`ReplicaSpec.task`): chat and text completions
(`generate`), embeddings (`embed`) or speech-to-text (`transcribe`); a request for another task
is INVALID_ARGUMENT naming `model`. The endpoint picker already chose this replica for the
request's model (aliases included), so every model name a request carries is served by it.

Every RPC but ListModels runs through `_serve`: the replica → its task → admit → the body's
messages → the summary trailers (`inferplane.wire.ResponseSummary`: usage, finish reason,
TTFT, replica, error code, which the picker reads from Envoy instead of the body) → the report
to the picker → the outcome record. The request's end is classified once
(`RequestFacts.ending`, `facts.py`) and the trailers, the report and the record all say that.
Errors are `InferplaneError`s; the template sets the summary trailers and re-raises, and the
runtime's `ErrorInterceptor` aborts with the error's status and OpenAI trailers, keeping the
summary (anything unexpected becomes a generic INTERNAL the same way).

Messages are produced lazily: grpc.aio pulls the next one only after the previous one is
written, so while the writer is busy the engine's increments wait, and the next message carries
all of them (AsyncLLM's output collector merges DELTA outputs the consumer has not taken; see
`pipeline/coalesce.py` for the transports that need help). `StreamMetrics` counts messages per
request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import Any, TypeVar

import structlog
from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry, Histogram

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.replica.engines.base import EngineClient, LocalReplica
from inferplane.replica.engines.lora import Adapter, AdapterRegistry
from inferplane.replica.engines.migration import Migrator
from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache
from inferplane.replica.pipeline.speech import TRANSCRIBE as TRANSCRIBE_ENDPOINT
from inferplane.replica.pipeline.speech import TRANSLATE as TRANSLATE_ENDPOINT
from inferplane.replica.pipeline.speech import speech_request
from inferplane.replica.server.bodies import Bodies, Body
from inferplane.replica.server.facts import RequestFacts
from inferplane.replica.server.faults import fault_switch
from inferplane.replica.server.messages import count_body, message_body
from inferplane.replica.server.outcome import Ending, OutcomeSink, RequestOutcome, discard_outcome
from inferplane.replica.server.response_store import ResponseStore
from inferplane.replica.server.responses import ResponsesBody
from inferplane.replica.server.speech import speech_body
from inferplane.replica.tracing import REPLICA_TRACING_OFF, ReplicaTracing
from inferplane.replica_contract import Task, replica_task
from inferplane.runtime import InvalidArgumentError, UnavailableError
from inferplane.runtime.time.clock import Clock, SystemClock
from inferplane.wire import ResponseSummary, apis, chunk_to_json, completion_chunk_to_json
from inferplane.wire.headers import (
    ADAPTER,
    ADAPTER_SOURCE,
    KEY_ID,
    PICKER,
    REQUEST_ID,
    SERVED_BY,
    SIBLINGS,
    TENANT,
)
from inferplane.wire.siblings import decode_siblings

log = structlog.get_logger("inferplane.replica.server")

Context = Any  # grpc.aio.ServicerContext
M = TypeVar("M")
#: Audio forms larger than this are parsed in a thread (python-multipart is pure Python).
_INLINE_FORM_BYTES = 1 << 20

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


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """Serves chat and text completions (typed or SSE), embeddings and speech-to-text on the
    process's replica, and its model.

    Args:
        replica: the replica this process serves (`ReplicaState`; admission says whether it
            may run a request now).
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
            (`x-request-id`), however it ended; the summary equals the trailers' plus the key
            and the model. The picker reads the trailers too, but loses them when the client
            closes right after `data: [DONE]`. Called on the event loop after the handler
            returned; None: no reports.
        response_store: the stored responses of the Responses API (auth's
            `ResponseStoreService`, `server/response_store.py`); None: responses are answered
            with `"store": false` and `previous_response_id` is a 503.
        adapters: the replica's LoRA adapters (`engines/lora.py`): a request whose headers
            name one (`x-inferplane-adapter`, `x-inferplane-adapter-source`, set by the
            picker) runs with it, or is refused before admission (FAILED_PRECONDITION naming
            `model`). None: a registry of the replica's spec (no engine list of adapters).

    `tracing`: each request's spans (`inferplane.replica.tracing`; off unless the process sets
    it).
    """

    tracing: ReplicaTracing = REPLICA_TRACING_OFF

    def __init__(
        self,
        replica: LocalReplica,
        assets: ModelAssetsCache,
        *,
        clock: Clock | None = None,
        on_outcome: OutcomeSink = discard_outcome,
        strict_tool_calls: bool = False,
        owned_by: str = "inferplane",
        new_id: Callable[[], str] = _new_id,
        metrics: StreamMetrics | None = None,
        report_to_picker: ReportToPicker | None = None,
        response_store: ResponseStore | None = None,
        adapters: AdapterRegistry | None = None,
        migrator: Migrator | None = None,
    ) -> None:
        self._migrator = migrator
        self._replica = replica
        self._adapters = adapters if adapters is not None else AdapterRegistry(replica.spec)
        self._assets = assets
        self._clock = clock or SystemClock()
        self._on_outcome = on_outcome
        self._owned_by = owned_by
        self._bodies = Bodies(self._clock, new_id, strict_tool_calls)
        self._responses = ResponsesBody(self._bodies, response_store)
        self._metrics = metrics
        self._report_to_picker = report_to_picker
        self._faults = fault_switch(replica.spec)  # tests only: None unless armed
        # The spec carries no creation time for a model; the process start is stable for its
        # lifetime (see the pipeline README: a contract addition would fix this).
        self._created = int(self._clock.time())

    # -- RPCs ----------------------------------------------------------------------------------

    async def CreateChatCompletion(
        self, request: pb.CreateChatCompletionRequest, context: Context
    ) -> pb.CreateChatCompletionResponse:
        """A chat completion, whole (usage always included)."""
        facts = self._facts(apis.CHAT_COMPLETIONS, False, request.request.model)
        body = partial(self._bodies.chat_whole, request.request, facts)
        return await _only(self._serve(facts, context, body))

    async def StreamChatCompletion(
        self, request: pb.StreamChatCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamChatCompletionResponse]:
        """A chat completion as typed chunks; a failure after the first chunk ends the stream
        with an error status (never a silent truncation)."""
        facts = self._facts(apis.CHAT_COMPLETIONS, True, request.request.model)
        body = partial(self._bodies.chat_chunks, request.request, facts)
        async for chunk in self._serve(facts, context, body):
            yield chunk

    async def StreamChatCompletionEvents(
        self, request: pb.StreamChatCompletionEventsRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """A chat completion as OpenAI's SSE bytes (`pipeline/sse.py`): a failure after the
        first byte ends the stream with an error event and status OK."""
        facts = self._facts(apis.CHAT_COMPLETIONS, True, request.request.model)
        typed = partial(self._bodies.chat_chunks, request.request, facts)
        body = partial(self._bodies.events, typed, chunk_to_json, facts)
        async for message in self._serve(facts, context, body):
            yield message

    async def CreateCompletion(
        self, request: pb.CreateCompletionRequest, context: Context
    ) -> pb.CreateCompletionResponse:
        """A text completion, whole (no chat template, no parsing)."""
        facts = self._facts(apis.COMPLETIONS, False, request.request.model)
        body = partial(self._bodies.completion_whole, request.request, facts)
        return await _only(self._serve(facts, context, body))

    async def StreamCompletion(
        self, request: pb.StreamCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        """A text completion as typed chunks."""
        facts = self._facts(apis.COMPLETIONS, True, request.request.model)
        body = partial(self._bodies.completion_chunks, request.request, facts)
        async for chunk in self._serve(facts, context, body):
            yield chunk

    async def StreamCompletionEvents(
        self, request: pb.StreamCompletionEventsRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """A text completion as OpenAI's SSE bytes (see StreamChatCompletionEvents)."""
        facts = self._facts(apis.COMPLETIONS, True, request.request.model)
        typed = partial(self._bodies.completion_chunks, request.request, facts)
        body = partial(self._bodies.events, typed, completion_chunk_to_json, facts)
        async for message in self._serve(facts, context, body):
            yield message

    async def CreateMessage(
        self, request: apb.CreateMessageRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """Anthropic's `POST /v1/messages` (`server/messages.py`): the whole Message as JSON,
        or with `"stream": true` its events; a failure after the first byte ends the stream
        with an `error` event and status OK."""
        facts = self._facts(apis.MESSAGES, request.request.stream, request.request.model)
        body = partial(message_body, self._bodies, request.request, facts)
        async for message in self._serve(facts, context, body):
            yield message

    async def CreateResponse(
        self, request: rpb.CreateResponseRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """OpenAI's `POST /v1/responses` (`server/responses.py`): the Response object as JSON,
        or with `"stream": true` its events; a failure after the first byte ends the stream
        with `response.failed` and an `error` event, status OK. The tenant (the edge's
        `x-inferplane-tenant`) scopes the stored responses it loads and saves."""
        facts = self._facts(apis.RESPONSES, request.request.stream, request.request.model)
        body = partial(self._responses.run, request.request, _metadata(context, TENANT), facts)
        async for message in self._serve(facts, context, body):
            yield message

    async def CountMessageTokens(
        self, request: apb.CountMessageTokensRequest, context: Context
    ) -> apb.CountMessageTokensResponse:
        """Anthropic's `POST /v1/messages/count_tokens`: the rendered prompt's tokens."""
        facts = self._facts(apis.MESSAGES, False, request.request.model)
        body = partial(count_body, self._bodies, request.request, facts)
        return await _only(self._serve(facts, context, body))

    async def CreateEmbedding(
        self, request: pb.CreateEmbeddingRequest, context: Context
    ) -> pb.CreateEmbeddingResponse:
        """Embeddings of the request's inputs (`pipeline/embeddings.py` has the rules), on a
        replica whose task is `embed`: the same template as the generation RPCs (admission,
        summary trailers with the inputs' tokens, finish_reason "stop" and the time to the
        result as TTFT, the picker report, one record)."""
        facts = self._facts(apis.EMBEDDINGS, False, request.request.model)
        body = partial(self._bodies.embedding, request.request, facts)
        return await _only(self._serve(facts, context, body, task=Task.EMBED))

    async def CreateTranscription(
        self, request: pb.CreateTranscriptionRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """`POST /v1/audio/transcriptions` (the client's multipart form as `request.body`) on
        a replica whose task is `transcribe` (`speech.py`)."""
        async for body in self._speech(request.body, TRANSCRIBE_ENDPOINT, context):
            yield body

    async def CreateTranslation(
        self, request: pb.CreateTranslationRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """`POST /v1/audio/translations`: as CreateTranscription, into English."""
        async for body in self._speech(request.body, TRANSLATE_ENDPOINT, context):
            yield body

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        """The replica's model: one entry named its served_model_name (else its deployment)."""
        response = pb.ListModelsResponse(object="list")
        spec = self._replica.spec
        name = spec.served_model_name or spec.deployment
        if name:
            model = response.data.add(
                id=name, object="model", created=self._created, owned_by=self._owned_by
            )
            if spec.max_model_len:
                model.max_model_len = spec.max_model_len
        return response

    # -- the request template ------------------------------------------------------------------

    def _facts(self, api: str, stream: bool, model: str) -> RequestFacts:
        return RequestFacts(api, stream, model, self._clock.monotonic())

    async def _speech(
        self, http: httpbody_pb2.HttpBody, endpoint: str, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        """The form read (in a thread when the upload is large: parsing 25 MB costs tens of
        ms), then the template with `speech_body`."""
        if len(http.data) > _INLINE_FORM_BYTES:
            speech = await asyncio.to_thread(speech_request, http.content_type, http.data, endpoint)
        else:
            speech = speech_request(http.content_type, http.data, endpoint)
        api = apis.TRANSCRIPTIONS if endpoint == TRANSCRIBE_ENDPOINT else apis.TRANSLATIONS
        facts = self._facts(api, speech.stream, speech.model)
        body = partial(speech_body, self._bodies, speech, facts)
        async for message in self._serve(facts, context, body, task=Task.TRANSCRIBE):
            yield message

    async def _serve(
        self, facts: RequestFacts, context: Context, body: Body, *, task: str = Task.GENERATE
    ) -> AsyncIterator[Any]:
        """The one template of every RPC but ListModels: the replica → its task is `task` →
        admit → `body`'s messages → summary trailers → picker report → outcome record.
        Failures end the RPC with their status, the OpenAI trailers and the summary; a client
        gone leaves a summary with "abort". A request that produced output is also reported to
        its picker (`_report`), with the same summary.
        """
        replica = self._replica
        traced = self.tracing.begin(context, facts)
        try:
            assets = await self._start(facts, task)
            facts.adapter = self._adapter(context)
            if facts.adapter is not None:  # the adapter's public name, as the client sent it
                facts.model = f"{facts.model}:{facts.adapter.name}"
            facts.migrate = self._migration(context, facts.adapter)
            async with replica.admit() as admitted, aclosing(body(replica, assets)) as messages:
                facts.admitted = admitted
                if self._faults is not None:  # a live (picker-routed) request
                    self._faults.strike(bool(_metadata(context, PICKER)))
                async for message in messages:
                    if not facts.messages:
                        if facts.adapter is not None and facts.output_started:
                            self._adapters.used(facts.adapter)  # loaded: routers learn it
                        # The response headers name the replica (the picker learns which
                        # endpoint of its list answered); sent with the first message, not
                        # before: Envoy retries a request elsewhere only until it has seen
                        # response headers, so an error before any output must stay a
                        # trailers-only response.
                        await context.send_initial_metadata(((SERVED_BY, replica.replica_id),))
                    facts.messages += 1
                    yield message
        except BaseException as exc:
            # Errors, client cancels and bugs alike: the runtime's ErrorInterceptor turns an
            # error into its status and OpenAI trailers and keeps the summary trailers set
            # below (before the error leaves this generator).
            facts.fail(exc)
            raise
        finally:
            if facts.adapter is not None and facts.output_started:  # served: (still) loaded
                self._adapters.used(facts.adapter)
            ending = facts.ending()  # the one classification every view below derives from
            summary = facts.summary(ending)
            _set_trailers(context, summary)
            if self._metrics is not None and facts.stream:
                self._metrics.messages.labels(facts.api, facts.framing).observe(facts.messages)
            if facts.messages:
                self._report(context, facts, summary)
            self._emit(facts, ending, context)
            self.tracing.end(traced, facts, ending)

    async def _start(self, facts: RequestFacts, task: str) -> ModelAssets:
        """Names the replica on `facts` (and the model by the replica's served name), checks
        its task and returns its model's assets.

        Raises:
            InvalidArgumentError: the replica serves another task (`_check_task`).
            UnavailableError: the replica's spec names no task it knows (bad_replica_config).
        """
        replica = self._replica
        facts.replica = replica.replica_id
        facts.model = replica.spec.served_model_name or facts.model
        _check_task(replica, task, facts.model)
        return await self._assets.get(replica.spec)

    def _migration(
        self, context: Context, adapter: Adapter | None
    ) -> Callable[[EngineClient], EngineClient] | None:
        """How the request's engine is wrapped for mid-stream migration (issue 31): with the
        siblings its pick named (`x-inferplane-siblings`), None without any or without a
        migrator."""
        if self._migrator is None:
            return None
        siblings = decode_siblings(_metadata(context, SIBLINGS))
        if not siblings:
            return None
        named = (adapter.name, adapter.path) if adapter is not None else ("", "")
        migrator = self._migrator
        return lambda engine: migrator.wrap(engine, siblings, named)

    def _adapter(self, context: Context) -> Adapter | None:
        """The LoRA adapter the request's headers name (`AdapterRegistry.resolve`), None
        without the `x-inferplane-adapter` header.

        Raises:
            InvalidArgumentError: malformed adapter headers (code invalid_adapter).
            FailedPreconditionError: an adapter this replica cannot serve (LoRA off, a source
                outside its root, an unreadable folder, a rank above its max; codes in
                `inferplane.lora`).
        """
        name = _metadata(context, ADAPTER)
        if not name:
            return None
        return self._adapters.resolve(name, _metadata(context, ADAPTER_SOURCE))

    def _report(self, context: Context, facts: RequestFacts, summary: ResponseSummary) -> None:
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
            picker = _metadata(context, PICKER)
            request_id = _metadata(context, REQUEST_ID)
            key_id = _metadata(context, KEY_ID)
        except Exception:  # never fail a request over its report
            log.debug("picker_report_metadata_unreadable", exc_info=True)
            return
        if picker and request_id:
            took = self._clock.monotonic() - facts.started
            reported = facts.reported(summary, key_id, duration_seconds=took)
            asyncio.get_running_loop().call_soon(_report_to, report, picker, request_id, reported)

    def _emit(self, facts: RequestFacts, ending: Ending, context: Context) -> None:
        """Hands the outcome to the sink after this handler returns (never on the token path)."""
        if self._on_outcome is discard_outcome:
            return
        outcome = facts.outcome(
            ending,
            e2e_seconds=self._clock.monotonic() - facts.started,
            request_header_id=_metadata(context, REQUEST_ID),
        )
        asyncio.get_running_loop().call_soon(_deliver, self._on_outcome, outcome)


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
    """Refuses a request for another task than the replica's (OpenAI answers a model used
    on the wrong endpoint with a 400 naming `model`).

    Raises:
        InvalidArgumentError: param `model`, code `unsupported_model`.
        UnavailableError: the spec's task is not one this replica knows (bad_replica_config).
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


def _metadata(context: Context, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""

"""The router's InferenceService: model → replica, forward to its node-agent, stream back.

Typed methods forward typed messages; the `*Events` methods (what the edge calls for
`"stream": true`) write OpenAI's exact SSE bytes, so a failure after the first byte becomes a
`data: {"error": ...}` event instead of a silently truncated stream (DESIGN.md, Envoy facts).
Before the first chunk a failed or refusing replica is retried on another one; after it, never.
Where a request goes and whether it may go now is `Admission`'s job (policies, caps, queues).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import grpc
import structlog
from google.api import httpbody_pb2
from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_none

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.router.admission import Admission, AdmissionSettings, Clock, Lease, LoopScheduler
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.metrics import RouterMetrics
from inferplane.router.policies import default_registry
from inferplane.router.records import RequestTrace
from inferplane.router.replicas import ReplicaKey
from inferplane.router.reporting import RecordSend, Reporter
from inferplane.router.retry import RetryBudget
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable, resolve
from inferplane.router.usage import LoggingUsageSink, UsageSink
from inferplane.runtime import (
    InferplaneError,
    UnavailableError,
    error_from_status,
)
from inferplane.wire import SSE_DONE, chunk_to_json, completion_chunk_to_json, sse_error, sse_event

log = structlog.get_logger("inferplane.router")

# Request metadata passed on to the node-agent (set by the edge and ext_authz).
FORWARDED_METADATA = (
    "x-request-id",
    "x-inferplane-tenant",
    "x-inferplane-key-id",
    "x-inferplane-tier",
    "x-session-id",
)
REPLICA_METADATA_KEY = "x-inferplane-replica"
SSE_CONTENT_TYPE = "text/event-stream"

Context = Any  # grpc.aio.ServicerContext
Features = Callable[[Mapping[str, str]], RequestFeatures]


class UpstreamPool:
    """gRPC channels to node-agents, one per address, created on first use."""

    def __init__(self, options: Sequence[tuple[str, Any]]) -> None:
        self._options = list(options)
        self._stubs: dict[str, inference_pb2_grpc.InferenceServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> inference_pb2_grpc.InferenceServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels.append(channel)
            stub = self._stubs[address] = inference_pb2_grpc.InferenceServiceStub(channel)
        return stub

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)


def _error_from_rpc(exc: grpc.aio.AioRpcError) -> InferplaneError:
    trailers = {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "x-openai-error-code" not in trailers:
        # The node-agent itself is unreachable: a transport failure, not an answer.
        return UnavailableError("the replica is unreachable", code="replica_unavailable")
    if exc.code() == grpc.StatusCode.CANCELLED:
        # Our caller going away cancels this handler (CancelledError), never lands here: a
        # CANCELLED status is the node-agent's server dropping the call (shutdown, crash).
        return UnavailableError("the replica went away", code="replica_unavailable")
    return error_from_status(exc.code(), exc.details() or "", trailers)


class _ReplicaFailed(Exception):
    """An attempt failed on the replica itself before its first chunk: worth another one."""

    def __init__(self, error: InferplaneError) -> None:
        super().__init__(error.message)
        self.error = error


def _default_admission() -> Admission:
    return Admission(default_registry(), AdmissionSettings(), _MonotonicClock(), LoopScheduler())


class _MonotonicClock:
    def monotonic(self) -> float:
        return time.monotonic()


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """inferplane.inference.v1.InferenceService as served to the edge and internal callers.

    Per request: model → route (allow-list checked) → features → a slot on a replica chosen
    by the deployment's policy (`Admission`, which queues or answers 429) → forward. A replica
    that fails before its first chunk is retried on another one, within `max_attempts` and the
    retry budget; after the first chunk, never. Every request ends in exactly one telemetry
    record (`records`: success, error or cancel, see `inferplane.router.records`) and, when it
    carries a key, one usage report (`usage`); both hand-offs never block.

    `clock` (monotonic seconds) times queue, TTFT, ITL and e2e; `wall_clock` (Unix seconds)
    stamps the records.
    """

    def __init__(
        self,
        table: Callable[[], RouteTable],
        upstream: UpstreamPool,
        *,
        admission: Admission | None = None,
        features: FeatureExtractor | None = None,
        budget: RetryBudget | None = None,
        usage: UsageSink | None = None,
        max_attempts: int = 3,
        request_timeout_seconds: float = 600.0,
        records: RecordSend | None = None,
        metrics: RouterMetrics | None = None,
        clock: Clock | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._table = table
        self._upstream = upstream
        self._admission = admission or _default_admission()
        self._features = features or FeatureExtractor()
        self._budget = budget or RetryBudget()
        self._max_attempts = max(1, max_attempts)
        self._timeout = request_timeout_seconds
        self._metrics = metrics
        self._clock = clock or _MonotonicClock()
        self._reporter = Reporter(usage or LoggingUsageSink(), records, self._clock, wall_clock)

    # -- routing -----------------------------------------------------------------------------

    def _route(self, model: str, metadata: Mapping[str, str]) -> ModelRoute:
        table = self._table()
        route = resolve(table, model, metadata)
        self._admission.apply(table)  # no-op unless the table changed under us
        return route

    def _metadata(self, context: Context, endpoint: Endpoint) -> tuple[tuple[str, str], ...]:
        inbound = context.invocation_metadata() or ()
        out = [(k, v) for k, v in inbound if k in FORWARDED_METADATA]
        if endpoint.replica_id:
            out.append((REPLICA_METADATA_KEY, endpoint.replica_id))
        return tuple(out)

    def _timeout_for(self, context: Context) -> float:
        remaining = context.time_remaining()
        return min(self._timeout, remaining) if remaining is not None else self._timeout

    def _retrying(self) -> AsyncRetrying:
        metrics = self._metrics

        def should_retry(state: RetryCallState) -> bool:
            outcome = state.outcome
            if outcome is None or not isinstance(outcome.exception(), _ReplicaFailed):
                return False
            if state.attempt_number >= self._max_attempts:
                if metrics is not None:
                    metrics.retries_refused.labels("attempts").inc()
                return False
            if not self._budget.try_withdraw():
                if metrics is not None:
                    metrics.retries_refused.labels("budget").inc()
                return False
            if metrics is not None:
                metrics.retries.inc()
            return True

        return AsyncRetrying(
            stop=stop_after_attempt(self._max_attempts),
            retry=should_retry,
            wait=wait_none(),
            reraise=True,
        )

    async def _acquire(
        self,
        route: ModelRoute,
        features: RequestFeatures,
        tried: set[ReplicaKey],
        last: list[InferplaneError],
        context: Context,
        trace: RequestTrace,
    ) -> Lease:
        waited_from = self._clock.monotonic()
        try:
            lease = await self._admission.acquire(
                route, features, exclude=tried, timeout=self._timeout_for(context)
            )
        except UnavailableError:
            if last:  # every replica was tried: the client learns why the last one failed
                raise last[-1] from None
            raise
        finally:
            trace.queue_seconds += self._clock.monotonic() - waited_from
        trace.replica = lease.endpoint.replica_id or lease.endpoint.address
        trace.node = lease.endpoint.node
        return lease

    def _failed(
        self,
        lease: Lease,
        exc: grpc.aio.AioRpcError,
        tried: set[ReplicaKey],
        last: list[InferplaneError],
    ) -> InferplaneError | _ReplicaFailed:
        error = _error_from_rpc(exc)
        if not isinstance(error, UnavailableError):
            return error
        lease.failed()
        tried.add(lease.key)
        last.append(error)
        log.warning(
            "replica_retry",
            address=lease.endpoint.address,
            replica=lease.endpoint.replica_id,
            error=error.message,
        )
        return _ReplicaFailed(error)

    def _begin(self, model: str, stream: bool, metadata: dict[str, str]) -> RequestTrace:
        return self._reporter.begin(model, stream, metadata)

    def _finish(self, trace: RequestTrace, metadata: Mapping[str, str]) -> None:
        """The request ended: one usage report (keyed requests) and one telemetry record."""
        self._reporter.finish(trace, metadata)

    @staticmethod
    @contextlib.contextmanager
    def _outcome(trace: RequestTrace) -> Iterator[None]:
        """Classifies how the request ended into `trace` (error code, cancel), re-raising."""
        try:
            yield
        except _ReplicaFailed as exc:
            trace.fail(exc.error.code)
            raise exc.error from None
        except InferplaneError as exc:
            trace.fail(exc.code)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.cancel()
            raise
        except Exception:
            trace.fail("internal_error")
            raise

    async def _unary(
        self, model: str, method: str, request: Any, context: Context, features: Features
    ) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        trace = self._begin(model, False, metadata)
        try:
            with self._outcome(trace):
                route = self._route(model, metadata)
                trace.deployment = route.deployment_key
                response = await self._unary_attempts(
                    route, method, request, context, features(metadata), trace
                )
                trace.on_response(response)
                return response
        finally:
            self._finish(trace, metadata)

    async def _unary_attempts(
        self,
        route: ModelRoute,
        method: str,
        request: Any,
        context: Context,
        wanted: RequestFeatures,
        trace: RequestTrace,
    ) -> Any:
        self._budget.deposit()
        tried: set[ReplicaKey] = set()
        last: list[InferplaneError] = []

        async def attempt() -> Any:
            lease = await self._acquire(route, wanted, tried, last, context, trace)
            try:
                call = getattr(self._upstream.stub(lease.endpoint.address), method)
                response = await call(
                    request,
                    metadata=self._metadata(context, lease.endpoint),
                    timeout=self._timeout_for(context),
                )
                lease.first_chunk()
                return response
            except grpc.aio.AioRpcError as exc:
                raise self._failed(lease, exc, tried, last) from None
            finally:
                lease.release()

        return await self._retrying()(attempt)

    async def _stream(
        self, model: str, method: str, request: Any, context: Context, features: Features
    ) -> AsyncGenerator[Any, None]:
        """Forwards a typed stream; retries on another replica only before the first chunk.

        The upstream request always asks for usage (so the router can account tokens); the
        usage-only chunk is passed on only when the client asked for it.
        """
        metadata = dict(context.invocation_metadata() or ())
        trace = self._begin(model, True, metadata)
        try:
            with self._outcome(trace):
                route = self._route(model, metadata)
                trace.deployment = route.deployment_key
                wanted = features(metadata)
                async for chunk in self._stream_attempts(
                    route, method, request, context, wanted, trace
                ):
                    yield chunk
        finally:
            self._finish(trace, metadata)

    async def _stream_attempts(
        self,
        route: ModelRoute,
        method: str,
        request: Any,
        context: Context,
        wanted: RequestFeatures,
        trace: RequestTrace,
    ) -> AsyncIterator[Any]:
        client_wants_usage = request.request.stream_options.include_usage
        upstream_request = type(request)()
        upstream_request.CopyFrom(request)
        upstream_request.request.stream_options.include_usage = True
        self._budget.deposit()
        tried: set[ReplicaKey] = set()
        last: list[InferplaneError] = []

        async def attempt() -> tuple[Lease, Any, Any]:
            lease = await self._acquire(route, wanted, tried, last, context, trace)
            call = getattr(self._upstream.stub(lease.endpoint.address), method)(
                upstream_request,
                metadata=self._metadata(context, lease.endpoint),
                timeout=self._timeout_for(context),
            )
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                lease.release()
                raise self._failed(lease, exc, tried, last) from None
            except BaseException:
                call.cancel()
                lease.release()
                raise
            lease.first_chunk()
            return lease, call, first

        lease, call, chunk = await self._retrying()(attempt)
        try:
            while chunk is not grpc.aio.EOF:
                trace.on_chunk(chunk, self._clock.monotonic())
                if client_wants_usage or len(chunk.choices) or not chunk.HasField("usage"):
                    yield chunk
                chunk = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error_from_rpc(exc) from None
        finally:
            # A client that went away cancels this generator: cancel the upstream call so
            # the node-agent aborts the engine request.
            call.cancel()
            lease.release()

    async def _events(
        self, chunks: AsyncGenerator[Any, None], to_json: Callable[[Any], bytes]
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        started = False
        try:
            async with contextlib.aclosing(chunks):  # a client gone closes the inner stream now
                async for chunk in chunks:
                    data = sse_event(to_json(chunk))
                    if started:
                        yield httpbody_pb2.HttpBody(data=data)
                    else:
                        started = True
                        yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=data)
        except InferplaneError as exc:
            if not started:
                raise
            log.warning("stream_failed_after_first_chunk", error=exc.message, code=exc.code)
            yield httpbody_pb2.HttpBody(
                data=sse_error(exc.message, exc.openai_type, exc.code, exc.param)
            )
            return
        if started:
            yield httpbody_pb2.HttpBody(data=SSE_DONE)
        else:
            yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=SSE_DONE)

    # -- RPCs --------------------------------------------------------------------------------

    async def CreateChatCompletion(
        self, request: pb.CreateChatCompletionRequest, context: Context
    ) -> pb.CreateChatCompletionResponse:
        return await self._unary(
            request.request.model,
            "CreateChatCompletion",
            request,
            context,
            partial(self._features.chat, request.request),
        )

    async def StreamChatCompletion(
        self, request: pb.StreamChatCompletionRequest, context: Context
    ) -> AsyncIterator[Any]:
        async for chunk in self._stream(
            request.request.model,
            "StreamChatCompletion",
            request,
            context,
            partial(self._features.chat, request.request),
        ):
            yield chunk

    async def StreamChatCompletionEvents(
        self, request: pb.StreamChatCompletionEventsRequest, context: Context
    ) -> AsyncIterator[Any]:
        typed = pb.StreamChatCompletionRequest(request=request.request)
        chunks = self._stream(
            request.request.model,
            "StreamChatCompletion",
            typed,
            context,
            partial(self._features.chat, request.request),
        )
        async for body in self._events(chunks, chunk_to_json):
            yield body

    async def CreateCompletion(
        self, request: pb.CreateCompletionRequest, context: Context
    ) -> pb.CreateCompletionResponse:
        return await self._unary(
            request.request.model,
            "CreateCompletion",
            request,
            context,
            partial(self._features.completion, request.request),
        )

    async def StreamCompletion(
        self, request: pb.StreamCompletionRequest, context: Context
    ) -> AsyncIterator[Any]:
        async for chunk in self._stream(
            request.request.model,
            "StreamCompletion",
            request,
            context,
            partial(self._features.completion, request.request),
        ):
            yield chunk

    async def StreamCompletionEvents(
        self, request: pb.StreamCompletionEventsRequest, context: Context
    ) -> AsyncIterator[Any]:
        typed = pb.StreamCompletionRequest(request=request.request)
        chunks = self._stream(
            request.request.model,
            "StreamCompletion",
            typed,
            context,
            partial(self._features.completion, request.request),
        )
        async for body in self._events(chunks, completion_chunk_to_json):
            yield body

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        now = int(time.time())
        response = pb.ListModelsResponse(object="list")
        for route in self._table().models():
            model = response.data.add(
                id=route.model,
                object="model",
                created=route.created or now,
                owned_by=route.owned_by,
            )
            if route.max_model_len:
                model.max_model_len = route.max_model_len
        return response

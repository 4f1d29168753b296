"""`EndpointPicker`: the `envoy.service.ext_proc.v3.ExternalProcessor` servicer that runs one
request's ext_proc stream: it reads each message (`codec`), moves the request's `Exchange`
through its `Phase`s, authenticates the request's key in its first exchange (the router's
`KeyTable`, before any body is read), asks the `Director` for the decision (keeping Envoy's
message timer alive while the request queues, and noticing the client going away), and hands
the request's end to the `Concluder`. Gateway mode's request phase is `gateway.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from inferplane.apis import anthropic
from inferplane.router import revision_pin
from inferplane.router.admission import Admission
from inferplane.router.canary import CanarySplit
from inferplane.router.features import FeatureExtractor
from inferplane.router.keylimits import KeyLimiter
from inferplane.router.keys import KeyTable, Principal
from inferplane.router.metrics import RouterMetrics
from inferplane.router.picker import codec
from inferplane.router.picker.conclusion import Concluder
from inferplane.router.picker.director import Director, Outside, RequestFacts, Routed
from inferplane.router.picker.gateway import (
    GatewayMode,
    gateway_headers,
    gateway_request,
    gateway_served,
)
from inferplane.router.picker.state import Exchange, Phase, RequestPart, ResponsePart
from inferplane.router.picker.tracing import PICKER_TRACING_OFF, PickerTracing
from inferplane.router.records import RequestTrace
from inferplane.router.reporting import Reporter
from inferplane.router.routes import RouteTable
from inferplane.runtime import (
    OPENAI_ERROR_CODE_KEY,
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from inferplane.wire import SUMMARY_KEYS, ResponseSummary, apis, headers
from inferplane.wire.siblings import Sibling, encode_siblings

log = structlog.get_logger("inferplane.router.picker")

Context = Any  # grpc.aio.ServicerContext
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_BEFORE_RESPONSE = (Phase.REQUEST_HEADERS_DONE, Phase.BODY_DONE)
_RESPONDING = (*_BEFORE_RESPONSE, Phase.RESPONSE_HEADERS_DONE, Phase.RESPONSE_STARTED)


@dataclasses.dataclass(frozen=True, slots=True)
class PickerSettings:
    """Knobs of the endpoint picker (see `RouterSettings.picker_*`).

    Attributes:
        fallbacks: endpoints listed after the primary (Envoy tries them, in order, when the
            primary fails before its first response byte); 0 = the primary only.
        keepalive_seconds: how long a request may wait in the admission queue before the
            picker extends Envoy's ext_proc message timer; must stay below the edge's
            `message_timeout` (1 s).
        timeout_margin_seconds: added to the longest remaining queue wait in that extension;
            the edge's `max_message_timeout` must be at least queue timeout + this margin
            (Envoy ignores a larger extension).
        outcome_address: `host:port` of this router's `inferplane.router.v1.OutcomeService`,
            sent to the replica with every pick (`x-inferplane-picker`) so that it reports how
            the request ended; "" = no report asked for (the trailers only).
        outcome_wait_seconds: how long a request whose response started but whose trailers
            never reached the picker (its client closed the connection right after
            `data: [DONE]`) waits for the replica's report before it is recorded as aborted.
    """

    fallbacks: int = 2
    keepalive_seconds: float = 0.25
    timeout_margin_seconds: float = 1.0
    outcome_address: str = ""
    outcome_wait_seconds: float = 5.0


class _Reader:
    """The side stream's requests, with at most one read in flight, so that a read can race
    admission (Envoy closing the stream while the request is queued = client gone)."""

    __slots__ = ("_it", "_pending")

    def __init__(self, requests: AsyncIterator[ext_pb.ProcessingRequest]) -> None:
        self._it = aiter(requests)
        self._pending: asyncio.Future[ext_pb.ProcessingRequest | None] | None = None

    async def _read(self) -> ext_pb.ProcessingRequest | None:
        try:
            return await anext(self._it)
        except StopAsyncIteration:
            return None

    def pending(self) -> asyncio.Future[ext_pb.ProcessingRequest | None]:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._read())
        return self._pending

    async def next(self) -> ext_pb.ProcessingRequest | None:
        """The next message; None once Envoy half-closed the stream."""
        pending, self._pending = self._pending, None
        return await (pending if pending is not None else self._read())

    def close(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()


class _ClientGone(Exception):
    """Envoy closed the side stream while the request waited in the queue."""


class EndpointPicker(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`envoy.service.ext_proc.v3.ExternalProcessor` as the router's endpoint picker.

    `table` returns the current routing table; `admission` holds the slots, queues and
    breakers; `reporter` hands over one usage report and one record per request; `metrics`
    (optional) counts requests a fallback served and orphan reports. `tracing`: the spans of
    its requests (`picker/tracing.py`; off unless the app sets it).

    `keys`, the key table auth streams to this router, authenticates every request on its
    headers (401 / 403 / 503 `auth_unavailable` in the API's error shape before the body is
    read; on success auth's verdict headers replace the key and the picker marks the request
    authenticated, `headers.PICKER_AUTHENTICATED`). Without it the verdict must come from
    ext_authz before the picker (`x-inferplane-key-id` present: the request is marked;
    absent: unmarked, which the edge's picker guard refuses). `key_limits` then admits each
    authenticated generation request on its key's limits (`keylimits.KeyLimiter`: 429 at the
    headers; the x-ratelimit-* headers on the allowed response); None: not enforced here.
    """

    tracing: PickerTracing = PICKER_TRACING_OFF

    def __init__(
        self,
        table: Callable[[], RouteTable],
        admission: Admission,
        reporter: Reporter,
        *,
        features: FeatureExtractor | None = None,
        settings: PickerSettings | None = None,
        metrics: RouterMetrics | None = None,
        keys: KeyTable | None = None,
        key_limits: KeyLimiter | None = None,
    ) -> None:
        self._settings = settings = settings or PickerSettings()
        self._keys = keys
        self._key_limits = key_limits
        self._reporter = reporter
        self._clock = reporter.clock
        canary = CanarySplit(  # the canary's split of live traffic (issue 30)
            admission.replicas, fallbacks=metrics.canary_fallbacks if metrics else None
        )
        self.director = Director(
            table, admission, features=features, fallbacks=settings.fallbacks, canary=canary
        )
        self.concluder = Concluder(
            admission,
            reporter,
            metrics=metrics,
            outcome_address=settings.outcome_address,
            outcome_wait_seconds=settings.outcome_wait_seconds,
            served_name=self.director.served_name,
        )

    async def Process(
        self, request_iterator: AsyncIterator[ext_pb.ProcessingRequest], context: Context
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """One ext_proc stream = one HTTP request (the package docstring); ends when Envoy
        half-closes, after an immediate response, or when the call is cancelled."""
        self.tracing.stream_opened(context)
        async for response in self.process(request_iterator):
            yield response

    def report_outcomes(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """`Concluder.report_outcomes`: replicas' reports of how requests ended."""
        return self.concluder.report_outcomes(outcomes)

    async def report_outcomes_settled(self, outcomes: Sequence[tuple[str, ResponseSummary]]) -> int:
        """`Concluder.report_outcomes_settled`: the reports, acknowledged once their
        conclusions are in the durable outbox."""
        return await self.concluder.report_outcomes_settled(outcomes)

    async def process(
        self,
        request_iterator: AsyncIterator[ext_pb.ProcessingRequest],
        gateway: GatewayMode | None = None,
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """`Process` for the edge (`gateway` None) or for a conformant gateway
        (`GatewayProcessor`): one stream, one request, the same decision path."""
        # A placeholder trace until the request headers arrive (they carry its ids).
        exchange = Exchange(RequestPart(RequestTrace("", False, 0.0, 0.0)), gateway=gateway)
        reader = _Reader(request_iterator)
        try:
            while (message := await reader.next()) is not None:
                if gateway is not None and message.HasField("protocol_config"):
                    config = message.protocol_config
                    exchange.request.duplex = config.request_body_mode == _FULL_DUPLEX
                    exchange.request.duplex_response = config.response_body_mode == _FULL_DUPLEX
                served = codec.served(message)
                if served and gateway is not None:
                    served = gateway_served(exchange, gateway, served)
                exchange.response.served = served or exchange.response.served
                refused = False
                try:
                    async with contextlib.aclosing(
                        self._respond(exchange, message, reader)
                    ) as responses:
                        async for response in responses:
                            refused = response.HasField("immediate_response")
                            yield response
                except _ClientGone:
                    return
                if refused:
                    return  # Envoy ends the request; nothing else comes on this stream
        finally:
            reader.close()
            self.concluder.end(exchange)

    async def _respond(
        self, exchange: Exchange, message: ext_pb.ProcessingRequest, reader: _Reader
    ) -> AsyncGenerator[ext_pb.ProcessingResponse, None]:
        kind = message.WhichOneof("request")
        request_phase = kind in ("request_headers", "request_body", "request_trailers")
        try:
            if kind == "request_headers":
                with self.tracing.authn(exchange):
                    answer = self._on_request_headers(exchange, message)
                if answer is not None:
                    yield answer
            elif exchange.gateway is not None and request_phase:

                def decide(
                    ex: Exchange, method: codec.Method, decoded: Any, outside: Outside
                ) -> AsyncIterator[ext_pb.ProcessingResponse]:
                    return self._decide(ex, method, decoded, reader, outside)

                outcome = self._settings.outcome_address
                async for response in gateway_request(exchange, message, decide, outcome):
                    yield response
            elif kind == "request_body":
                async for response in self._on_request_body(exchange, message.request_body, reader):
                    yield response
            elif kind == "response_headers":
                yield self._on_response_headers(exchange, message.response_headers)
            elif kind == "response_trailers":
                yield self._on_response_trailers(exchange, message.response_trailers)
            elif kind == "request_trailers":  # not in the edge's mode; pass through
                yield ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())
            elif kind == "response_body":
                yield codec.body_answer(
                    message.response_body, "response_body", exchange.request.duplex_response
                )
            else:
                raise InvalidArgumentError("an ext_proc message without a request part")
        except InferplaneError as exc:
            yield self._refuse(exchange, exc)
        except (_ClientGone, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("picker_message_failed", kind=kind, request_id=exchange.trace.request_id)
            if request_phase or kind is None:
                yield self._refuse(exchange, InternalError("the endpoint picker failed"))
            elif kind == "response_headers":  # never break a response over our own bug
                yield ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse())
            else:
                yield ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse())

    def _refuse(self, exchange: Exchange, error: InferplaneError) -> ext_pb.ProcessingResponse:
        if exchange.phase is Phase.RECEIVED:  # refused before any request headers
            exchange.request.trace = self._reporter.begin("", False, {})
        if exchange.phase not in (Phase.ENDED, Phase.CONCLUDED):
            exchange.phase = Phase.REFUSED
        exchange.trace.fail(error.code)
        request = exchange.request
        if request.method is not None:
            api = request.method.api
        else:  # a path the picker does not serve: Anthropic's shape under its prefix
            api = apis.MESSAGES if anthropic.is_anthropic_path(request.path) else ""
        response = codec.immediate_response(error, api)
        if exchange.pick.labels:
            codec.picker_metadata(response, exchange.pick.labels)
        return response

    # -- request ------------------------------------------------------------------------------

    def _on_request_headers(
        self, exchange: Exchange, message: ext_pb.ProcessingRequest
    ) -> ext_pb.ProcessingResponse | None:
        """Opens the request's trace, authenticates its key (`_authenticate`) and checks its
        REST path (a gateway's: `gateway_headers`). Returns the answer (auth's verdict and the
        picker's mark, `codec.authenticated_response`; None: a duplex gateway's headers wait
        for the body's end).

        Raises:
            UnauthenticatedError / PermissionDeniedError / UnavailableError: the key
                (`KeyTable.authenticate`: 401, 403, 503), before anything else.
            NotFoundError: a path or verb that is no generation method (404 unknown_url).
            InvalidArgumentError: no body will follow (400).
        """
        request = exchange.request
        request.metadata = codec.header_map(message.request_headers.headers)
        request.path = request.metadata.get(":path", "").partition("?")[0]
        methods = codec.ROUTES.get(request.path)
        request.method = methods[0] if methods is not None else None  # shapes a refusal
        request.trace = self._reporter.begin("", False, request.metadata)
        if exchange.phase is Phase.RECEIVED:
            exchange.phase = Phase.REQUEST_HEADERS_DONE
        self._authenticate(exchange)
        if request.granted is not None:  # an operator's revision pin never reaches a replica
            revision_pin.strip(request.granted, request.metadata)
        if exchange.gateway is not None:
            gateway_headers(exchange, message, authenticated=self._keys is not None)
            if request.duplex:
                return None
            return codec.authenticated_response(request.granted)
        verb = request.metadata.get(":method", "")
        if request.method is None or verb != "POST":
            shown = request.path or "/"
            raise NotFoundError(f"Invalid URL ({verb} {shown})", code="unknown_url")
        request.trace.api = request.method.api
        if message.request_headers.end_of_stream:  # no body message would follow, so no pick
            raise InvalidArgumentError("the request has no body", code="invalid_body")
        return codec.authenticated_response(request.granted)

    def _authenticate(self, exchange: Exchange) -> None:
        """Authenticates the request's key with the key table: the request's metadata then
        holds auth's verdict (`headers.AUTH_VERDICT`, what the `Director` and the reports read)
        instead of the key, and `request.granted` the headers answer. Without a table, a
        verdict ext_authz already set (`x-inferplane-key-id`) marks the request.

        Raises:
            UnauthenticatedError, PermissionDeniedError, UnavailableError:
                `KeyTable.authenticate`'s refusals.
        """
        request = exchange.request
        if self._keys is None:
            if request.metadata.get(headers.KEY_ID):
                request.granted = ext_pb.HeaderMutation()
            return
        principal = self._keys.authenticate(request.metadata, request.path or "/")
        granted = codec.verdict(principal)
        mutation = ext_pb.HeaderMutation()
        codec.verdict_mutation(mutation, granted, request.metadata)
        request.metadata = {
            k: v
            for k, v in request.metadata.items()
            if k not in headers.CLIENT_KEY_HEADERS and not k.startswith(headers.TRUSTED_PREFIX)
        }
        request.metadata.update(granted)
        request.granted = mutation
        exchange.trace.tenant, exchange.trace.key_id = principal.tenant, principal.key_id
        self._admit_key(exchange, principal)

    def _admit_key(self, exchange: Exchange, principal: Principal) -> None:
        """The key's own limits (requests, tokens, concurrency, budget: `KeyLimiter.admit`),
        checked right after it authenticated, for a generation request (POST): its lease goes
        on the exchange (`request.key`; released at the request's one end, `Concluder`).

        Raises:
            ResourceExhaustedError: the key's refusal (429 `rate_limit_exceeded` or
                `insufficient_quota`, with `retry-after` and x-ratelimit-*), answered before
                the body is read.
        """
        request = exchange.request
        if self._key_limits is None or request.metadata.get(":method") != "POST":
            return
        if exchange.gateway is None and request.method is None:
            return  # no generation path: 404 without counting
        request.key = self._key_limits.admit(principal, exchange.trace.request_id)

    async def _on_request_body(
        self, exchange: Exchange, message: ext_pb.HttpBody, reader: _Reader
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        request = exchange.request
        methods = codec.ROUTES.get(request.path)
        if methods is None or exchange.pick.endpoints:
            raise InvalidArgumentError("a request body without request headers")
        content_type = request.metadata.get("content-type", "")
        method, decoded = codec.decode_request(methods, message.body, content_type)
        request.method, exchange.trace.stream = method, method.stream
        with self.tracing.pick(exchange):
            async for keepalive in self._decide(exchange, method, decoded, reader):
                yield keepalive
        endpoints = exchange.pick.endpoints
        addresses = [e.address for e in endpoints]
        siblings = encode_siblings(
            Sibling(e.replica_id, e.revision, e.address) for e in endpoints if len(endpoints) > 1
        )
        response = codec.pick_response(addresses, self._settings.outcome_address, siblings)
        codec.adapter_headers(
            response.request_body.response.header_mutation,
            exchange.pick.adapter,
            exchange.pick.adapter_source,
        )
        codec.picker_metadata(response, exchange.pick.labels)
        yield response

    async def _decide(
        self,
        exchange: Exchange,
        method: codec.Method,
        decoded: Any,
        reader: _Reader,
        outside: Outside | None = None,
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """The `Director`'s decision on a typed request (edge and gateway alike), step by
        step into the trace, yielding the message-timer extension while queued; sets the
        exchange's pick (→ `Phase.BODY_DONE`). `outside`: a gateway's subset (no fallbacks).

        Raises:
            InferplaneError: the refusal (400, 403, 404, 429, 503).
            _ClientGone: Envoy closed the stream while the request was queued.
        """
        trace = exchange.trace
        facts = RequestFacts.of(method, decoded, exchange.request.metadata)
        trace.model = facts.model
        if method.to_chat is not None:  # one method serves both: the body says
            trace.stream = facts.request.stream
        exchange.pick.labels[headers.PICKER_MODEL] = self.director.served_name(facts.model)
        routed = self.director.route(facts, outside)
        trace.deployment = routed.route.deployment_key
        trace.adapter = exchange.pick.adapter = routed.route.adapter
        exchange.pick.adapter_source = routed.route.adapter_source
        with self.tracing.queue(exchange):
            async for keepalive in self._admit(exchange, routed, reader):
                yield keepalive
        slot = exchange.pick.slot
        assert slot is not None  # _admit either set it or raised
        trace.replica = slot.endpoint.replica_id or slot.endpoint.address
        trace.node = slot.endpoint.node
        exchange.pick.picked = self._clock.monotonic()
        exchange.phase = Phase.BODY_DONE
        self.concluder.picked(exchange)

    async def _admit(
        self, exchange: Exchange, routed: Routed, reader: _Reader
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        """Takes a slot and the endpoint list (`Director.admit`; sets the exchange's pick),
        yielding the message-timer extension when the request has to queue.

        Envoy honours ONE `override_message_timeout` per message (its ProcessorState keeps a
        `new_timeout_received_` flag, reset per message), so the single extension covers the
        longest remaining wait plus the margin instead of being re-sent periodically: the
        queue timeout's, or a deployment at zero's cold-start budget while a replica starts
        (the edge's `max_message_timeout` must cover it, or Envoy ignores the extension).

        Raises:
            ResourceExhaustedError / UnavailableError: from `Admission.acquire` (429 / 503).
            _ClientGone: Envoy closed the stream while the request was queued.
        """
        started = self._clock.monotonic()
        pick = exchange.pick
        admitting = pick.admitting = asyncio.ensure_future(self.director.admit(routed))
        try:
            done, _ = await asyncio.wait((admitting,), timeout=self._settings.keepalive_seconds)
            if not done:
                waited = self._clock.monotonic() - started
                limit = self.director.wait_seconds(routed.route)  # a cold start's budget
                remaining = max(0.0, limit - waited)
                yield codec.extend(remaining + self._settings.timeout_margin_seconds)
                await self._wait_or_gone(admitting, reader)
            decision = admitting.result()
            pick.slot, pick.endpoints = decision.slot, decision.endpoints
        finally:
            exchange.trace.queue_seconds += self._clock.monotonic() - started

    @staticmethod
    async def _wait_or_gone(admitting: asyncio.Future[Any], reader: _Reader) -> None:
        incoming = reader.pending()
        await asyncio.wait((admitting, incoming), return_when=asyncio.FIRST_COMPLETED)
        if admitting.done():
            return
        if incoming.cancelled() or incoming.exception() is not None or incoming.result() is None:
            raise _ClientGone()
        # A message before our answer breaks the protocol; keep it for the loop, keep waiting.
        await admitting

    # -- response -----------------------------------------------------------------------------

    def _on_response_headers(
        self, exchange: Exchange, message: ext_pb.HttpHeaders
    ) -> ext_pb.ProcessingResponse:
        seen = codec.header_map(message.headers)
        status = seen.get(":status", "")
        exchange.response.http_status = int(status) if status.isdigit() else 0
        if exchange.phase in _BEFORE_RESPONSE:
            # The replica names itself in the headers it sends with its first message.
            output = headers.SERVED_BY in seen and not message.end_of_stream
            exchange.phase = Phase.RESPONSE_STARTED if output else Phase.RESPONSE_HEADERS_DONE
            try:
                _note_outcome(exchange.response, seen)
            finally:
                self.concluder.judge(exchange)  # once: on entering the response
        else:
            _note_outcome(exchange.response, seen)
        if message.end_of_stream:  # trailers-only (an error): nothing else will come
            self.concluder.end(exchange)
        mutation = codec.summary_removal(seen)
        for name, value in exchange.request.key.headers:  # the key's x-ratelimit-*
            codec.set_header(mutation, name, value)
        revision_pin.mark_served(mutation, revision_pin.served(exchange.pick.endpoints, seen))
        return ext_pb.ProcessingResponse(
            response_headers=ext_pb.HeadersResponse(
                response=ext_pb.CommonResponse(header_mutation=mutation)
            )
        )

    def _on_response_trailers(
        self, exchange: Exchange, message: ext_pb.HttpTrailers
    ) -> ext_pb.ProcessingResponse:
        seen = codec.header_map(message.trailers)
        if exchange.phase in _RESPONDING:
            exchange.phase = Phase.RESPONSE_DONE
        _note_outcome(exchange.response, seen)
        self.concluder.end(exchange)
        return ext_pb.ProcessingResponse(
            response_trailers=ext_pb.TrailersResponse(header_mutation=codec.summary_removal(seen))
        )


def _note_outcome(response: ResponsePart, seen: dict[str, str]) -> None:
    """Records the gRPC status, OpenAI error code and summary among response headers or
    trailers."""
    status = seen.get("grpc-status")
    if status is not None and status.isdigit():
        response.grpc_status = int(status)
    response.error_code = seen.get(OPENAI_ERROR_CODE_KEY, response.error_code)
    if any(k in seen for k in SUMMARY_KEYS):
        response.summary = ResponseSummary.from_metadata(seen)

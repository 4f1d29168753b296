"""The picker's decision, without ext_proc: route → admit → pick.

`Director.decide(facts)` takes what a request says (its method, model, typed request and the
edge's headers) and returns the `Decision` (the slot and the ordered endpoint list), or raises
the refusal the client gets. The ext_proc server (`server.py`) runs the same steps one by one
(`route`, then `admit` while it keeps Envoy's message timer alive and watches for the client
going away), so what a test of `decide` sees is what Envoy gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from inferplane.promptsize import TokenBounds, check_prompt_size
from inferplane.router import revision_pin
from inferplane.router.admission import Admission, Slot
from inferplane.router.canary import CanaryChoice, CanarySplit, order_fallbacks
from inferplane.router.features import FeatureExtractor, RequestFeatures
from inferplane.router.picker.codec import Method, form_model
from inferplane.router.replicas import ReplicaKey
from inferplane.router.routes import Endpoint, ModelRoute, RouteTable, resolve
from inferplane.router.schemas import SchemaCheck
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import headers

if TYPE_CHECKING:
    from inferplane.router.tokenize import PromptTokens

#: A gateway's restriction: the replicas of a route outside its endpoint subset.
Outside = Callable[[ModelRoute], Sequence[ReplicaKey]]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the decision reads of one request.

    Attributes:
        method: the generation method (`codec.METHODS`).
        model: the model the client asked for (before aliases).
        request: the typed request inside the method's wrapper (`ChatCompletionRequest`,
            `CompletionRequest`, `EmbeddingRequest`), the `ChatCompletionRequest` a Messages
            or Responses request converts to (`Method.to_chat`), or the `HttpBody` of an
            audio request.
        metadata: the request's headers, lower-case keys (auth's verdict, `x-session-id`).
    """

    method: Method
    model: str
    request: Any
    metadata: Mapping[str, str]

    @classmethod
    def of(cls, method: Method, decoded: Any, metadata: Mapping[str, str]) -> RequestFacts:
        """The facts of `decoded`, an instance of `method.request_type`.

        Raises:
            InvalidArgumentError: an audio request's form is unreadable or has no model (400).
        """
        if method.speech:
            return cls(method, form_model(decoded.body), decoded.body, metadata)
        if method.to_chat is not None:
            chat = method.to_chat(decoded.request)
            return cls(method, chat.model, chat, metadata)
        return cls(method, decoded.request.model, decoded.request, metadata)


@dataclasses.dataclass(frozen=True, slots=True)
class Routed:
    """A request whose route is known: what admission needs.

    Attributes:
        facts: the request.
        route: its model's route (deployment, endpoints, policy).
        features: what the routing policy reads of it.
        exclude: replicas it may not go to (outside a gateway's subset; during a canary,
            those of the revisions it was not split to: `router.canary`).
        fallbacks: how many endpoints to list after the primary (0 for a gateway).
        canary: its revision during a canary (None: the route has no split).
    """

    facts: RequestFacts
    route: ModelRoute
    features: RequestFeatures
    exclude: Collection[ReplicaKey] = ()
    fallbacks: int = 0
    canary: CanaryChoice | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes.

    Attributes:
        route: its model's route.
        slot: the slot held on the primary; its holder releases it exactly once.
        endpoints: the primary (the slot's) first, then the fallbacks in the policy's order.
    """

    route: ModelRoute
    slot: Slot
    endpoints: tuple[Endpoint, ...]


class Director:
    """Route → admit → pick for the endpoint picker.

    `table` returns the current routing table (it can change between calls; admission follows
    it); `admission` holds the slots, queues and breakers; `fallbacks` is how many endpoints
    an edge request lists after the primary (`PickerSettings.fallbacks`).
    """

    def __init__(
        self,
        table: Callable[[], RouteTable],
        admission: Admission,
        *,
        features: FeatureExtractor | None = None,
        fallbacks: int = 2,
        canary: CanarySplit | None = None,
    ) -> None:
        self._table = table
        self._admission = admission
        self._canary = canary or CanarySplit(admission.replicas)
        self._features = features or FeatureExtractor()
        self._schemas = SchemaCheck()
        # Each route's tokenizer bound, for refusing a prompt too large to fit by its size.
        self.token_bounds = TokenBounds()
        self._fallbacks = fallbacks
        # Set by the composition root when the replica state watch runs: adds the prompt's
        # KV block hashes for precise_prefix routes before admission (`router.tokenize`).
        self.prompt_tokens: PromptTokens | None = None

    @property
    def queue_timeout_seconds(self) -> float:
        """The longest a request waits in admission's queue (seconds)."""
        return self._admission.queue_timeout_seconds

    def wait_seconds(self, route: ModelRoute) -> float:
        """The longest a request of `route` may wait for a slot now (seconds): the queue
        timeout, or a deployment at zero's cold-start budget (`Admission.wait_seconds`)."""
        return self._admission.wait_seconds(route)

    async def decide(self, facts: RequestFacts, outside: Outside | None = None) -> Decision:
        """`route`, then `admit`: the decision on one request (waits while it is queued).

        Raises:
            as `route` and `admit`.
        """
        return await self.admit(self.route(facts, outside))

    def route(self, facts: RequestFacts, outside: Outside | None = None) -> Routed:
        """The route of the request's model and its features; with `outside` (a gateway's
        subset) the replicas to leave out, and no fallbacks.

        Raises:
            InvalidArgumentError: no model, or a chat request's schema is invalid (400; before
                it takes a slot).
            PermissionDeniedError: the key may not use the model (403 model_not_allowed), or
                pins a revision without the admin scope (403 insufficient_scope).
            NotFoundError: no route serves the model (404 model_not_found).
            InvalidArgumentError: the prompt's size alone proves it cannot fit the route's
                `max_model_len` (400 context_length_exceeded, `inferplane.promptsize`).
            UnavailableError: the pinned revision has no ready endpoint (503
                revision_unavailable).
        """
        method, metadata = facts.method, facts.metadata
        if not facts.model:  # as OpenAI and Anthropic answer a body without one
            raise InvalidArgumentError(
                "you must provide a model parameter",
                param="model",
                code="missing_required_parameter",
            )
        if method.speech:
            route = self._resolve(facts.model, metadata)
            features = self._features.speech(len(facts.request.data), metadata)
        else:
            if method.chat:
                self._schemas.check_chat(facts.request)  # a client's bad schema never takes a slot
            route = self._resolve(facts.model, metadata)
            # A prompt whose size alone exceeds the context: 400 before anything tokenizes it.
            check_prompt_size(
                facts.request, route.max_model_len, self.token_bounds.get(route.tokenizer)
            )
            # A LoRA adapter's prefixes are its own (`features.adapter_salt`, issue 29).
            if method.chat:
                features = self._features.chat(facts.request, metadata, route.adapter)
            elif method.embedding:
                features = self._features.embedding(facts.request, metadata)
            else:
                features = self._features.completion(facts.request, metadata, route.adapter)
        # During a canary, the revision of the request's session (`router.canary`); an
        # operator's pin to one revision instead (`router.revision_pin`: admin keys only).
        pinned = revision_pin.requested(metadata)
        if pinned:
            canary: CanaryChoice | None = revision_pin.pin(route, pinned, metadata)
        else:
            canary = self._canary.choose(route, features)
        split: Collection[ReplicaKey] = () if canary is None else canary.exclude
        if outside is None:
            return Routed(facts, route, features, split, self._fallbacks, canary)
        subset = tuple(outside(route)) if canary is None else canary.exclude.union(outside(route))
        return Routed(facts, route, features, subset, canary=canary)

    async def admit(self, routed: Routed) -> Decision:
        """A slot on the replica the policy chooses (queued while all are at their cap), then
        the fallbacks after it. Cancelling the call while it is queued gives back a slot
        granted meanwhile.

        Raises:
            ResourceExhaustedError: the queue is full, the key holds its share of it, or the
                wait ran out (429 model_overloaded, Retry-After; 429 kv_cache_full when its
                predicted KV fitted no replica: `kvfit`).
            InvalidArgumentError: its predicted KV exceeds every replica's whole KV cache (400
                context_length_exceeded).
            UnavailableError: no replica can take it (503 no_ready_replica), or a deployment
                at zero still had none when its cold-start budget ran out (503
                deployment_cold_start, Retry-After).
        """
        tokens = self.prompt_tokens
        if tokens is not None and tokens.wants(routed.route):
            features = await tokens.annotate(routed.route, routed.facts.request, routed.features)
            routed = dataclasses.replace(routed, features=features)
        kv = self._admission.kv_fit  # the request's predicted KV size (`kvfit`), if on
        demand = (
            None if kv is None else kv.demand(routed.facts.request, routed.features, routed.route)
        )
        slot = await self._admission.acquire(
            routed.route, routed.features, exclude=routed.exclude, demand=demand
        )
        try:
            canary, n = routed.canary, routed.fallbacks
            if canary is None or n <= 0:
                fallbacks = self._admission.fallbacks(routed.route, slot, routed.features, n)
            else:  # never a dark revision's endpoint; the chosen revision's first
                more = self._admission.fallbacks(
                    routed.route, slot, routed.features, n + len(canary.dark)
                )
                fallbacks = order_fallbacks(more, canary, n)
        except BaseException:
            slot.release()
            raise
        return Decision(routed.route, slot, (slot.endpoint, *fallbacks))

    def served_name(self, model: str) -> str:
        """The name `model` is served under in the current table, or
        `inferplane.wire.headers.UNKNOWN_MODEL` when no route serves it (a label with
        bounded cardinality: a client's made-up name stays data)."""
        route = self._table().get(model)
        return route.model if route is not None else headers.UNKNOWN_MODEL

    def _resolve(self, model: str, metadata: Mapping[str, str]) -> ModelRoute:
        table = self._table()
        route = resolve(table, model, metadata)
        self._admission.apply(table)  # no-op unless the table changed under us
        return route

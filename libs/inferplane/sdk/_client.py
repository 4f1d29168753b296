"""`Client`: the blocking SDK (admin APIs and inference over gRPC)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Sequence
from datetime import datetime
from types import TracebackType

from inferplane.api.auth.v1 import auth_pb2, usage_pb2
from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.runtime.security.identity import PeerSecurity, operator_security
from inferplane.sdk import _methods as m
from inferplane.sdk._pages import Page, Paged
from inferplane.sdk._requests import (
    ChatRequest,
    EmbeddingRequest,
    KeyWithSecret,
    adapter_name,
    chat_request,
    create_deployment_request,
    deployment_name,
    embedding_request,
    key_name,
    list_compatibility_request,
    mask,
    node_name,
    usage_query,
)
from inferplane.sdk._transport import Endpoints, RetryPolicy, SyncTransport

auth = auth_pb2
orch = orchestrator_pb2
inf = inference_pb2


class Keys:
    """API keys (auth's `ApiKeyService`; the client needs `auth` and `admin_key`)."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(self, api_key: auth.ApiKey, *, timeout: float | None = None) -> KeyWithSecret:
        """Creates a key; the result holds its secret, shown this once. Never retried."""
        response = self._t.unary(
            m.CREATE_API_KEY, auth.CreateApiKeyRequest(api_key=api_key), timeout=timeout
        )
        return KeyWithSecret(response.api_key, response.secret)

    def get(self, name: str, *, timeout: float | None = None) -> auth.ApiKey:
        """A key's metadata (never its secret); `name` is a key id or `api-keys/{id}`."""
        request = auth.GetApiKeyRequest(name=key_name(name))
        return self._t.unary(m.GET_API_KEY, request, timeout=timeout).api_key

    def list(
        self,
        *,
        tenant: str = "",
        show_inactive: bool = False,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Paged[auth.ApiKey]:
        """Keys, newest first, lazily page by page (`page_size` 0: the server's 50; at most
        1000); only `tenant`'s when set; revoked and expired ones with `show_inactive`.
        `timeout` is per page."""

        def fetch(token: str) -> Page[auth.ApiKey]:
            request = auth.ListApiKeysRequest(
                page_size=page_size, page_token=token, tenant=tenant, show_inactive=show_inactive
            )
            response = self._t.unary(m.LIST_API_KEYS, request, timeout=timeout)
            return Page(tuple(response.api_keys), response.next_page_token)

        return Paged(fetch, page_token)

    def update(
        self,
        api_key: auth.ApiKey,
        update_mask: Iterable[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> auth.ApiKey:
        """Sets the fields named in `update_mask` (None: the fields set in `api_key`) of the
        key `api_key.name` (an id or `api-keys/{id}`); returns the key."""
        key = auth.ApiKey()
        key.CopyFrom(api_key)
        key.name = key_name(api_key.name)
        request = auth.UpdateApiKeyRequest(api_key=key, update_mask=mask(update_mask))
        return self._t.unary(m.UPDATE_API_KEY, request, timeout=timeout).api_key

    def rotate(
        self, name: str, *, grace_period_seconds: int = 0, timeout: float | None = None
    ) -> KeyWithSecret:
        """Issues a new secret (shown this once); the previous one keeps working for
        `grace_period_seconds` (0: stops at once; at most 30 days). Never retried."""
        request = auth.RotateApiKeyRequest(
            name=key_name(name), grace_period_seconds=grace_period_seconds
        )
        response = self._t.unary(m.ROTATE_API_KEY, request, timeout=timeout)
        return KeyWithSecret(response.api_key, response.secret)

    def revoke(self, name: str, *, timeout: float | None = None) -> auth.ApiKey:
        """Revokes a key: it stops working at once and stays listed (`show_inactive`)."""
        request = auth.RevokeApiKeyRequest(name=key_name(name))
        return self._t.unary(m.REVOKE_API_KEY, request, timeout=timeout).api_key

    def delete(self, name: str, *, timeout: float | None = None) -> None:
        """Deletes a key and its record. Never retried."""
        self._t.unary(
            m.DELETE_API_KEY, auth.DeleteApiKeyRequest(name=key_name(name)), timeout=timeout
        )


class Deployments:
    """The model catalogue (the orchestrator's `DeploymentService`; needs `orchestrator`).
    `name` arguments take a deployment id, an alias or `deployments/{id}`."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(
        self,
        deployment_id: str,
        deployment: orch.Deployment,
        *,
        validate_only: bool = False,
        force: bool = False,
        force_reason: str = "",
        timeout: float | None = None,
    ) -> orch.Deployment:
        """Creates a deployment (`deployment_id` is the `model` clients send) and returns it
        with its placement status; with `validate_only`, checks and previews it and creates
        nothing (then, and only then, UNAVAILABLE is retried). `force` with a `force_reason`
        overrides a failed verdict of the compatibility matrix (audited: `list_forced_changes`);
        without it such a create is INVALID_ARGUMENT naming the profile field."""
        request = create_deployment_request(
            deployment_id, deployment, validate_only, force, force_reason
        )
        method = m.PREVIEW_DEPLOYMENT if validate_only else m.CREATE_DEPLOYMENT
        return (self._t.unary(method, request, timeout=timeout)).deployment

    def get(self, name: str, *, timeout: float | None = None) -> orch.Deployment:
        request = orch.GetDeploymentRequest(name=deployment_name(name))
        return self._t.unary(m.GET_DEPLOYMENT, request, timeout=timeout).deployment

    def list(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Paged[orch.Deployment]:
        """Deployments, lazily page by page; `timeout` is per page."""

        def fetch(token: str) -> Page[orch.Deployment]:
            request = orch.ListDeploymentsRequest(page_size=page_size, page_token=token)
            response = self._t.unary(m.LIST_DEPLOYMENTS, request, timeout=timeout)
            return Page(tuple(response.deployments), response.next_page_token)

        return Paged(fetch, page_token)

    def update(
        self,
        deployment: orch.Deployment,
        update_mask: Iterable[str] | None = None,
        *,
        force: bool = False,
        force_reason: str = "",
        timeout: float | None = None,
    ) -> orch.Deployment:
        """Sets the fields named in `update_mask` (`profile.precision`-style paths; None:
        every updatable field) of `deployment.name`; a profile change starts a rollout
        (`force`/`force_reason`: as in `create`, for the new revision's combination)."""
        value = orch.Deployment()
        value.CopyFrom(deployment)
        value.name = deployment_name(deployment.name)
        request = orch.UpdateDeploymentRequest(
            deployment=value, update_mask=mask(update_mask), force=force, force_reason=force_reason
        )
        return self._t.unary(m.UPDATE_DEPLOYMENT, request, timeout=timeout).deployment

    def delete(self, name: str, *, timeout: float | None = None) -> None:
        """Deletes a deployment and stops its replicas. Never retried."""
        request = orch.DeleteDeploymentRequest(name=deployment_name(name))
        self._t.unary(m.DELETE_DEPLOYMENT, request, timeout=timeout)

    def replicas(
        self, name: str, *, page_size: int = 0, timeout: float | None = None
    ) -> Paged[orch.Placement]:
        """The deployment's replicas and where they are placed (`Placement.replica` is the
        node-agent's report, with the `inference_address` an inference client can use)."""
        parent = deployment_name(name)

        def fetch(token: str) -> Page[orch.Placement]:
            request = orch.ListDeploymentReplicasRequest(
                parent=parent, page_size=page_size, page_token=token
            )
            response = self._t.unary(m.LIST_DEPLOYMENT_REPLICAS, request, timeout=timeout)
            return Page(tuple(response.placements), response.next_page_token)

        return Paged(fetch)

    def explain(self, name: str, *, timeout: float | None = None) -> Sequence[str]:
        """One line per replica: where it sits and why, or exactly why it cannot be placed."""
        request = orch.ExplainPlacementRequest(name=deployment_name(name))
        return tuple(self._t.unary(m.EXPLAIN_PLACEMENT, request, timeout=timeout).lines)

    def autoscaler_decisions(
        self, name: str = "", *, page_size: int = 0, timeout: float | None = None
    ) -> Sequence[orch.AutoscalerDecision]:
        """The autoscaler's recent decisions (replicas before and after, the reason, the
        signals read), newest first: of deployment `name`, or of every deployment when
        empty; at most `page_size` (0: the orchestrator's default, 50)."""
        request = orch.ListAutoscalerDecisionsRequest(
            deployment=deployment_name(name) if name else "", page_size=page_size
        )
        response = self._t.unary(m.LIST_AUTOSCALER_DECISIONS, request, timeout=timeout)
        return tuple(response.decisions)

    def list_compatibility(
        self,
        *,
        deployment: str = "",
        engine_version: str = "",
        model_digest: str = "",
        verdict: str = "",
        page_size: int = 0,
        timeout: float | None = None,
    ) -> Paged[orch.CompatibilityEntry]:
        """Each combination's current verdict in the compatibility matrix (engine and version,
        weights and chat template digests, parsers: `CompatibilityEntry`), newest first,
        lazily page by page; every filter optional (`deployment`: id or name; `verdict`:
        "qualified", "failed" or "unqualified")."""
        request = list_compatibility_request(
            deployment=deployment,
            engine_version=engine_version,
            model_digest=model_digest,
            verdict=verdict,
            page_size=page_size,
        )

        def fetch(token: str) -> Page[orch.CompatibilityEntry]:
            page = orch.ListCompatibilityRequest(page_token=token)
            page.MergeFrom(request)
            response = self._t.unary(m.LIST_COMPATIBILITY, page, timeout=timeout)
            return Page(tuple(response.entries), response.next_page_token)

        return Paged(fetch)

    def list_forced_changes(
        self, name: str = "", *, page_size: int = 0, timeout: float | None = None
    ) -> Sequence[orch.ForcedChange]:
        """Creates and updates that overrode a failed verdict (who, why, what), newest first:
        of deployment `name` or of all; at most `page_size` (0: the orchestrator's 50)."""
        request = orch.ListForcedChangesRequest(
            deployment=name.removeprefix("deployments/"), page_size=page_size
        )
        response = self._t.unary(m.LIST_FORCED_CHANGES, request, timeout=timeout)
        return tuple(response.changes)

    def create_adapter(
        self, adapter_id: str, adapter: orch.LoraAdapter, *, timeout: float | None = None
    ) -> orch.LoraAdapter:
        """Adds a LoRA adapter on top of `adapter.base_deployment` (issue 29): clients then
        send `{base}:{adapter_id}` or one of its aliases as the model. Never retried."""
        value = orch.LoraAdapter()
        value.CopyFrom(adapter)
        if value.base_deployment:
            value.base_deployment = deployment_name(value.base_deployment)
        request = orch.CreateAdapterRequest(adapter_id=adapter_id, adapter=value)
        return self._t.unary(m.CREATE_ADAPTER, request, timeout=timeout).adapter

    def get_adapter(self, name: str, *, timeout: float | None = None) -> orch.LoraAdapter:
        """The adapter `name` (an adapter id or `adapters/{id}`)."""
        request = orch.GetAdapterRequest(name=adapter_name(name))
        return self._t.unary(m.GET_ADAPTER, request, timeout=timeout).adapter

    def list_adapters(
        self, base: str = "", *, timeout: float | None = None
    ) -> Sequence[orch.LoraAdapter]:
        """Adapters by id: of deployment `base` (id, alias or name), or all when empty."""
        request = orch.ListAdaptersRequest(base_deployment=deployment_name(base) if base else "")
        return tuple(self._t.unary(m.LIST_ADAPTERS, request, timeout=timeout).adapters)

    def delete_adapter(self, name: str, *, timeout: float | None = None) -> orch.LoraAdapter | None:
        """Deletes an adapter: it leaves the routing table at once; returns it in phase
        Deleting while requests may still use it (gone after the base's drain grace), None
        when it is gone already. Never retried."""
        request = orch.DeleteAdapterRequest(name=adapter_name(name))
        response = self._t.unary(m.DELETE_ADAPTER, request, timeout=timeout)
        return response.adapter if response.HasField("adapter") else None


class Nodes:
    """The fleet (the orchestrator's `NodeService`; needs `orchestrator`). `name` arguments
    take a node name or `nodes/{node}`."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def list(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Paged[orch.Node]:
        """Nodes, lazily page by page; `timeout` is per page."""

        def fetch(token: str) -> Page[orch.Node]:
            request = orch.ListNodesRequest(page_size=page_size, page_token=token)
            response = self._t.unary(m.LIST_NODES, request, timeout=timeout)
            return Page(tuple(response.nodes), response.next_page_token)

        return Paged(fetch, page_token)

    def get(self, name: str, *, timeout: float | None = None) -> orch.Node:
        request = orch.GetNodeRequest(name=node_name(name))
        return self._t.unary(m.GET_NODE, request, timeout=timeout).node

    def drain(self, name: str, *, timeout: float | None = None) -> orch.Node:
        """Moves the node's replicas elsewhere without failing requests and marks it
        unschedulable (condition Draining while it keeps heartbeating)."""
        request = orch.DrainNodeRequest(name=node_name(name))
        return self._t.unary(m.DRAIN_NODE, request, timeout=timeout).node

    def uncordon(self, name: str, *, timeout: float | None = None) -> orch.Node:
        """Makes a drained node schedulable again."""
        request = orch.UncordonNodeRequest(name=node_name(name))
        return self._t.unary(m.UNCORDON_NODE, request, timeout=timeout).node


class Inference:
    """OpenAI's chat completions and embeddings over gRPC (`InferenceService`; needs
    `inference`: a replica process's address, e.g. a `Placement`'s
    `replica.inference_address`; the router serves only the model list to operators).
    Requests are the proto or OpenAI's JSON body as a dict; responses are the protos."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def chat(
        self, request: ChatRequest, *, timeout: float | None = None
    ) -> inf.CreateChatCompletionResponse:
        """A chat completion (OpenAI's ChatCompletion). UNAVAILABLE, which a replica answers
        only before generating anything, is retried."""
        wrapped = inf.CreateChatCompletionRequest(request=chat_request(request))
        return self._t.unary(m.CREATE_CHAT_COMPLETION, wrapped, timeout=timeout)

    def stream_chat(
        self, request: ChatRequest, *, timeout: float | None = None
    ) -> Generator[inf.StreamChatCompletionResponse, None, None]:
        """A streamed chat completion: returns once the first chunk arrived (UNAVAILABLE is
        retried until then), then yields OpenAI's ChatCompletionChunks. `timeout` covers the
        whole stream; closing the iterator early cancels the generation."""
        wrapped = inf.StreamChatCompletionRequest(request=chat_request(request))
        return self._t.stream(m.STREAM_CHAT_COMPLETION, wrapped, timeout=timeout)

    def embed(
        self, request: EmbeddingRequest, *, timeout: float | None = None
    ) -> inf.CreateEmbeddingResponse:
        """Embeddings from a deployment whose task is `embed`."""
        wrapped = inf.CreateEmbeddingRequest(request=embedding_request(request))
        return self._t.unary(m.CREATE_EMBEDDING, wrapped, timeout=timeout)

    def models(self, *, timeout: float | None = None) -> Sequence[inf.Model]:
        """The models this address serves."""
        return tuple(self._t.unary(m.LIST_MODELS, inf.ListModelsRequest(), timeout=timeout).data)


class Usage:
    """The usage ledger (auth's `UsageLedgerService`; the client needs `auth` and
    `admin_key`): one row per finished request, or totals per hour, day, model, key or tenant.
    Filters: requests that ended in [`start`, `end`) (timezone-aware; None: unbounded), and
    exact `key` (id or `api-keys/{id}`), `tenant`, `model`, `api` when set. `timeout` is per
    page."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def rows(
        self,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        key: str = "",
        tenant: str = "",
        model: str = "",
        api: str = "",
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Paged[usage_pb2.UsageRow]:
        """Requests oldest first, lazily page by page (`page_size` 0: the server's 100)."""

        def fetch(token: str) -> Page[usage_pb2.UsageRow]:
            request = usage_query(
                start=start, end=end, key=key, tenant=tenant, model=model, api=api, group_by="",
                page_size=page_size, page_token=token,
            )  # fmt: skip
            response = self._t.unary(m.QUERY_USAGE, request, timeout=timeout)
            return Page(tuple(response.rows), response.next_page_token)

        return Paged(fetch, page_token)

    def groups(
        self,
        by: str,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        key: str = "",
        tenant: str = "",
        model: str = "",
        api: str = "",
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Paged[usage_pb2.UsageGroup]:
        """Totals per group (`by`: "hour", "day", "model", "key", "tenant" or "api"), in group
        order.

        Raises:
            InvalidArgumentError: another `by` (from the server).
        """

        def fetch(token: str) -> Page[usage_pb2.UsageGroup]:
            request = usage_query(
                start=start, end=end, key=key, tenant=tenant, model=model, api=api, group_by=by,
                page_size=page_size, page_token=token,
            )  # fmt: skip
            response = self._t.unary(m.QUERY_USAGE, request, timeout=timeout)
            return Page(tuple(response.groups), response.next_page_token)

        return Paged(fetch, page_token)


class Client:
    """The blocking SDK: `keys`, `deployments`, `nodes`, `usage` and `inference` sub-clients.

    Args:
        auth, orchestrator, inference: `host:port` of each service; a sub-client whose
            address is missing raises ConfigError on its first call. Channels open on first
            use.
        security: the identity presented (mutual TLS); default `operator_security()` (the
            `admin` certificate from `$INFERPLANE_TLS_DIR` or the local stack).
        admin_key: an API key with the admin scope, sent to auth only (`ApiKeyService` asks
            an operator's identity for one).
        timeout: the default deadline of each call in seconds, retries included; every
            method takes its own `timeout=`.
        retry: how UNAVAILABLE is retried, for the methods that may be repeated.
        sleep: how the client waits between attempts (a test passes its own).

    Raises:
        ConfigError: no `security` and no operator identity found.

    Every failed call raises an `inferplane.runtime.InferplaneError` subclass: `grpc_code`,
    `http_status`, OpenAI's `openai_type` / `code` / `param`, `message`. Use it as a context
    manager, or call `close()`.
    """

    def __init__(
        self,
        *,
        auth: str | None = None,
        orchestrator: str | None = None,
        inference: str | None = None,
        security: PeerSecurity | None = None,
        admin_key: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        endpoints = Endpoints(
            {
                m.Target.AUTH: auth,
                m.Target.ORCHESTRATOR: orchestrator,
                m.Target.INFERENCE: inference,
            },
            security if security is not None else operator_security(),
            admin_key,
        )
        self._transport = SyncTransport(
            endpoints, timeout=timeout, retry=retry or RetryPolicy(), sleep=sleep
        )
        self.keys = Keys(self._transport)
        self.deployments = Deployments(self._transport)
        self.nodes = Nodes(self._transport)
        self.usage = Usage(self._transport)
        self.inference = Inference(self._transport)

    def close(self) -> None:
        """Closes the channels; later calls raise ConfigError."""
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

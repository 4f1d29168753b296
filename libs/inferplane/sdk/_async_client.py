"""`AsyncClient`: the asyncio SDK (grpc.aio), method for method the same as `Client`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from types import TracebackType

from inferplane.api.auth.v1 import auth_pb2, usage_pb2
from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.runtime.security.identity import PeerSecurity, operator_security
from inferplane.sdk import _methods as m
from inferplane.sdk._pages import AsyncPaged, Page
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
from inferplane.sdk._transport import AsyncTransport, Endpoints, RetryPolicy

auth = auth_pb2
orch = orchestrator_pb2
inf = inference_pb2


class AsyncKeys:
    """`Keys` for asyncio."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(self, api_key: auth.ApiKey, *, timeout: float | None = None) -> KeyWithSecret:
        response = await self._t.unary(
            m.CREATE_API_KEY, auth.CreateApiKeyRequest(api_key=api_key), timeout=timeout
        )
        return KeyWithSecret(response.api_key, response.secret)

    async def get(self, name: str, *, timeout: float | None = None) -> auth.ApiKey:
        request = auth.GetApiKeyRequest(name=key_name(name))
        return (await self._t.unary(m.GET_API_KEY, request, timeout=timeout)).api_key

    def list(
        self,
        *,
        tenant: str = "",
        show_inactive: bool = False,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> AsyncPaged[auth.ApiKey]:
        async def fetch(token: str) -> Page[auth.ApiKey]:
            request = auth.ListApiKeysRequest(
                page_size=page_size, page_token=token, tenant=tenant, show_inactive=show_inactive
            )
            response = await self._t.unary(m.LIST_API_KEYS, request, timeout=timeout)
            return Page(tuple(response.api_keys), response.next_page_token)

        return AsyncPaged(fetch, page_token)

    async def update(
        self,
        api_key: auth.ApiKey,
        update_mask: Iterable[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> auth.ApiKey:
        key = auth.ApiKey()
        key.CopyFrom(api_key)
        key.name = key_name(api_key.name)
        request = auth.UpdateApiKeyRequest(api_key=key, update_mask=mask(update_mask))
        return (await self._t.unary(m.UPDATE_API_KEY, request, timeout=timeout)).api_key

    async def rotate(
        self, name: str, *, grace_period_seconds: int = 0, timeout: float | None = None
    ) -> KeyWithSecret:
        request = auth.RotateApiKeyRequest(
            name=key_name(name), grace_period_seconds=grace_period_seconds
        )
        response = await self._t.unary(m.ROTATE_API_KEY, request, timeout=timeout)
        return KeyWithSecret(response.api_key, response.secret)

    async def revoke(self, name: str, *, timeout: float | None = None) -> auth.ApiKey:
        request = auth.RevokeApiKeyRequest(name=key_name(name))
        return (await self._t.unary(m.REVOKE_API_KEY, request, timeout=timeout)).api_key

    async def delete(self, name: str, *, timeout: float | None = None) -> None:
        request = auth.DeleteApiKeyRequest(name=key_name(name))
        await self._t.unary(m.DELETE_API_KEY, request, timeout=timeout)


class AsyncDeployments:
    """`Deployments` for asyncio."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(
        self,
        deployment_id: str,
        deployment: orch.Deployment,
        *,
        validate_only: bool = False,
        force: bool = False,
        force_reason: str = "",
        timeout: float | None = None,
    ) -> orch.Deployment:
        request = create_deployment_request(
            deployment_id, deployment, validate_only, force, force_reason
        )
        method = m.PREVIEW_DEPLOYMENT if validate_only else m.CREATE_DEPLOYMENT
        return (await self._t.unary(method, request, timeout=timeout)).deployment

    async def get(self, name: str, *, timeout: float | None = None) -> orch.Deployment:
        request = orch.GetDeploymentRequest(name=deployment_name(name))
        return (await self._t.unary(m.GET_DEPLOYMENT, request, timeout=timeout)).deployment

    def list(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> AsyncPaged[orch.Deployment]:
        async def fetch(token: str) -> Page[orch.Deployment]:
            request = orch.ListDeploymentsRequest(page_size=page_size, page_token=token)
            response = await self._t.unary(m.LIST_DEPLOYMENTS, request, timeout=timeout)
            return Page(tuple(response.deployments), response.next_page_token)

        return AsyncPaged(fetch, page_token)

    async def update(
        self,
        deployment: orch.Deployment,
        update_mask: Iterable[str] | None = None,
        *,
        force: bool = False,
        force_reason: str = "",
        timeout: float | None = None,
    ) -> orch.Deployment:
        value = orch.Deployment()
        value.CopyFrom(deployment)
        value.name = deployment_name(deployment.name)
        request = orch.UpdateDeploymentRequest(
            deployment=value, update_mask=mask(update_mask), force=force, force_reason=force_reason
        )
        return (await self._t.unary(m.UPDATE_DEPLOYMENT, request, timeout=timeout)).deployment

    async def delete(self, name: str, *, timeout: float | None = None) -> None:
        request = orch.DeleteDeploymentRequest(name=deployment_name(name))
        await self._t.unary(m.DELETE_DEPLOYMENT, request, timeout=timeout)

    def replicas(
        self, name: str, *, page_size: int = 0, timeout: float | None = None
    ) -> AsyncPaged[orch.Placement]:
        parent = deployment_name(name)

        async def fetch(token: str) -> Page[orch.Placement]:
            request = orch.ListDeploymentReplicasRequest(
                parent=parent, page_size=page_size, page_token=token
            )
            response = await self._t.unary(m.LIST_DEPLOYMENT_REPLICAS, request, timeout=timeout)
            return Page(tuple(response.placements), response.next_page_token)

        return AsyncPaged(fetch)

    async def explain(self, name: str, *, timeout: float | None = None) -> Sequence[str]:
        request = orch.ExplainPlacementRequest(name=deployment_name(name))
        return tuple((await self._t.unary(m.EXPLAIN_PLACEMENT, request, timeout=timeout)).lines)

    async def autoscaler_decisions(
        self, name: str = "", *, page_size: int = 0, timeout: float | None = None
    ) -> Sequence[orch.AutoscalerDecision]:
        request = orch.ListAutoscalerDecisionsRequest(
            deployment=deployment_name(name) if name else "", page_size=page_size
        )
        response = await self._t.unary(m.LIST_AUTOSCALER_DECISIONS, request, timeout=timeout)
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
    ) -> AsyncPaged[orch.CompatibilityEntry]:
        request = list_compatibility_request(
            deployment=deployment,
            engine_version=engine_version,
            model_digest=model_digest,
            verdict=verdict,
            page_size=page_size,
        )

        async def fetch(token: str) -> Page[orch.CompatibilityEntry]:
            page = orch.ListCompatibilityRequest(page_token=token)
            page.MergeFrom(request)
            response = await self._t.unary(m.LIST_COMPATIBILITY, page, timeout=timeout)
            return Page(tuple(response.entries), response.next_page_token)

        return AsyncPaged(fetch)

    async def list_forced_changes(
        self, name: str = "", *, page_size: int = 0, timeout: float | None = None
    ) -> Sequence[orch.ForcedChange]:
        request = orch.ListForcedChangesRequest(
            deployment=name.removeprefix("deployments/"), page_size=page_size
        )
        response = await self._t.unary(m.LIST_FORCED_CHANGES, request, timeout=timeout)
        return tuple(response.changes)

    async def create_adapter(
        self, adapter_id: str, adapter: orch.LoraAdapter, *, timeout: float | None = None
    ) -> orch.LoraAdapter:
        value = orch.LoraAdapter()
        value.CopyFrom(adapter)
        if value.base_deployment:
            value.base_deployment = deployment_name(value.base_deployment)
        request = orch.CreateAdapterRequest(adapter_id=adapter_id, adapter=value)
        return (await self._t.unary(m.CREATE_ADAPTER, request, timeout=timeout)).adapter

    async def get_adapter(self, name: str, *, timeout: float | None = None) -> orch.LoraAdapter:
        request = orch.GetAdapterRequest(name=adapter_name(name))
        return (await self._t.unary(m.GET_ADAPTER, request, timeout=timeout)).adapter

    async def list_adapters(
        self, base: str = "", *, timeout: float | None = None
    ) -> Sequence[orch.LoraAdapter]:
        request = orch.ListAdaptersRequest(base_deployment=deployment_name(base) if base else "")
        return tuple((await self._t.unary(m.LIST_ADAPTERS, request, timeout=timeout)).adapters)

    async def delete_adapter(
        self, name: str, *, timeout: float | None = None
    ) -> orch.LoraAdapter | None:
        request = orch.DeleteAdapterRequest(name=adapter_name(name))
        response = await self._t.unary(m.DELETE_ADAPTER, request, timeout=timeout)
        return response.adapter if response.HasField("adapter") else None


class AsyncNodes:
    """`Nodes` for asyncio."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    def list(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> AsyncPaged[orch.Node]:
        async def fetch(token: str) -> Page[orch.Node]:
            request = orch.ListNodesRequest(page_size=page_size, page_token=token)
            response = await self._t.unary(m.LIST_NODES, request, timeout=timeout)
            return Page(tuple(response.nodes), response.next_page_token)

        return AsyncPaged(fetch, page_token)

    async def get(self, name: str, *, timeout: float | None = None) -> orch.Node:
        request = orch.GetNodeRequest(name=node_name(name))
        return (await self._t.unary(m.GET_NODE, request, timeout=timeout)).node

    async def drain(self, name: str, *, timeout: float | None = None) -> orch.Node:
        request = orch.DrainNodeRequest(name=node_name(name))
        return (await self._t.unary(m.DRAIN_NODE, request, timeout=timeout)).node

    async def uncordon(self, name: str, *, timeout: float | None = None) -> orch.Node:
        request = orch.UncordonNodeRequest(name=node_name(name))
        return (await self._t.unary(m.UNCORDON_NODE, request, timeout=timeout)).node


class AsyncInference:
    """`Inference` for asyncio."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def chat(
        self, request: ChatRequest, *, timeout: float | None = None
    ) -> inf.CreateChatCompletionResponse:
        wrapped = inf.CreateChatCompletionRequest(request=chat_request(request))
        return await self._t.unary(m.CREATE_CHAT_COMPLETION, wrapped, timeout=timeout)

    async def stream_chat(
        self, request: ChatRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[inf.StreamChatCompletionResponse, None]:
        """Returns once the first chunk arrived; `async for` the chunks. Closing the
        iterator (`aclose()`) early cancels the generation."""
        wrapped = inf.StreamChatCompletionRequest(request=chat_request(request))
        return await self._t.stream(m.STREAM_CHAT_COMPLETION, wrapped, timeout=timeout)

    async def embed(
        self, request: EmbeddingRequest, *, timeout: float | None = None
    ) -> inf.CreateEmbeddingResponse:
        wrapped = inf.CreateEmbeddingRequest(request=embedding_request(request))
        return await self._t.unary(m.CREATE_EMBEDDING, wrapped, timeout=timeout)

    async def models(self, *, timeout: float | None = None) -> Sequence[inf.Model]:
        response = await self._t.unary(m.LIST_MODELS, inf.ListModelsRequest(), timeout=timeout)
        return tuple(response.data)


class AsyncUsage:
    """`Usage`, awaitable: the same methods, pages as `AsyncPaged`."""

    def __init__(self, transport: AsyncTransport) -> None:
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
    ) -> AsyncPaged[usage_pb2.UsageRow]:
        async def fetch(token: str) -> Page[usage_pb2.UsageRow]:
            request = usage_query(
                start=start, end=end, key=key, tenant=tenant, model=model, api=api, group_by="",
                page_size=page_size, page_token=token,
            )  # fmt: skip
            response = await self._t.unary(m.QUERY_USAGE, request, timeout=timeout)
            return Page(tuple(response.rows), response.next_page_token)

        return AsyncPaged(fetch, page_token)

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
    ) -> AsyncPaged[usage_pb2.UsageGroup]:
        async def fetch(token: str) -> Page[usage_pb2.UsageGroup]:
            request = usage_query(
                start=start, end=end, key=key, tenant=tenant, model=model, api=api, group_by=by,
                page_size=page_size, page_token=token,
            )  # fmt: skip
            response = await self._t.unary(m.QUERY_USAGE, request, timeout=timeout)
            return Page(tuple(response.groups), response.next_page_token)

        return AsyncPaged(fetch, page_token)


class AsyncClient:
    """`Client` for asyncio (grpc.aio): the same arguments (`sleep` is a coroutine function)
    and sub-clients, every call awaited; lists are `async for` iterables. Use it as an async
    context manager, or `await close()`; create and use it on one event loop."""

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
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
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
        self._transport = AsyncTransport(
            endpoints, timeout=timeout, retry=retry or RetryPolicy(), sleep=sleep
        )
        self.keys = AsyncKeys(self._transport)
        self.deployments = AsyncDeployments(self._transport)
        self.nodes = AsyncNodes(self._transport)
        self.usage = AsyncUsage(self._transport)
        self.inference = AsyncInference(self._transport)

    async def close(self) -> None:
        """Closes the channels; later calls raise ConfigError."""
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

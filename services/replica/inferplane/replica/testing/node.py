"""`FakeNode`: several fake replicas' InferenceServices behind one address, for tests that
serve more than one model from one port (a chat and an embedding model for the SDK's and the
gateway path's tests).

In production each replica process serves its one replica on its own port, and the endpoint
picker and the node's Envoy choose the process by address; this fake chooses by the request's
model instead, so a test needs one address only. Each replica gets its own
`inferplane.replica.server.InferenceServicer`, exactly as its process would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from google.api import httpbody_pb2

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.replica.engines.base import LocalReplica
from inferplane.replica.pipeline.assets import ModelAssetsCache
from inferplane.replica.server import InferenceServicer
from inferplane.replica_contract import Task, replica_task
from inferplane.runtime import NotFoundError

Context = Any  # grpc.aio.ServicerContext


class FakeNode(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """Serves each of `replicas` with its own InferenceServicer (`options` go to each), and
    sends every request to the one serving the request's model (its served_model_name or
    deployment; the first listed wins a name two replicas share). Speech requests (their
    model is inside the multipart form) go to the first `transcribe` replica.

    Raises (as the RPC's error):
        NotFoundError: no replica serves the request's model (code model_not_found, param
            `model`), as the router answers a model it does not know.
    """

    def __init__(
        self, replicas: Sequence[LocalReplica], assets: ModelAssetsCache, **options: Any
    ) -> None:
        self.servers: dict[str, InferenceServicer] = {}
        self._all: list[InferenceServicer] = []
        self._speech: InferenceServicer | None = None
        for replica in replicas:
            server = InferenceServicer(replica, assets, **options)
            self._all.append(server)
            for name in (replica.spec.served_model_name, replica.spec.deployment):
                if name:
                    self.servers.setdefault(name, server)
            if self._speech is None and replica_task(replica.spec) == Task.TRANSCRIBE:
                self._speech = server

    def _server(self, model: str) -> InferenceServicer:
        server = self.servers.get(model)
        if server is None:
            raise NotFoundError(
                f"The model '{model}' does not exist or you do not have access to it.",
                reason="MODEL_NOT_FOUND",
                code="model_not_found",
                param="model",
            )
        return server

    def _speech_server(self) -> InferenceServicer:
        if self._speech is None:
            raise NotFoundError(
                "no speech-to-text model is served here", code="model_not_found", param="model"
            )
        return self._speech

    async def CreateChatCompletion(
        self, request: pb.CreateChatCompletionRequest, context: Context
    ) -> pb.CreateChatCompletionResponse:
        return await self._server(request.request.model).CreateChatCompletion(request, context)

    async def StreamChatCompletion(
        self, request: pb.StreamChatCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamChatCompletionResponse]:
        server = self._server(request.request.model)
        async for message in server.StreamChatCompletion(request, context):
            yield message

    async def StreamChatCompletionEvents(
        self, request: pb.StreamChatCompletionEventsRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        server = self._server(request.request.model)
        async for message in server.StreamChatCompletionEvents(request, context):
            yield message

    async def CreateCompletion(
        self, request: pb.CreateCompletionRequest, context: Context
    ) -> pb.CreateCompletionResponse:
        return await self._server(request.request.model).CreateCompletion(request, context)

    async def StreamCompletion(
        self, request: pb.StreamCompletionRequest, context: Context
    ) -> AsyncIterator[pb.StreamCompletionResponse]:
        server = self._server(request.request.model)
        async for message in server.StreamCompletion(request, context):
            yield message

    async def StreamCompletionEvents(
        self, request: pb.StreamCompletionEventsRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        server = self._server(request.request.model)
        async for message in server.StreamCompletionEvents(request, context):
            yield message

    async def CreateEmbedding(
        self, request: pb.CreateEmbeddingRequest, context: Context
    ) -> pb.CreateEmbeddingResponse:
        return await self._server(request.request.model).CreateEmbedding(request, context)

    async def CreateTranscription(
        self, request: pb.CreateTranscriptionRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        async for message in self._speech_server().CreateTranscription(request, context):
            yield message

    async def CreateTranslation(
        self, request: pb.CreateTranslationRequest, context: Context
    ) -> AsyncIterator[httpbody_pb2.HttpBody]:
        async for message in self._speech_server().CreateTranslation(request, context):
            yield message

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        """Every replica's entry, once per model id, in the replicas' order."""
        response = pb.ListModelsResponse(object="list")
        seen: set[str] = set()
        for server in self._all:
            for model in (await server.ListModels(request, context)).data:
                if model.id not in seen:
                    seen.add(model.id)
                    response.data.add().CopyFrom(model)
        return response

"""The router's `InferenceService`: the model list of the routing table (`GET /v1/models`).
Generation goes through the endpoint picker (test_picker.py), never through this service."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.router.routes import ModelRoute, RouteTable
from inferplane.router.servicer import ModelsService
from inferplane.runtime import ErrorInterceptor

from .fakes import endpoints


async def _call(table: RouteTable, method: str, request: object) -> object:
    server = grpc.aio.server(interceptors=[ErrorInterceptor("test")])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        ModelsService(lambda: table, wall_clock=lambda: 1_700_000_000.0), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            return await getattr(stub, method)(request)
    finally:
        await server.stop(0)


def test_models_are_the_routing_tables_with_created_and_context_length() -> None:
    """Every model and alias of the table is listed once, with the route's `created` (or the
    router's clock when it has none), `owned_by` and `max_model_len`."""
    table = RouteTable.of(
        [
            ModelRoute("kimi-tiny", endpoints(1), owned_by="inferplane", max_model_len=2048),
            ModelRoute("other", endpoints(1), created=1_600_000_000),
        ]
    )
    response = asyncio.run(_call(table, "ListModels", pb.ListModelsRequest()))
    assert isinstance(response, pb.ListModelsResponse)
    assert response.object == "list"
    got = {m.id: (m.created, m.owned_by, m.max_model_len) for m in response.data}
    assert got == {
        "kimi-tiny": (1_700_000_000, "inferplane", 2048),
        "other": (1_600_000_000, "inferplane", 0),
    }


def test_get_model_retrieves_one_model_or_says_it_does_not_exist() -> None:
    """`GET /v1/models/{model}` (the openai client's `models.retrieve`): the model as the list
    shows it, names with slashes included; an unknown one is NOT_FOUND model_not_found."""
    table = RouteTable.of(
        [
            ModelRoute("kimi-tiny", endpoints(1), created=1_700_000_000, max_model_len=2048),
            ModelRoute("moonshotai/Kimi-K2.5", endpoints(1), created=1_600_000_000),
        ]
    )
    model = asyncio.run(_call(table, "GetModel", pb.GetModelRequest(model="kimi-tiny")))
    assert (model.id, model.object, model.created, model.max_model_len) == (
        "kimi-tiny",
        "model",
        1_700_000_000,
        2048,
    )
    slashed = asyncio.run(
        _call(table, "GetModel", pb.GetModelRequest(model="moonshotai/Kimi-K2.5"))
    )
    assert slashed.id == "moonshotai/Kimi-K2.5"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_call(table, "GetModel", pb.GetModelRequest(model="nope")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    trailers = dict(info.value.trailing_metadata() or ())
    assert trailers["x-openai-error-code"] == "model_not_found"


def test_generation_is_not_served_by_the_router() -> None:
    """The router never relays tokens: a generation call made to it directly is UNIMPLEMENTED
    (Envoy sends generation to the replica the picker chose)."""
    request = pb.CreateChatCompletionRequest(request=pb.ChatCompletionRequest(model="kimi-tiny"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_call(RouteTable.of([]), "CreateChatCompletion", request))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED

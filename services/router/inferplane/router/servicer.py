"""The router's `InferenceService`: `ListModels` and `GetModel` only (`GET /v1/models`,
`GET /v1/models/{model}` at the edge).

Generation requests never reach the router on the data path: Envoy asks its endpoint picker
(`inferplane.router.picker`) where to send each one and streams from the replica itself. The
generation methods stay UNIMPLEMENTED here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.router.routes import RouteTable
from inferplane.runtime import NotFoundError

Context = Any  # grpc.aio.ServicerContext


class ModelsService(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """The models of the current routing table, as OpenAI's model list.

    `wall_clock` (Unix seconds) is the `created` of a route that carries none.
    """

    def __init__(
        self, table: Callable[[], RouteTable], wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._table = table
        self._wall_clock = wall_clock

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        now = int(self._wall_clock())
        response = pb.ListModelsResponse(object="list")
        for route in self._table().models():
            response.data.append(_model(route, now))
        return response

    async def GetModel(self, request: pb.GetModelRequest, context: Context) -> pb.Model:
        """The model named `request.model` as `ListModels` lists it.

        Raises:
            NotFoundError: no model by that name (HTTP 404, code model_not_found).
        """
        for route in self._table().models():
            if route.model == request.model:
                return _model(route, int(self._wall_clock()))
        raise NotFoundError(
            f"The model '{request.model}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )


def _model(route: Any, now: int) -> pb.Model:
    model = pb.Model(
        id=route.model, object="model", created=route.created or now, owned_by=route.owned_by
    )
    if route.max_model_len:
        model.max_model_len = route.max_model_len
    return model

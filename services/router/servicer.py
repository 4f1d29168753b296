"""The router's `InferenceService`: `ListModels` only (`GET /v1/models` at the edge).

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
            model = response.data.add(
                id=route.model,
                object="model",
                created=route.created or now,
                owned_by=route.owned_by,
            )
            if route.max_model_len:
                model.max_model_len = route.max_model_len
        return response

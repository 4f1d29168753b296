"""The endpoint picker on OpenAI's Responses API (CreateResponse): decided as the chat request
its new turn converts to (`inferplane.apis.responses.to_chat`), `prompt_cache_key` as the
session, the body's `stream` as the trace's, refusals in OpenAI's shape naming the path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.router.picker import codec
from inferplane.wire import apis

from .fakes import client_body
from .test_picker import GRPC_OK, KEYED, _endpoint_list, picker_rig

pytestmark = pytest.mark.timeout(30)

CREATE_RESPONSE = "/v1/responses"


def _body(model: str = "m", **extra: Any) -> bytes:
    request = json_format.ParseDict({"model": model, "input": "hi", **extra}, rpb.ResponseRequest())
    return client_body(rpb.CreateResponseRequest(request=request))


def test_the_method_is_the_responses_api() -> None:
    method, streamed = codec.ROUTES[CREATE_RESPONSE]
    assert streamed is method  # one RPC for both: the body's `stream` says
    assert method.api == apis.RESPONSES and method.chat and method.to_chat is not None


def test_one_prompt_cache_key_keeps_one_primary() -> None:
    async def scenario() -> None:
        async with picker_rig(4, policy="session_affinity") as rig:
            lists = []
            for stream_it in (False, True, False):
                stream = rig.stream()
                await stream.headers(CREATE_RESPONSE, KEYED)
                body = _body(
                    prompt_cache_key="codex-1", previous_response_id="resp_x", stream=stream_it
                )
                lists.append(_endpoint_list(await stream.body(body)))
                await stream.response_headers(GRPC_OK)
                await stream.response_trailers({"grpc-status": "0"})
                await stream.close()
            assert len({tuple(x) for x in lists}) == 1
            assert rig.in_flight() == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (_body("nope"), 404, "model"),
        (_body(tools=[{"type": "file_search"}]), 400, "tools[0].type"),
        (
            _body(
                input=[{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]
            ),
            400,
            "input[0].content[0].type",
        ),
    ],
)
def test_refusals_come_in_openais_shape(body: bytes, status: int, param: str) -> None:
    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = rig.stream()
            await stream.headers(CREATE_RESPONSE, KEYED)
            answer = await stream.body(body)
            assert answer.immediate_response.status.code == status
            error = json.loads(answer.immediate_response.body)["error"]
            assert error["param"] == param
            assert rig.in_flight() == 0

    asyncio.run(scenario())

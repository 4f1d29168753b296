"""The endpoint picker on Anthropic's Messages API (CreateMessage, CountMessageTokens): decided
as the chat request it converts to (`inferplane.apis.anthropic`), `metadata.user_id` as the
session, refusals in Anthropic's error shape (529 where OpenAI's shape says 503)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.router.picker import codec
from inferplane.runtime import UnavailableError
from inferplane.wire import apis

from .fakes import client_body
from .test_gateway_mode import GatewayStream, gateway_rig
from .test_picker import GRPC_OK, KEYED, _endpoint_list, picker_rig

pytestmark = pytest.mark.timeout(30)

CREATE_MESSAGE = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"


def _message_body(model: str = "m", **extra: object) -> bytes:
    body = {
        "model": model,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }
    request = json_format.ParseDict(body, apb.MessagesRequest())
    return client_body(apb.CreateMessageRequest(request=request))


def _anthropic_error(answer: object) -> dict[str, str]:
    body = json.loads(answer.immediate_response.body)  # type: ignore[attr-defined]
    assert set(body) == {"type", "error"} and body["type"] == "error"
    error: dict[str, str] = body["error"]
    assert set(error) == {"type", "message"}
    return error


def test_a_message_is_picked_and_one_user_id_keeps_one_primary() -> None:
    async def scenario() -> None:
        async with picker_rig(4, policy="session_affinity") as rig:
            lists = []
            for model in ("m", "m", "m-alias"):
                stream = rig.stream()
                await stream.headers(CREATE_MESSAGE, KEYED)
                body = _message_body(model, metadata={"user_id": '{"session_id": "s-9"}'})
                lists.append(_endpoint_list(await stream.body(body)))
                await stream.response_headers(GRPC_OK)
                await stream.response_trailers({"grpc-status": "0"})
                await stream.close()
            assert len({tuple(x) for x in lists}) == 1
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_count_tokens_is_routed_to_a_replica_of_the_model() -> None:
    async def scenario() -> None:
        async with picker_rig(2) as rig:
            stream = rig.stream()
            await stream.headers(COUNT_TOKENS, KEYED)
            request = json_format.ParseDict(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                apb.MessagesRequest(),
            )
            answer = await stream.body(client_body(apb.CountMessageTokensRequest(request=request)))
            assert len(_endpoint_list(answer)) == 2
            await stream.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        (_message_body("nope"), 404, "not_found_error", "nope"),
        (
            _message_body(
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]
            ),
            400,
            "invalid_request_error",
            "image",
        ),
        (
            _message_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
            400,
            "invalid_request_error",
            "web_search_20250305",
        ),
    ],
)
def test_refusals_come_in_anthropics_shape(body: bytes, status: int, kind: str, words: str) -> None:
    async def scenario() -> None:
        async with picker_rig() as rig:
            stream = rig.stream()
            await stream.headers(CREATE_MESSAGE, KEYED)
            answer = await stream.body(body)
            assert answer.immediate_response.status.code == status
            error = _anthropic_error(answer)
            assert error["type"] == kind and words in error["message"]
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def test_unavailable_is_anthropics_529_overloaded_error() -> None:
    answer = codec.immediate_response(UnavailableError("no replica is ready"), apis.MESSAGES)
    assert answer.immediate_response.status.code == 529
    assert answer.immediate_response.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]
    assert _anthropic_error(answer) == {
        "type": "overloaded_error",
        "message": "no replica is ready",
    }
    openai = codec.immediate_response(UnavailableError("no replica is ready"))
    assert openai.immediate_response.status.code == 503
    assert json.loads(openai.immediate_response.body)["error"]["message"] == "no replica is ready"


def test_a_gateway_picks_a_message_and_refuses_in_anthropics_shape() -> None:
    """Gateway mode (the client's JSON through a conformant gateway): /v1/messages is picked
    onto a node Envoy, streamed or not, and an unknown model is Anthropic's 404."""

    async def scenario() -> None:
        async with gateway_rig(2) as rig:
            for stream_flag in (False, True):
                stream = GatewayStream(rig.stub)
                await stream.headers("/v1/messages")
                assert (await stream.read()).HasField("request_headers")
                body = {**json.loads(_json_message()), "stream": stream_flag}
                await stream.body(json.dumps(body).encode())
                answer = await stream.read()
                assert answer.HasField("request_body"), answer
                await stream.close()
                assert rig.records[-1].model == "m"
                assert rig.records[-1].stream is stream_flag  # the body says, one method
            stream = GatewayStream(rig.stub)
            await stream.headers("/v1/messages/count_tokens")
            await stream.read()
            await stream.body(_json_message("nope"))
            answer = await stream.read()
            assert answer.immediate_response.status.code == 404
            assert _anthropic_error(answer)["type"] == "not_found_error"
            assert rig.in_flight() == 0

    asyncio.run(scenario())


def _json_message(model: str = "m") -> bytes:
    return json.dumps(
        {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()

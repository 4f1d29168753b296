"""The picker refuses a prompt whose size alone proves it cannot fit the route's context
(`inferplane.promptsize`, `Director.route`) before it takes a slot or reaches a replica, in
each API's error shape; a prompt that might fit passes unchecked by tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import pytest
from google.protobuf import json_format

from inferplane.fixtures import qwen3_tiny
from inferplane.promptsize import CONTEXT_LENGTH_EXCEEDED, token_bound
from inferplane.router.picker import codec
from inferplane.router.picker.codec import METHODS
from inferplane.router.picker.director import Director, RequestFacts
from inferplane.router.routes import RouteTable
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import apis, headers

from .fakes import admission, route

pytestmark = pytest.mark.timeout(30)

_PREFIX = "/inferplane.inference.v1.InferenceService/"
KEYED = {headers.KEY_ID: "k1", headers.REQUEST_ID: "req-1"}
CONTEXT = 2048  # the model: a 2,048-token context


def _director() -> tuple[Director, Any]:
    served = dataclasses.replace(
        route(2), max_model_len=CONTEXT, tokenizer=str(qwen3_tiny.model_path())
    )
    table = RouteTable.of([served])
    control, _, _ = admission(table)
    director = Director(lambda: table, control)
    director.token_bounds.get(served.tokenizer)  # starts the one-time read
    deadline = time.monotonic() + 10
    while director.token_bounds.get(served.tokenizer) is None:
        assert time.monotonic() < deadline, "the tokenizer's bound was never computed"
        time.sleep(0.01)
    return director, control


def _limit() -> int:
    bound = token_bound(qwen3_tiny.model_path())
    assert bound is not None
    return bound.limit_bytes(CONTEXT)


def _facts(method: str, body: dict[str, Any]) -> RequestFacts:
    m = METHODS[_PREFIX + method]
    wrapper = m.request_type()
    json_format.ParseDict(body, wrapper.request)  # type: ignore[attr-defined]
    return RequestFacts.of(m, wrapper, KEYED)


def _chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize(
    ("method", "body"),
    [
        ("StreamChatCompletionEvents", lambda text: _chat(text)),
        ("CreateCompletion", lambda text: {"model": "m", "prompt": text}),
        (
            "CreateMessage",
            lambda text: {"model": "m", "max_tokens": 8, **_chat(text)},
        ),
        ("CreateResponse", lambda text: {"model": "m", "input": text}),
    ],
)
def test_a_prompt_over_the_bound_is_refused_before_a_slot(method: str, body: Any) -> None:
    async def scenario() -> None:
        director, control = _director()
        limit = _limit()
        # One byte over: refused, no slot taken, no replica asked.
        with pytest.raises(InvalidArgumentError) as refused:
            director.route(_facts(method, body("x" * (limit + 1))))
        assert refused.value.code == CONTEXT_LENGTH_EXCEEDED
        assert str(CONTEXT) in str(refused.value)
        replicas = control.replicas("d")
        assert replicas is not None and replicas.total_in_flight == 0
        # At the bound it might fit (or not): the replica tokenizes and decides.
        decision = await director.decide(_facts(method, body("x" * limit)))
        decision.slot.release()

    asyncio.run(scenario())


def test_without_a_context_or_a_tokenizer_nothing_is_refused_by_size() -> None:
    async def scenario() -> None:
        for served in (
            dataclasses.replace(route(1), tokenizer=str(qwen3_tiny.model_path())),  # no context
            dataclasses.replace(route(1), max_model_len=CONTEXT),  # no tokenizer
            dataclasses.replace(route(1), max_model_len=CONTEXT, tokenizer="/nonexistent"),
        ):
            table = RouteTable.of([served])
            control, _, _ = admission(table)
            director = Director(lambda table=table: table, control)
            for _ in range(10):
                director.token_bounds.get(served.tokenizer)
                time.sleep(0.005)
            decision = await director.decide(
                _facts("StreamChatCompletionEvents", _chat("x" * (4 << 20)))
            )
            decision.slot.release()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("api", "status", "check"),
    [
        (apis.CHAT_COMPLETIONS, 400, lambda b: b["error"]["code"] == CONTEXT_LENGTH_EXCEEDED),
        (apis.RESPONSES, 400, lambda b: b["error"]["code"] == CONTEXT_LENGTH_EXCEEDED),
        (apis.MESSAGES, 400, lambda b: b["error"]["type"] == "invalid_request_error"),
    ],
)
def test_the_refusal_is_in_each_apis_shape(api: str, status: int, check: Any) -> None:
    director, _ = _director()
    facts = _facts("StreamChatCompletionEvents", _chat("x" * (_limit() + 1)))
    with pytest.raises(InvalidArgumentError) as refused:
        director.route(facts)
    answer = codec.immediate_response(refused.value, api).immediate_response
    assert answer.status.code == status
    assert check(json.loads(answer.body))

"""CreateResponse (OpenAI's `POST /v1/responses`) through the replica's real gRPC path, on the
fixture model's real tokenizer, template and parser, with a scripted engine and an in-memory
response store: the Response object and its events (validated with the openai SDK's own types),
the function-call round trip, stored responses replayed token for token, and the errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.apis.responses import decode_reasoning
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import SamplingParams
from inferplane.replica.pipeline.assets import ModelAssetsCache
from inferplane.replica.server import InferenceServicer
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    TickingClock,
    kimi_tiny_assets,
    kimi_tiny_ids,
    kimi_tiny_spec,
    script,
    serve_inference,
)
from inferplane.runtime import NotFoundError, UnavailableError
from inferplane.wire.headers import TENANT

MODEL = kt.SERVED_MODEL_NAME
WEATHER_CALL = (
    "The user asks for the weather. I will call get_weather."
    + kt.THINK_END
    + kt.SECTION_BEGIN
    + kt.CALL_BEGIN
    + "functions.get_weather:0"
    + kt.ARGUMENT_BEGIN
    + '{"city": "Paris"}'
    + kt.CALL_END
    + kt.SECTION_END
)
ANSWER = "It is sunny, I will say so." + kt.THINK_END + "It is sunny in Paris."
EVENTS = TypeAdapter(ResponseStreamEvent)


class MemoryStore:
    """A `ResponseStore` in a dict, scoped by tenant like auth's."""

    def __init__(self, *, fail_saves: bool = False) -> None:
        self.rows: dict[tuple[str, str], rpb.SaveResponseRequest] = {}
        self.fail_saves = fail_saves

    async def load(self, tenant: str, response_id: str) -> rpb.LoadResponseResponse:
        row = self.rows.get((tenant, response_id))
        if row is None:
            raise NotFoundError(
                f"Response with id '{response_id}' not found.",
                param="previous_response_id",
                code="not_found",
            )
        return rpb.LoadResponseResponse(
            response_json=row.response_json,
            input_items_json=row.input_items_json,
            prompt_token_ids=row.prompt_token_ids,
            output_token_ids=row.output_token_ids,
            render_key=row.render_key,
            model=row.model,
        )

    async def save(self, request: rpb.SaveResponseRequest) -> None:
        if self.fail_saves:
            raise UnavailableError("store down", code="response_store_unavailable")
        self.rows[(request.tenant, request.response_id)] = request


class Session:
    """A servicer whose engine answers with `outputs` in turn (each ended by `<|im_end|>`)."""

    def __init__(self, outputs: Sequence[str], store: MemoryStore | None = None) -> None:
        assets = kimi_tiny_assets()
        self.end_id = assets.tokenizer.get_vocab()[kt.EOS]
        self.outputs = list(outputs)
        self.output_ids: list[list[int]] = []
        self.engine = ScriptedEngine(self._generate)
        cache = ModelAssetsCache()
        cache.put(assets, "kimi")
        self.store = store if store is not None else MemoryStore()
        self.servicer = InferenceServicer(
            FakeReplica("r1", kimi_tiny_spec(), self.engine),
            cache,
            clock=TickingClock(),
            response_store=self.store,
        )

    def _generate(self, params: SamplingParams) -> list[Any]:
        ids = [*kimi_tiny_ids(self.outputs[len(self.output_ids)]), self.end_id]
        self.output_ids.append(ids)
        return script(ids, per_increment=3, prompt_tokens=0)

    def prompt(self, n: int) -> list[int]:
        return list(self.engine.requests[n][1])

    def call(self, body: dict[str, Any], tenant: str = "t1") -> Any:
        """The unary response as JSON, or the list of events when `body["stream"]`."""
        request = json_format.ParseDict(json.loads(json.dumps(body)), rpb.ResponseRequest())

        async def run() -> list[bytes]:
            async with serve_inference(self.servicer) as stub:
                metadata = ((TENANT, tenant),) if tenant else ()
                call = stub.CreateResponse(
                    rpb.CreateResponseRequest(request=request), metadata=metadata
                )
                return [m.data async for m in call]

        chunks = asyncio.run(run())
        if body.get("stream"):
            return _events(b"".join(chunks))
        assert len(chunks) == 1
        return json.loads(chunks[0])


def _events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        head, payload = block.split("\n", 1)
        event = json.loads(payload.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_unary_response_is_the_sdk_response_object() -> None:
    session = Session([ANSWER])
    out = session.call({"model": MODEL, "input": "Weather in Paris?", "store": False})
    response = Response.model_validate(out)
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == "It is sunny in Paris."
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == "It is sunny, I will say so."
    assert response.usage is not None
    assert response.usage.output_tokens == len(session.output_ids[0])
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    assert response.store is False
    assert session.store.rows == {}


def test_stream_events_follow_the_documented_sequence() -> None:
    session = Session([ANSWER])
    events = _events_of(session, {"model": MODEL, "input": "Weather?", "stream": True})
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS.validate_python(e)  # the openai SDK's own event types
    compact = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert compact == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "It is sunny in Paris."
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == text


def _events_of(session: Session, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = session.call(body)
    assert isinstance(events, list)
    return events


def test_function_call_round_trip_with_the_call_id() -> None:
    session = Session([WEATHER_CALL, ANSWER])
    first = session.call(
        {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER_TOOL], "store": False}
    )
    call = next(item for item in first["output"] if item["type"] == "function_call")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"] == "functions.get_weather:0" and call["id"].startswith("fc_")
    second = session.call(
        {
            "model": MODEL,
            "tools": [WEATHER_TOOL],
            "store": False,
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                *first["output"],
                {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
            ],
        }
    )
    assert Response.model_validate(second).output_text == "It is sunny in Paris."
    # The history renders the model's own call and its result (Kimi's ids, its reasoning kept
    # inside the tool loop): the second prompt extends the first prompt and output.
    assert session.prompt(1)[: len(session.prompt(0)) + len(session.output_ids[0])] == (
        session.prompt(0) + session.output_ids[0]
    )


def test_stored_response_replays_token_for_token() -> None:
    """After an answer and a new user message, Kimi's template drops the reasoning of the
    earlier turn, so the rendered history differs from what the model generated; a turn that
    continues a stored response gets the stored prompt and output ids verbatim instead."""
    session = Session([ANSWER, ANSWER])
    first = session.call({"model": MODEL, "input": "Weather in Paris?"})
    assert first["store"] is True
    assert ("t1", first["id"]) in session.store.rows
    second = session.call(
        {"model": MODEL, "input": "And tomorrow?", "previous_response_id": first["id"]}
    )
    assert second["previous_response_id"] == first["id"]
    expected = session.prompt(0) + session.output_ids[0]
    assert session.prompt(1)[: len(expected)] == expected
    tail = kimi_tiny_assets().tokenizer.decode(session.prompt(1)[len(expected) :])
    assert "And tomorrow?" in tail
    # The stored input items of the second turn hold the whole conversation, with ids.
    items = json.loads(session.store.rows[("t1", second["id"])].input_items_json)
    assert [i["type"] for i in items] == ["message", "reasoning", "message", "message"]
    assert all(i.get("id") for i in items)


def test_previous_response_of_another_tenant_is_not_found() -> None:
    session = Session([ANSWER, ANSWER])
    first = session.call({"model": MODEL, "input": "Hi"}, tenant="t1")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        session.call(
            {"model": MODEL, "input": "Again", "previous_response_id": first["id"]},
            tenant="t2",
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_failed_save_is_an_error_not_a_silent_turn() -> None:
    session = Session([ANSWER], MemoryStore(fail_saves=True))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        session.call({"model": MODEL, "input": "Hi"})
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    events = Session([ANSWER], MemoryStore(fail_saves=True)).call(
        {"model": MODEL, "input": "Hi", "stream": True}
    )
    assert [e["type"] for e in events[-2:]] == ["response.failed", "error"]
    assert events[-1]["code"] == "response_store_unavailable"


def test_encrypted_reasoning_is_readable_and_replays() -> None:
    session = Session([ANSWER, ANSWER])
    first = session.call(
        {
            "model": MODEL,
            "input": "Hi",
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"},
        }
    )
    reasoning = first["output"][0]
    assert decode_reasoning(reasoning["encrypted_content"], "x") == "It is sunny, I will say so."
    assert reasoning["summary"] == [{"type": "summary_text", "text": "It is sunny, I will say so."}]
    # Codex sends the items back (store false): the reasoning item is read back.
    session.call(
        {
            "model": MODEL,
            "store": False,
            "input": [
                {"role": "user", "content": "Hi"},
                *first["output"],
                {"role": "user", "content": "More"},
            ],
        }
    )


def test_max_output_tokens_gives_an_incomplete_response() -> None:
    session = Session([ANSWER])
    session.engine = ScriptedEngine(
        lambda params: script(kimi_tiny_ids("abc def"), finish_reason="length")
    )
    session.servicer = InferenceServicer(
        FakeReplica("r1", kimi_tiny_spec(), session.engine),
        _cache(),
        clock=TickingClock(),
    )
    out = session.call({"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["store"] is False  # no store given to this servicer


def _cache() -> ModelAssetsCache:
    cache = ModelAssetsCache()
    cache.put(kimi_tiny_assets(), "kimi")
    return cache


def _servicer_with(engine: ScriptedEngine) -> InferenceServicer:
    return InferenceServicer(
        FakeReplica("r1", kimi_tiny_spec(), engine), _cache(), clock=TickingClock()
    )


def test_streamed_function_call_events() -> None:
    session = Session([WEATHER_CALL])
    events = session.call(
        {
            "model": MODEL,
            "input": "Weather?",
            "tools": [WEATHER_TOOL],
            "stream": True,
            "store": False,
        }
    )
    for e in events:
        EVENTS.validate_python(e)
    types = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert done["arguments"] == deltas and json.loads(deltas) == {"city": "Paris"}
    assert done["name"] == "get_weather"
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output[-1].type == "function_call"


def test_an_engine_failure_after_output_ends_with_failed_and_error_events() -> None:
    ids = [*kimi_tiny_ids(ANSWER)]
    engine = ScriptedEngine(script(ids, per_increment=2), fail_at=3)
    session = Session([])
    session.servicer = _servicer_with(engine)
    events = session.call({"model": MODEL, "input": "Hi", "stream": True})
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e["type"] for e in events[-2:]] == ["response.failed", "error"]
    assert events[-2]["response"]["status"] == "failed"
    assert events[-1]["code"] == "engine_failed" and events[-1]["error"]["code"] == "engine_failed"
    assert "response.completed" not in [e["type"] for e in events]


def test_an_engine_failure_before_output_is_a_plain_error() -> None:
    session = Session([])
    session.servicer = _servicer_with(ScriptedEngine(script([1, 2]), fail_at=0))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        session.call({"model": MODEL, "input": "Hi", "stream": True})
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_streamed_length_finish_is_response_incomplete() -> None:
    session = Session([])
    session.servicer = _servicer_with(
        ScriptedEngine(lambda params: script(kimi_tiny_ids("abc def"), finish_reason="length"))
    )
    events = session.call({"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    EVENTS.validate_python(events[-1])


MCP_WEATHER = {
    "type": "namespace",
    "name": "mcp__weather",
    "description": "Tools in the mcp__weather namespace.",
    "tools": [{**WEATHER_TOOL, "strict": False}],
}
NAMESPACED_CALL = WEATHER_CALL.replace(
    "functions.get_weather:0", "functions.mcp__weather__get_weather:0"
)


def test_a_namespaced_call_is_written_with_its_namespace_and_replays_prefix_stable() -> None:
    """Codex CLI's MCP tools come in a namespace tool: the model is offered
    `mcp__weather__get_weather`, its call is answered as OpenAI's namespaced `function_call`
    (`name` get_weather, `namespace` mcp__weather), and the call sent back renders as the
    model wrote it."""
    session = Session([NAMESPACED_CALL, ANSWER])
    body = {"model": MODEL, "tools": [MCP_WEATHER], "store": False, "stream": True}
    events = _events_of(session, {**body, "input": "Weather in Paris?"})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS.validate_python(e)
    rendered = kimi_tiny_assets().tokenizer.decode(session.prompt(0))
    assert "mcp__weather__get_weather" in rendered
    final = Response.model_validate(events[-1]["response"])
    call = final.output[-1]
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("get_weather", "mcp__weather")
    assert call.call_id == "functions.mcp__weather__get_weather:0"
    added = next(
        e["item"]
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    )
    assert (added["name"], added["namespace"]) == ("get_weather", "mcp__weather")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_weather"
    output = events[-1]["response"]["output"]
    second = _events_of(
        session,
        {
            **body,
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                *output,
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            ],
        },
    )
    assert Response.model_validate(second[-1]["response"]).output_text == "It is sunny in Paris."
    assert session.prompt(1)[: len(session.prompt(0)) + len(session.output_ids[0])] == (
        session.prompt(0) + session.output_ids[0]
    )

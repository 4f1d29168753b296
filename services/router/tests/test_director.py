"""The picker's decision without ext_proc (`Director`: route → admit → pick): the request's
facts in, the slot and the ordered endpoint list (or the client's refusal) out."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from google.api import httpbody_pb2

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.router.admission import AdmissionSettings
from inferplane.router.picker.codec import METHODS
from inferplane.router.picker.director import Director, RequestFacts
from inferplane.router.routes import ModelRoute, RouteTable
from inferplane.runtime import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from inferplane.wire import headers

from .fakes import admission, route

pytestmark = pytest.mark.timeout(30)

CHAT = METHODS["/inferplane.inference.v1.InferenceService/StreamChatCompletionEvents"]
TRANSCRIBE = METHODS["/inferplane.inference.v1.InferenceService/CreateTranscription"]
KEYED = {headers.KEY_ID: "k1", headers.REQUEST_ID: "req-1"}


def _table(n: int = 3, cap: int = 0) -> RouteTable:
    served = route(n, cap=cap)
    return RouteTable.of([served, dataclasses.replace(served, model="m-alias")])


def _chat(model: str = "m", metadata: dict[str, str] | None = None) -> RequestFacts:
    request = pb.StreamChatCompletionEventsRequest(
        request=pb.ChatCompletionRequest(model=model, messages=[pb.ChatMessage(role="user")])
    )
    return RequestFacts.of(CHAT, request, metadata if metadata is not None else KEYED)


def test_a_decision_holds_a_slot_on_the_primary_and_lists_the_fallbacks_after_it() -> None:
    async def scenario() -> None:
        table = _table()
        control, _, _ = admission(table)
        director = Director(lambda: table, control, fallbacks=2)
        decision = await director.decide(_chat("m-alias"))
        assert decision.route.deployment_key == "d"
        addresses = [e.address for e in decision.endpoints]
        assert addresses[0] == decision.slot.endpoint.address
        assert len(addresses) == 3 == len(set(addresses))
        replicas = control.replicas("d")
        assert replicas is not None and replicas.total_in_flight == 1
        decision.slot.release()
        assert replicas.total_in_flight == 0

    asyncio.run(scenario())


def test_a_gateways_subset_leaves_replicas_out_and_lists_no_fallbacks() -> None:
    async def scenario() -> None:
        table = _table()
        control, _, _ = admission(table)
        director = Director(lambda: table, control, fallbacks=2)

        def outside(served: ModelRoute) -> list[tuple[str, str]]:
            return [e.key for e in served.endpoints if e.replica_id != "r1"]

        decision = await director.decide(_chat(), outside)
        assert [e.replica_id for e in decision.endpoints] == ["r1"]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("facts", "error", "code"),
    [
        (_chat("nope"), NotFoundError, "model_not_found"),
        (_chat("m", {headers.ALLOWED_MODELS: "other"}), PermissionDeniedError, "model_not_allowed"),
    ],
    ids=["unknown-model", "not-allowed"],
)
def test_refusals_are_raised_before_a_slot_is_taken(
    facts: RequestFacts, error: type[Exception], code: str
) -> None:
    async def scenario() -> None:
        table = _table()
        control, _, _ = admission(table)
        director = Director(lambda: table, control)
        with pytest.raises(error) as raised:
            await director.decide(facts)
        assert getattr(raised.value, "code", None) == code
        replicas = control.replicas("d")
        assert replicas is not None and replicas.total_in_flight == 0

    asyncio.run(scenario())


def test_a_full_deployment_queues_the_request_until_a_slot_frees_or_the_wait_runs_out() -> None:
    async def scenario() -> None:
        table = _table(n=1, cap=1)
        control, _, scheduler = admission(table, AdmissionSettings(queue_timeout_seconds=5.0))
        director = Director(lambda: table, control)
        first = await director.decide(_chat())
        second = asyncio.ensure_future(director.decide(_chat()))
        await asyncio.sleep(0)
        assert not second.done() and control.queue_length("d") == 1
        first.slot.release()
        decision = await asyncio.wait_for(second, 5)
        assert decision.endpoints == first.endpoints
        third = asyncio.ensure_future(director.decide(_chat()))
        await asyncio.sleep(0)
        scheduler.advance(5.0)
        with pytest.raises(ResourceExhaustedError):
            await asyncio.wait_for(third, 5)

    asyncio.run(scenario())


def test_an_audio_request_is_decided_on_its_forms_model() -> None:
    form = httpx.Request(
        "POST", "http://x", data={"model": "m-alias"}, files={"file": ("a.wav", b"RIFF" * 100)}
    )
    body = httpbody_pb2.HttpBody(content_type=form.headers["content-type"], data=form.read())
    facts = RequestFacts.of(TRANSCRIBE, pb.CreateTranscriptionRequest(body=body), KEYED)
    assert facts.model == "m-alias"

    async def scenario() -> None:
        table = _table()
        control, _, _ = admission(table)
        decision = await Director(lambda: table, control).decide(facts)
        assert decision.route.model == "m-alias"

    asyncio.run(scenario())
    empty = httpbody_pb2.HttpBody(content_type=form.headers["content-type"], data=b"")
    with pytest.raises(InvalidArgumentError):
        RequestFacts.of(TRANSCRIBE, pb.CreateTranscriptionRequest(body=empty), KEYED)

"""Mid-stream migration (issue 31), in process over real gRPC: a replica whose engine fails
after output continues the stream on a sibling (`engines/migration.py` on the origin,
`server/continuation.py` on the sibling), and the client's SSE stream ends with its finish
reason and `[DONE]`, its text exactly the tokens generated before the failure followed by the
sibling's. Scripted engines replay fixture-tokenizer ids; the error interceptor is the
runtime's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import replica_pb2, replica_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.engines.base import (
    EngineOutput,
    SamplingParams,
    TokenLogprob,
)
from inferplane.replica.engines.lora import AdapterRegistry
from inferplane.replica.engines.migration import (
    Migrator,
    Origin,
    continuation_params,
    message_of,
    output_of,
    params_of,
)
from inferplane.replica.pipeline import ModelAssetsCache
from inferplane.replica.server import InferenceServicer
from inferplane.replica.server.continuation import Continuations
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    TickingClock,
    kimi_tiny_assets,
    kimi_tiny_ids,
    kimi_tiny_spec,
    script,
)
from inferplane.runtime import ErrorInterceptor
from inferplane.runtime.security.identity import PeerSecurity
from inferplane.wire import chat_request_from_dict
from inferplane.wire.headers import SIBLINGS
from inferplane.wire.siblings import Sibling, decode_siblings, encode_siblings

TEXT = " ".join(["Here is a short note about Paris, written slowly."] * 4)
IDS = kimi_tiny_ids(TEXT + "<|im_end|>")
CUT = 9  # the origin's engine fails after this many tokens


class _SiblingServicer(replica_pb2_grpc.ReplicaProcessServiceServicer):  # type: ignore[misc]
    def __init__(self, continuations: Continuations) -> None:
        self._continuations = continuations

    async def ContinueGeneration(
        self, request: replica_pb2.ContinueGenerationRequest, context: Any
    ) -> AsyncIterator[replica_pb2.ContinueGenerationResponse]:
        async for message in self._continuations.serve(request):
            yield message


def _chat(**extra: Any) -> pb.StreamChatCompletionEventsRequest:
    body = {
        "model": kt.SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "Write about Paris."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 200,
        "temperature": 0,
        **extra,
    }
    return pb.StreamChatCompletionEventsRequest(request=chat_request_from_dict(body))


async def _run(
    origin_engine: ScriptedEngine,
    sibling: FakeReplica | None,
    request: pb.StreamChatCompletionEventsRequest,
    registry: CollectorRegistry,
) -> list[dict[str, Any] | str]:
    """Serves the origin (replica r1) and, when given, the sibling (r2); streams `request` to
    the origin with the pick's siblings in its headers; the SSE events, parsed."""
    assets = ModelAssetsCache()
    assets.put(kimi_tiny_assets(), "kimi_k2")
    spec = kimi_tiny_spec()
    origin = Origin("r1", spec.revision, spec.served_model_name)
    migrator = Migrator(origin, PeerSecurity.plaintext(), registry, answer_seconds=5)
    servicer = InferenceServicer(
        FakeReplica("r1", spec, origin_engine),
        assets,
        clock=TickingClock(),
        migrator=migrator,
    )
    server = grpc.aio.server(interceptors=[ErrorInterceptor("replica")])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    sibling_server = grpc.aio.server(interceptors=[ErrorInterceptor("replica")])
    if sibling is not None:
        continuations = Continuations(sibling, AdapterRegistry(sibling.spec))  # type: ignore[arg-type]
        replica_pb2_grpc.add_ReplicaProcessServiceServicer_to_server(
            _SiblingServicer(continuations), sibling_server
        )
    sibling_port = sibling_server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await sibling_server.start()
    siblings = encode_siblings(
        [
            Sibling("r1", spec.revision, f"127.0.0.1:{port}"),  # itself: left out
            Sibling("r3", "another-revision", f"127.0.0.1:{sibling_port}"),  # left out
            Sibling("r2", spec.revision, f"127.0.0.1:{sibling_port}"),
        ]
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            call = stub.StreamChatCompletionEvents(request, metadata=((SIBLINGS, siblings),))
            data = b"".join([body.data async for body in call])
    finally:
        await server.stop(0)
        await sibling_server.stop(0)
        await migrator.close()
    events: list[dict[str, Any] | str] = []
    for event in data.split(b"\n\n"):
        if event:
            payload = event.removeprefix(b"data: ").decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _text(events: Sequence[dict[str, Any] | str]) -> str:
    """Everything the deltas showed (the fixture model thinks first: reasoning, then content)."""
    return "".join(
        (choice["delta"].get("reasoning_content") or "") + (choice["delta"].get("content") or "")
        for e in events
        if isinstance(e, dict)
        for choice in e.get("choices", ())
    )


def _migrations(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("inferplane_stream_migrations_total", {"outcome": outcome})


def test_a_stream_whose_engine_fails_mid_way_ends_complete_on_a_sibling() -> None:
    registry = CollectorRegistry()
    sibling_engine = ScriptedEngine(script(IDS[CUT:]))
    sibling = FakeReplica("r2", kimi_tiny_spec(), sibling_engine)
    events = asyncio.run(_run(ScriptedEngine(script(IDS), fail_at=CUT), sibling, _chat(), registry))
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    assert _text(events) == TEXT  # no token repeated or lost
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"]]
    assert finishes[-1] == "stop"
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")][-1]
    assert usage["completion_tokens"] == len(IDS)  # counted once, here
    # The sibling got the prompt followed by the ids generated before the failure, and what
    # was left of max_tokens; it runs it under an id of its own.
    ((request_id, prompt, params),) = sibling_engine.requests
    assert prompt[-CUT:] == list(IDS[:CUT]) and len(prompt) > CUT
    assert params.max_tokens == 200 - CUT and params.temperature == 0
    assert request_id.endswith("-cont-r2")
    assert sibling.in_flight == 0 and sibling.admitted == 1
    assert _migrations(registry, "migrated") == 1 and _migrations(registry, "no_sibling") == 0


def test_a_constrained_stream_is_not_moved_and_ends_with_an_error_event() -> None:
    """A json_schema stream: the sibling's grammar would restart at the tokens already
    generated, so the stream ends with an error event, as without a sibling."""
    registry = CollectorRegistry()
    sibling_engine = ScriptedEngine(script(IDS[CUT:]))
    sibling = FakeReplica("r2", kimi_tiny_spec(), sibling_engine)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    request = _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    events = asyncio.run(_run(ScriptedEngine(script(IDS), fail_at=CUT), sibling, request, registry))
    assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == "engine_failed"
    assert sibling_engine.requests == []
    assert _migrations(registry, "constrained") == 1


@pytest.mark.parametrize("why", ["not_ready", "full", "gone"])
def test_without_a_sibling_that_takes_it_the_stream_ends_with_an_error_event(why: str) -> None:
    registry = CollectorRegistry()
    spec = kimi_tiny_spec()
    spec.max_num_seqs = 1
    sibling = FakeReplica("r2", spec, ScriptedEngine(script(IDS[CUT:])))
    if why == "not_ready":
        sibling.ready = False
    elif why == "full":
        sibling.in_flight = 1
    events = asyncio.run(
        _run(
            ScriptedEngine(script(IDS), fail_at=CUT),
            None if why == "gone" else sibling,
            _chat(),
            registry,
        )
    )
    assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == "engine_failed"
    assert _text(events) == kimi_tiny_assets().backend.decode(list(IDS[:CUT]))
    assert _migrations(registry, "no_sibling") == 1


def test_continuation_params_count_down_and_round_trip() -> None:
    params = SamplingParams(
        max_tokens=100,
        temperature=0.7,
        top_k=5,
        min_tokens=20,
        seed=3,
        stop=("END",),
        stop_token_ids=(7,),
        logprobs=2,
        logit_bias=((11, -1.5),),
        stream_interval=4,
        constraint=None,
    )
    back = params_of(continuation_params(params, 30))
    assert back.max_tokens == 70 and back.min_tokens == 0
    assert (back.temperature, back.top_k, back.seed, back.logprobs) == (0.7, 5, 3, 2)
    assert (back.stop, back.stop_token_ids, back.logit_bias) == (("END",), (7,), ((11, -1.5),))
    assert back.top_p is None and back.repetition_penalty is None  # the engine's defaults
    out = EngineOutput(
        (5, 6),
        finished=True,
        finish_reason="length",
        completion_tokens=12,
        logprobs=(TokenLogprob(5, -0.1, ((5, -0.1), (9, -2.0))), TokenLogprob(6, -0.2)),
    )
    assert output_of(message_of(out)) == out


def test_the_picker_s_sibling_header_round_trips_and_skips_what_it_cannot_read() -> None:
    siblings = [Sibling("kimi-0-abc", "abc", "10.0.0.1:50051"), Sibling("k", "", "h:1")]
    assert decode_siblings(encode_siblings(siblings)) == tuple(siblings)
    assert decode_siblings("junk,a|b,|x|,r|v|h:2") == (Sibling("r", "v", "h:2"),)
    assert encode_siblings([Sibling("a,b", "v", "h:1")]) == ""

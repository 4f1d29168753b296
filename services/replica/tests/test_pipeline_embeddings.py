"""CreateEmbedding on an `embed` replica (the embedding fixture's real tokenizer, a fake engine
whose vectors are `fake_embedding`s): input shapes, float and base64, Matryoshka `dimensions`,
400s naming their `param`, usage, summary trailers, records, picker reports, engine failures,
and the task check both ways."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import math
from array import array
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import embed_tiny as et
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.pipeline.embeddings import MAX_INPUTS, needs_thread, plan_embedding
from inferplane.replica.server import RequestOutcome
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    embed_tiny_assets,
    embed_tiny_spec,
    fake_embedding,
    kimi_tiny_spec,
    run_scenario,
)
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import ResponseSummary, chat_request_from_dict
from inferplane.wire.headers import PICKER

Stub = inference_pb2_grpc.InferenceServiceStub
MODEL = et.SERVED_MODEL_NAME


def request(input_: Any, **extra: Any) -> pb.CreateEmbeddingRequest:
    body = {"model": MODEL, "input": input_, **extra}
    return pb.CreateEmbeddingRequest(request=json_format.ParseDict(body, pb.EmbeddingRequest()))


def ids(text: str) -> list[int]:
    """What vLLM embeds for a string: the tokenizer's ids with special tokens."""
    return list(embed_tiny_assets().tokenizer(text)["input_ids"])


def serve(engine: ScriptedEngine, body: Any, gpu_seconds: float = 0.0, **options: Any) -> None:
    replica = FakeReplica("e1", embed_tiny_spec(), engine)
    replica.gpu_seconds_per_request = gpu_seconds
    run_scenario(engine, body, replicas=[replica], **options)


def vectors(response: pb.CreateEmbeddingResponse) -> list[list[float]]:
    out = []
    for item in response.data:
        value = item.embedding
        if value.WhichOneof("kind") == "string_value":
            out.append(list(array("f", base64.b64decode(value.string_value))))
        else:
            out.append([v.number_value for v in value.list_value.values])
    return out


def trailers(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: v for k, v in (error.trailing_metadata() or ()) if isinstance(v, str)}


# -- inputs and the response ---------------------------------------------------------------

TEXTS = list(et.SAMPLE_TEXTS)
SHAPES = [
    ("string", TEXTS[0], [ids(TEXTS[0])]),
    ("strings", TEXTS, [ids(t) for t in TEXTS]),
    ("token ids", [2, 240, 241, 3], [[2, 240, 241, 3]]),
    ("token-id arrays", [[2, 240, 3], [2, 241, 241, 3]], [[2, 240, 3], [2, 241, 241, 3]]),
]


@pytest.mark.parametrize(
    ("input_", "expected"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES]
)
def test_each_input_shape_embeds_its_token_ids_in_order(input_: Any, expected: list) -> None:
    """Strings are tokenized with special tokens ([CLS] … [SEP]), token ids go as given; one
    engine call for all inputs; data in input order with `index`, usage = all inputs' tokens,
    the served model name, `object` "list" / "embedding"."""
    engine = ScriptedEngine([])

    async def body(stub: Stub) -> None:
        response = await stub.CreateEmbedding(request(input_, encoding_format="float"))
        assert response.object == "list" and response.model == MODEL
        assert [(d.object, d.index) for d in response.data] == [
            ("embedding", i) for i in range(len(expected))
        ]
        for got, want in zip(vectors(response), expected, strict=True):
            assert got == list(fake_embedding(want))
        tokens = sum(len(x) for x in expected)
        assert (response.usage.prompt_tokens, response.usage.total_tokens) == (tokens, tokens)

    serve(engine, body)
    [(request_id, inputs, dimensions)] = engine.embeddings
    assert request_id.startswith("embd-") and inputs == expected and dimensions is None


def test_string_ids_are_what_the_tokenizer_gives_with_special_tokens() -> None:
    """The backend's ids equal transformers' `tokenizer(text)` (what vLLM uses)."""
    assets = embed_tiny_assets()
    plan = plan_embedding(request(TEXTS).request, assets)
    assert [list(p) for p in plan.inputs] == [ids(t) for t in TEXTS]
    assert all(p[0] == 2 and p[-1] == 3 for p in plan.inputs)  # [CLS] … [SEP]


def test_base64_is_little_endian_float32_of_the_same_vector() -> None:
    """`encoding_format` base64: the float32 bytes (little-endian) of exactly the numbers the
    default ("float") format returns; the default is float."""
    engine = ScriptedEngine([])

    async def body(stub: Stub) -> None:
        default = await stub.CreateEmbedding(request(TEXTS))
        floats = await stub.CreateEmbedding(request(TEXTS, encoding_format="float"))
        encoded = await stub.CreateEmbedding(request(TEXTS, encoding_format="base64"))
        assert default == floats
        for item, numbers in zip(encoded.data, vectors(floats), strict=True):
            raw = base64.b64decode(item.embedding.string_value)
            assert len(raw) == 4 * len(numbers)
            assert list(memoryview(raw).cast("f")) == numbers  # this box is little-endian
        # The JSON the edge prints: numbers stay numbers, base64 a string.
        as_json = json_format.MessageToDict(floats)
        assert isinstance(as_json["data"][0]["embedding"][0], float)

    serve(engine, body)


def test_matryoshka_dimensions_go_to_the_engine_and_cut_the_vector() -> None:
    """`dimensions` among config.json's matryoshka_dimensions (16, 32, 64) reaches the engine,
    whose vectors are then that long and unit-norm; any other value is a 400 on `dimensions`
    that never reaches the engine."""
    engine = ScriptedEngine([])

    async def body(stub: Stub) -> None:
        for dims in et.MATRYOSHKA_DIMENSIONS:
            response = await stub.CreateEmbedding(request(TEXTS[0], dimensions=dims))
            [vector] = vectors(response)
            assert len(vector) == dims
            assert math.isclose(math.fsum(v * v for v in vector), 1.0, abs_tol=1e-5)
        for dims in (0, 48, 128):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CreateEmbedding(request(TEXTS[0], dimensions=dims))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert trailers(info.value)["x-openai-error-param"] == "dimensions"
            assert "16, 32, 64" in info.value.details()

    serve(engine, body)
    assert [d for _, _, d in engine.embeddings] == list(et.MATRYOSHKA_DIMENSIONS)


def test_dimensions_on_a_model_without_matryoshka_sizes_is_refused_even_at_full_size() -> None:
    """Without matryoshka_dimensions / is_matryoshka in config.json, any `dimensions` (the
    full 64 too) is `unsupported_parameter` on `dimensions`, as vLLM refuses it."""
    plain = dataclasses.replace(embed_tiny_assets(), matryoshka_dimensions=())
    for dims in (64, 16):
        with pytest.raises(InvalidArgumentError) as info:
            plan_embedding(request("hello", dimensions=dims).request, plain)
        assert (info.value.param, info.value.code) == ("dimensions", "unsupported_parameter")
    assert plan_embedding(request("hello").request, plain).dimensions is None


INVALID = [
    ("missing input", None, {}, "input", "invalid_value"),
    ("empty string", "", {}, "input", "invalid_value"),
    ("empty array", [], {}, "input", "invalid_value"),
    ("empty string item", ["a", ""], {}, "input", "invalid_value"),
    ("empty token array", [[2, 3], []], {}, "input", "invalid_value"),
    ("too many inputs", ["a"] * (MAX_INPUTS + 1), {}, "input", "invalid_value"),
    ("too many token arrays", [[2]] * (MAX_INPUTS + 1), {}, "input", "invalid_value"),
    ("fractional token", [2, 1.5], {}, "input", "invalid_value"),
    ("negative token", [2, -1], {}, "input", "invalid_value"),
    ("token beyond vocab", [2, 437], {}, "input", "invalid_value"),
    ("string in token array", [[2, "a"]], {}, "input", "invalid_value"),
    ("mixed strings and arrays", ["a", [2]], {}, "input", "invalid_value"),
    ("a number", 5, {}, "input", "invalid_value"),
    ("a boolean", True, {}, "input", "invalid_value"),
    ("an object", {"text": "a"}, {}, "input", "invalid_value"),
    ("too long string", " ".join(["word"] * 511), {}, "input", "context_length_exceeded"),
    ("too long tokens", [5] * 513, {}, "input", "context_length_exceeded"),
    ("encoding_format", "a", {"encoding_format": "bytes"}, "encoding_format", "invalid_value"),
]


@pytest.mark.parametrize(
    ("input_", "extra", "param", "code"), [i[1:] for i in INVALID], ids=[i[0] for i in INVALID]
)
def test_invalid_requests_are_400s_naming_the_param(
    input_: Any, extra: dict[str, Any], param: str, code: str
) -> None:
    """Each rule: INVALID_ARGUMENT with OpenAI's type, `param` and code; nothing reaches the
    engine, and the summary trailers carry the error code."""
    engine = ScriptedEngine([])

    async def body(stub: Stub) -> None:
        body = {"model": MODEL, **extra}
        if input_ is not None:
            body["input"] = input_
        message = pb.CreateEmbeddingRequest(
            request=json_format.ParseDict(body, pb.EmbeddingRequest())
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateEmbedding(message)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        got = trailers(info.value)
        assert got["x-openai-error-type"] == "invalid_request_error"
        assert got["x-openai-error-param"] == param, info.value.details()
        assert got["x-openai-error-code"] == code
        summary = ResponseSummary.from_metadata(tuple(info.value.trailing_metadata()))
        assert (summary.replica_id, summary.error_code) == ("e1", code)

    serve(engine, body)
    assert engine.embeddings == []


def test_an_input_may_fill_the_whole_context_and_the_limit_is_named() -> None:
    """As vLLM: an input of exactly max_model_len tokens is embedded (nothing is generated);
    one more is refused with OpenAI's context-length wording, naming the limit and the item."""
    assets = embed_tiny_assets()
    assert len(plan_embedding(request([5] * 512).request, assets).inputs[0]) == 512
    with pytest.raises(InvalidArgumentError) as info:
        plan_embedding(request([[5], [5] * 513]).request, assets)
    assert info.value.message.startswith("This model's maximum context length is 512 tokens.")
    assert "input 1 resulted in 513 tokens" in info.value.message


def test_a_large_batch_of_strings_is_tokenized_off_the_loop_with_the_same_result() -> None:
    """2,048 inputs (the maximum; more than THREAD_BYTES of input) are tokenized in a worker
    thread and embedded in order."""
    engine = ScriptedEngine([])
    texts = [f"{TEXTS[1]} {i}" for i in range(MAX_INPUTS)]
    assert needs_thread(request(texts).request) and not needs_thread(request(TEXTS).request)

    async def body(stub: Stub) -> None:
        response = await stub.CreateEmbedding(request(texts, encoding_format="base64"))
        assert [d.index for d in response.data] == list(range(MAX_INPUTS))
        assert response.usage.prompt_tokens == sum(len(x) for x in engine.embeddings[0][1])

    serve(engine, body)
    assert engine.embeddings[0][1][7] == ids(texts[7])


# -- the task check ------------------------------------------------------------------------


def test_embeddings_from_a_generate_replica_and_chat_from_an_embed_replica_are_400s() -> None:
    """A model of the other task: INVALID_ARGUMENT on `model` (OpenAI's wording), both ways;
    no engine call."""
    chat_engine, embed_engine = ScriptedEngine([]), ScriptedEngine([])
    replicas = [
        FakeReplica("r1", kimi_tiny_spec(), chat_engine),
        FakeReplica("e1", embed_tiny_spec(), embed_engine),
    ]

    async def body(stub: Stub) -> None:
        wrong = request("hello")
        wrong.request.model = kt.SERVED_MODEL_NAME
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateEmbedding(wrong)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert trailers(info.value)["x-openai-error-param"] == "model"
        assert "'kimi-tiny' is not an embedding model" in info.value.details()

        chat = chat_request_from_dict(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        for call in (
            lambda: stub.CreateChatCompletion(pb.CreateChatCompletionRequest(request=chat)),
            lambda: _drain(stub.StreamChatCompletion(pb.StreamChatCompletionRequest(request=chat))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert trailers(info.value)["x-openai-error-param"] == "model"
            assert "'embed-tiny' is an embedding model" in info.value.details()

    run_scenario(chat_engine, body, replicas=replicas)
    assert chat_engine.requests == chat_engine.embeddings == []
    assert embed_engine.requests == embed_engine.embeddings == []


async def _drain(call: Any) -> list[Any]:
    return [c async for c in call]


# -- trailers, records, reports, failures ---------------------------------------------------

PICKED = (("x-request-id", "req-1"), (PICKER, "10.0.0.9:50070"))


def test_summary_trailers_record_and_picker_report_of_an_embedding() -> None:
    """Like the other unary RPCs: the replica named in the response headers, summary trailers
    with the inputs' tokens, no completion tokens, finish "stop" and the time to the result as
    TTFT; one record (api "embedding") and one report to the picker with the same summary."""
    engine = ScriptedEngine([])
    outcomes: list[RequestOutcome] = []
    reports: list[tuple[str, str, ResponseSummary]] = []
    tokens = sum(len(ids(t)) for t in TEXTS)

    async def body(stub: Stub) -> None:
        call = stub.CreateEmbedding(request(TEXTS), metadata=PICKED)
        response = await call
        assert response.usage.prompt_tokens == tokens
        assert dict(await call.initial_metadata())["x-inferplane-replica"] == "e1"
        summary = ResponseSummary.from_metadata(tuple(await call.trailing_metadata()))
        assert (summary.replica_id, summary.prompt_tokens, summary.completion_tokens) == (
            "e1",
            tokens,
            0,
        )
        assert summary.finish_reason == "stop" and summary.error_code == ""
        assert 0 < summary.ttft_seconds < 1
        assert summary.gpu_seconds == 0.125  # what the replica charged it, when it left

    serve(
        engine,
        body,
        gpu_seconds=0.125,
        on_outcome=outcomes.append,
        report_to_picker=lambda *a: reports.append(a),
    )
    [outcome] = outcomes
    assert (outcome.api, outcome.status, outcome.stream, outcome.model) == (
        "embedding",
        "ok",
        False,
        MODEL,
    )
    assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.finish_reason) == (
        tokens,
        0,
        "stop",
    )
    assert outcome.request_id == engine.embeddings[0][0] and outcome.request_header_id == "req-1"
    assert outcome.ttft_seconds and outcome.e2e_seconds >= outcome.ttft_seconds
    [(picker, request_id, reported)] = reports
    assert (picker, request_id) == ("10.0.0.9:50070", "req-1")
    assert (reported.prompt_tokens, reported.finish_reason, reported.model) == (
        tokens,
        "stop",
        MODEL,
    )


def test_an_engine_failure_is_unavailable_engine_failed_and_not_reported() -> None:
    """The engine dies: UNAVAILABLE `engine_failed` (Envoy may retry elsewhere: nothing went
    out), the summary says so, the record says error, no picker report."""
    engine = ScriptedEngine([], fail_at=0)
    outcomes: list[RequestOutcome] = []
    reports: list[Any] = []

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateEmbedding(request(TEXTS), metadata=PICKED)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert trailers(info.value)["x-openai-error-code"] == "engine_failed"
        summary = ResponseSummary.from_metadata(tuple(info.value.trailing_metadata()))
        assert (summary.finish_reason, summary.error_code) == ("", "engine_failed")

    serve(engine, body, on_outcome=outcomes.append, report_to_picker=lambda *a: reports.append(a))
    assert [(o.status, o.error_code) for o in outcomes] == [("error", "engine_failed")]
    assert reports == []


def test_an_engine_rejection_is_a_400() -> None:
    """The engine's own validation refusing a request is the client's fault: a 400."""
    engine = ScriptedEngine([], fail_at=0, rejects=True)

    async def body(stub: Stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateEmbedding(request("hello"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert trailers(info.value)["x-openai-error-code"] == "invalid_request"

    serve(engine, body)


def test_a_replica_that_is_not_ready_is_unavailable_and_admission_counts_embeddings() -> None:
    """Admission as for generations: a running embedding is in flight while it runs, a client
    that leaves cancels its engine call, and a replica not ready (starting, draining) is
    UNAVAILABLE before the engine is asked."""
    engine = ScriptedEngine([], block_at=0)
    replica = FakeReplica("e1", embed_tiny_spec(), engine)

    async def body(stub: Stub) -> None:
        call = stub.CreateEmbedding(request("hello"))
        await asyncio.wait_for(engine.blocked.wait(), 5)
        assert replica.in_flight == 1
        call.cancel()
        for _ in range(100):
            if not replica.in_flight:
                break
            await asyncio.sleep(0.01)
        assert replica.in_flight == 0 and engine.cancelled  # the client left: engine call too
        replica.ready = False
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateEmbedding(request("hello"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert trailers(info.value)["x-openai-error-code"] == "replica_not_ready"

    run_scenario(engine, body, replicas=[replica])
    assert len(engine.embeddings) == 1

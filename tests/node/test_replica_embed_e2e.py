"""A real replica process (`python -m inferplane.replica`, started from the node-agent's
own launch plan) on the embedding fixture model `embed-tiny`, over gRPC: CreateEmbedding gives
the transformers reference vectors for strings and token ids, base64 decodes to the same
floats, `dimensions` 16 gives 16 normalised values, usage counts the tokens, the summary
trailers say so; a chat request is refused naming `model`. On `inproc` (AsyncLLM in the
replica process) and `http-completions` (a child `vllm serve --runner pooling`).

Prints the start-up time and the per-request latency of 1 and 32 inputs (median and p90 of
20 requests each, after a warm-up)."""

from __future__ import annotations

import asyncio
import base64
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import embed_tiny as et
from inferplane.node_agent.supervisor.process import EngineProcess, ProcessSpawner, plan_launch
from inferplane.replica.testing.pipeline import embed_tiny_spec
from inferplane.wire import ResponseSummary, chat_request_from_dict

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]

ATOL = 1e-5  # vLLM's fp32 CPU kernels vs transformers (libs/tests/fixture_model/test_embed_tiny.py)
READY_SECONDS = 180
TEXTS = list(et.SAMPLE_TEXTS)
LATENCY_REPEATS = 20


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The transformers reference: vectors of TEXTS (full and 16 values) and their ids."""
    torch.set_num_threads(1)  # the engine gets the cores
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(et.model_path()))
    model = transformers.AutoModel.from_pretrained(str(et.model_path()), dtype=torch.float32).eval()
    return {
        "ids": [tokenizer(t)["input_ids"] for t in TEXTS],
        "full": et.reference_embeddings(TEXTS, model=model, tokenizer=tokenizer).numpy(),
        "16": et.reference_embeddings(
            TEXTS, dimensions=16, model=model, tokenizer=tokenizer
        ).numpy(),
    }


def embedding_request(input_: Any, **extra: Any) -> pb.CreateEmbeddingRequest:
    body = {"model": et.SERVED_MODEL_NAME, "input": input_, **extra}
    return pb.CreateEmbeddingRequest(request=json_format.ParseDict(body, pb.EmbeddingRequest()))


def floats(response: pb.CreateEmbeddingResponse) -> Any:
    return np.array(
        [[v.number_value for v in d.embedding.list_value.values] for d in response.data]
    )


@pytest.mark.parametrize("transport", ["inproc", "http-completions"])
def test_a_replica_serves_embeddings_equal_to_the_transformers_reference(
    tmp_path: Path, transport: str, reference: dict[str, Any]
) -> None:
    spec = embed_tiny_spec()
    spec.transport = transport
    spec.dtype = "float32"
    spec.kv_cache_bytes = 1 << 30
    plan = plan_launch("e2e-embed", spec, data_dir=tmp_path, cpu=True)

    async def run() -> None:
        process = await ProcessSpawner().spawn(plan)
        assert isinstance(process, EngineProcess)
        try:
            await _scenario(process, plan.inference_address, reference, transport)
        except BaseException:
            print(plan.log_path.read_text(errors="replace")[-6000:])
            raise
        finally:
            code = await process.stop(20)
        assert code == 0, f"the replica exited with {code} on SIGTERM"

    asyncio.run(run())


async def _scenario(
    process: EngineProcess, address: str, reference: dict[str, Any], transport: str
) -> None:
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = None
        while status != health_pb2.HealthCheckResponse.SERVING:
            assert process.returncode is None, "the replica exited during start-up"
            assert time.monotonic() - started < READY_SECONDS, "not ready in time"
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
            except grpc.aio.AioRpcError:
                status = None
            await asyncio.sleep(0.5)
        print(f"\n[{transport}] replica_ready_seconds: {time.monotonic() - started:.1f}")
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        # Three strings: the reference vectors, in order, with their token counts.
        call = stub.CreateEmbedding(embedding_request(TEXTS, encoding_format="float"))
        response = await call
        assert response.object == "list" and response.model == et.SERVED_MODEL_NAME
        assert [d.index for d in response.data] == [0, 1, 2]
        np.testing.assert_allclose(floats(response), reference["full"], atol=ATOL)
        tokens = sum(len(i) for i in reference["ids"])
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
        summary = ResponseSummary.from_metadata(tuple(await call.trailing_metadata()))
        assert (summary.replica_id, summary.prompt_tokens, summary.finish_reason) == (
            "e2e-embed",
            tokens,
            "stop",
        )
        assert summary.completion_tokens == 0 and 0 < summary.ttft_seconds < 30

        # Token ids are embedded as given (these already hold [CLS] … [SEP]).
        single = await stub.CreateEmbedding(embedding_request(reference["ids"][0]))
        np.testing.assert_allclose(floats(single)[0], reference["full"][0], atol=ATOL)
        assert single.usage.prompt_tokens == len(reference["ids"][0])
        lists = await stub.CreateEmbedding(embedding_request(reference["ids"][:2]))
        np.testing.assert_allclose(floats(lists), reference["full"][:2], atol=ATOL)

        # base64: little-endian float32 of the same numbers.
        encoded = await stub.CreateEmbedding(embedding_request(TEXTS, encoding_format="base64"))
        decoded = np.array(
            [np.frombuffer(base64.b64decode(d.embedding.string_value), "<f4") for d in encoded.data]
        )
        np.testing.assert_array_equal(decoded, floats(response).astype(np.float32))

        # Matryoshka: 16 values, normalised after the cut.
        cut = floats(await stub.CreateEmbedding(embedding_request(TEXTS, dimensions=16)))
        assert cut.shape == (3, 16)
        np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(cut, reference["16"], atol=ATOL)

        # Refusals: a size the model does not list; the chat API on an embedding model.
        for bad, param in (
            (stub.CreateEmbedding(embedding_request(TEXTS[0], dimensions=48)), "dimensions"),
            (
                stub.CreateChatCompletion(
                    pb.CreateChatCompletionRequest(
                        request=chat_request_from_dict(
                            {
                                "model": et.SERVED_MODEL_NAME,
                                "messages": [{"role": "user", "content": "hi"}],
                            }
                        )
                    )
                ),
                "model",
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await bad
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(info.value.trailing_metadata())["x-openai-error-param"] == param

        for size in (1, 32):
            texts = [f"{TEXTS[i % 3]} {i}" for i in range(size)]
            request = embedding_request(texts)
            await stub.CreateEmbedding(request)  # warm-up
            seconds = []
            for _ in range(LATENCY_REPEATS):
                t0 = time.perf_counter()
                result = await stub.CreateEmbedding(request)
                seconds.append(time.perf_counter() - t0)
                assert len(result.data) == size
            seconds.sort()
            print(
                f"[{transport}] create_embedding_ms inputs={size}: "
                f"median {statistics.median(seconds) * 1e3:.1f} "
                f"p90 {seconds[int(0.9 * len(seconds))] * 1e3:.1f} "
                f"min {seconds[0] * 1e3:.1f} (n={LATENCY_REPEATS})"
            )

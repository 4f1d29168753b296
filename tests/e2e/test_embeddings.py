"""Embeddings end to end (issue 19): the official `openai` client through the edge (mTLS
services, ext_authz, the endpoint picker) to the embed-tiny replica (vLLM's pooling runner in
the replica process), served beside kimi-tiny and routed by `model`. The module has its own
stack (both models), gone before the session's stack starts: an idle CPU engine still costs
CPU, and the other end-to-end tests need both cores."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest

from inferplane.fixtures import embed_tiny
from inferplane.localstack import EMBED_MODEL_NAME, MODEL_NAME, Stack, running_stack

from .conftest import local_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def embed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = local_config(tmp_path_factory.mktemp("embed-stack"), embeddings=True)
    with running_stack(config, print) as stack:
        yield stack


@pytest.fixture(scope="module")
def embed_key(embed_stack: Stack) -> str:
    return embed_stack.create_api_key("e2e-embeddings")


@pytest.fixture(scope="module")
def client(embed_stack: Stack, embed_key: str) -> openai.OpenAI:
    """The module's own client (shadows the session's): the embeddings stack's edge."""
    return openai.OpenAI(
        base_url=embed_stack.config.base_url, api_key=embed_key, max_retries=0, timeout=120
    )


def test_models_lists_the_chat_and_the_embedding_model(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {MODEL_NAME, EMBED_MODEL_NAME} <= ids
    assert client.models.retrieve(EMBED_MODEL_NAME).id == EMBED_MODEL_NAME


def test_embeddings_match_the_reference_in_input_order(client: openai.OpenAI) -> None:
    """Strings, one token-id list, and the openai client's default (base64) all give the
    transformers reference vectors, in input order, with the inputs' token counts as usage."""
    texts = ["the weather in paris", "hello", "a lazy dog sleeps in the sun all day"]
    response = client.embeddings.create(model=EMBED_MODEL_NAME, input=texts)
    assert response.model == EMBED_MODEL_NAME and response.object == "list"
    assert [d.index for d in response.data] == [0, 1, 2]
    reference = embed_tiny.reference_embeddings(texts).tolist()
    for got, want in zip(response.data, reference, strict=True):
        assert len(got.embedding) == embed_tiny.EMBEDDING_DIM
        assert max(abs(a - b) for a, b in zip(got.embedding, want, strict=True)) < 1e-4
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(texts)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embed_tiny.model_path()))
    ids = tokenizer(texts[0])["input_ids"]
    by_tokens = client.embeddings.create(model=EMBED_MODEL_NAME, input=ids)
    assert (
        max(abs(a - b) for a, b in zip(by_tokens.data[0].embedding, reference[0], strict=True))
        < 1e-4
    )


def test_float_and_base64_formats_and_dimensions(embed_stack: Stack, embed_key: str) -> None:
    """Raw HTTP: `float` is a list of numbers, `base64` little-endian float32 of the same
    values; `dimensions` 16 gives 16 values of unit length; an unsupported size is a 400
    naming `dimensions`."""
    url = f"{embed_stack.config.base_url}/embeddings"
    headers = {"authorization": f"Bearer {embed_key}"}
    body = {"model": EMBED_MODEL_NAME, "input": "hello"}
    floats = httpx.post(url, json={**body, "encoding_format": "float"}, headers=headers).json()
    vector = floats["data"][0]["embedding"]
    packed = httpx.post(url, json={**body, "encoding_format": "base64"}, headers=headers).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert max(abs(a - b) for a, b in zip(vector, decoded, strict=True)) < 1e-6
    short = httpx.post(url, json={**body, "dimensions": 16}, headers=headers).json()
    values = short["data"][0]["embedding"]
    assert len(values) == 16 and abs(sum(v * v for v in values) - 1.0) < 1e-4
    bad = httpx.post(url, json={**body, "dimensions": 20}, headers=headers)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "dimensions"


def test_wrong_model_kind_and_bad_input_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input="hello")
    assert info.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=EMBED_MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=EMBED_MODEL_NAME, input=[])
    assert info.value.body["param"] == "input"  # type: ignore[index]

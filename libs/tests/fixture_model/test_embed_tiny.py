"""The embedding fixture model ``embed-tiny`` (models/embed-tiny, built by
models/build_embed_tiny.py): the committed folder is what its MANIFEST says and what the script
builds, it loads with transformers and embeds to 64 unit-norm values; served by vLLM (e2e),
`/v1/embeddings` gives the transformers reference for strings, lists, token ids, base64 and
Matryoshka `dimensions`."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from fixture_build import assert_rebuilds_identically, folder_digests

from inferplane.fixtures import embed_tiny as et

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
MAX_FOLDER_BYTES = 5 * 1024 * 1024
ATOL = 1e-5  # vLLM's fp32 CPU kernels vs transformers: measured differences ~1e-7


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((et.model_path() / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(et.model_path()))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return transformers.AutoModel.from_pretrained(str(et.model_path()), dtype=torch.float32).eval()


def test_folder_matches_manifest(manifest: dict) -> None:
    folder = et.model_path()
    assert folder_digests(folder) == manifest["sha256"]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < MAX_FOLDER_BYTES
    assert manifest["embedding_dim"] == et.EMBEDDING_DIM
    assert manifest["matryoshka_dimensions"] == list(et.MATRYOSHKA_DIMENSIONS)


def test_rebuild_gives_the_same_bytes(tmp_path: Path) -> None:
    """The build is deterministic: with the library versions of the committed build, the
    script reproduces every file (MANIFEST.json included)."""
    assert_rebuilds_identically(
        REPO / "models" / "build_embed_tiny.py", et.model_path(), tmp_path / "embed-tiny"
    )


def test_vllm_pooling_files() -> None:
    """What vLLM reads to pick mean pooling + normalisation and the Matryoshka dimensions."""
    folder = et.model_path()
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == [
        "Transformer",
        "Pooling",
        "Normalize",
    ]
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    assert [k for k, v in pooling.items() if v is True] == ["pooling_mode_mean_tokens"]
    config = json.loads((folder / "config.json").read_text())
    assert config["matryoshka_dimensions"] == list(et.MATRYOSHKA_DIMENSIONS)
    assert config["max_position_embeddings"] == et.MAX_MODEL_LEN
    # vLLM's CPU attention has kernels for head sizes 32, 64, ... only.
    assert config["hidden_size"] // config["num_attention_heads"] >= 32


def test_tokenizer(tokenizer) -> None:
    ids = tokenizer("Hello world")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "hello", "world", "[SEP]"]
    unk = tokenizer.convert_tokens_to_ids("[UNK]")
    for text in [*et.SAMPLE_TEXTS, "Zygomorphic xylophones, quizzically!"]:
        assert unk not in tokenizer(text)["input_ids"], text
    assert tokenizer.model_max_length == et.MAX_MODEL_LEN


def test_embeddings_shape_and_norm(model, tokenizer) -> None:
    batch = tokenizer(list(et.SAMPLE_TEXTS), padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape == (len(et.SAMPLE_TEXTS), batch["input_ids"].shape[1], et.EMBEDDING_DIM)
    vectors = et.reference_embeddings(et.SAMPLE_TEXTS, model=model, tokenizer=tokenizer)
    assert vectors.shape == (len(et.SAMPLE_TEXTS), et.EMBEDDING_DIM)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(len(et.SAMPLE_TEXTS)), atol=1e-6)
    # Different texts, different vectors; the same text alone or batched, the same vector.
    assert float(vectors[0] @ vectors[1]) < 0.99
    alone = et.reference_embeddings(et.SAMPLE_TEXTS[:1], model=model, tokenizer=tokenizer)
    assert torch.allclose(alone[0], vectors[0], atol=1e-6)
    cut = et.reference_embeddings(et.SAMPLE_TEXTS, dimensions=16, model=model, tokenizer=tokenizer)
    assert cut.shape == (len(et.SAMPLE_TEXTS), 16)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_served_by_vllm(vllm_server, model, tokenizer) -> None:
    """`vllm serve` with `embed_tiny.serve_args()`; `/v1/embeddings` through the official
    `openai` client (and raw HTTP for base64) returns the transformers reference vectors."""
    import httpx
    import numpy as np
    import openai

    texts = list(et.SAMPLE_TEXTS)
    reference = et.reference_embeddings(texts, model=model, tokenizer=tokenizer).numpy()
    started = time.monotonic()
    with vllm_server(et.serve_args()) as base_url:
        print(f"embed-tiny ready in {time.monotonic() - started:.1f} s")
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)

        def create(**kwargs):
            return client.embeddings.create(model=et.SERVED_MODEL_NAME, **kwargs)

        one = create(input=texts[0], encoding_format="float")
        assert one.model == et.SERVED_MODEL_NAME
        assert one.usage.prompt_tokens == len(tokenizer(texts[0])["input_ids"])
        np.testing.assert_allclose(one.data[0].embedding, reference[0], atol=ATOL)

        many = create(input=texts, encoding_format="float")
        assert [d.index for d in many.data] == list(range(len(texts)))
        np.testing.assert_allclose([d.embedding for d in many.data], reference, atol=ATOL)

        # Token ids are embedded as given: vLLM adds no [CLS]/[SEP] to them.
        ids = [tokenizer(t)["input_ids"] for t in texts[:2]]
        single = create(input=ids[0], encoding_format="float")
        np.testing.assert_allclose(single.data[0].embedding, reference[0], atol=ATOL)
        batch = create(input=ids, encoding_format="float")
        np.testing.assert_allclose([d.embedding for d in batch.data], reference[:2], atol=ATOL)

        # base64: little-endian float32 bytes (the openai client asks for it by default and
        # decodes it; check the wire format itself too).
        raw = httpx.post(
            base_url + "/v1/embeddings",
            json={"model": et.SERVED_MODEL_NAME, "input": texts[0], "encoding_format": "base64"},
        )
        raw.raise_for_status()
        decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
        np.testing.assert_allclose(decoded, reference[0], atol=ATOL)
        default = create(input=texts[0])
        np.testing.assert_allclose(default.data[0].embedding, reference[0], atol=ATOL)

        # Matryoshka: cut to the first `dimensions` values, then normalised.
        for dims in et.MATRYOSHKA_DIMENSIONS:
            cut = create(input=texts, encoding_format="float", dimensions=dims)
            expected = et.reference_embeddings(
                texts, dimensions=dims, model=model, tokenizer=tokenizer
            ).numpy()
            np.testing.assert_allclose([d.embedding for d in cut.data], expected, atol=ATOL)
        with pytest.raises(openai.BadRequestError, match="Matryoshka dimensions"):
            create(input=texts[0], dimensions=48)

        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            create(input=" ".join(["word"] * et.MAX_MODEL_LEN))

"""Constants for the embedding fixture model ``embed-tiny``: where it lives, how vLLM serves it,
and a reference implementation of its embeddings (transformers) to compare served vectors with.

``models/build_embed_tiny.py`` builds the folder: a random-initialised ``BertModel`` (hidden 64,
2 layers, 512 positions) with a local WordPiece tokenizer, mean pooling and L2 normalisation
(sentence-transformers ``modules.json``, which vLLM reads), Matryoshka dimensions 16/32/64.

Importing this module loads no ML library; :func:`reference_embeddings` imports torch and
transformers when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferplane.testing._fixtures import fixture_model_path

ENV_VAR = "INFERPLANE_EMBED_TINY"
"""Environment variable that overrides the model directory."""

SERVED_MODEL_NAME = "embed-tiny"

EMBEDDING_DIM = 64
"""Length of a full embedding vector (the model's hidden size)."""

MATRYOSHKA_DIMENSIONS: tuple[int, ...] = (16, 32, EMBEDDING_DIM)
"""The values of the OpenAI ``dimensions`` field vLLM accepts for this model (config.json's
``matryoshka_dimensions``); any other value is a 400."""

MAX_MODEL_LEN = 512
"""Tokens per input, ``[CLS]`` and ``[SEP]`` included (the model's position table)."""

ENGINE_ARGS: tuple[str, ...] = (
    "--runner",
    "pooling",
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--enforce-eager",
)
"""`vllm serve MODEL` arguments that serve the fixture on CPU (with the node-agent's engine
launcher, or any `vllm` whose version lookup works); see :func:`serve_args`."""

SAMPLE_TEXTS: tuple[str, ...] = (
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings for tiny tests: 42 vectors, 3.14 seconds!",
)
"""English texts the build checks tokenize without ``[UNK]``."""


def model_path() -> Path:
    """The fixture model directory: ``$INFERPLANE_EMBED_TINY`` if set, else the repo's copy.

    Raises:
        FileNotFoundError: the directory has no ``config.json``; the message names the
            variable to set.
    """
    return fixture_model_path(SERVED_MODEL_NAME, ENV_VAR)


def serve_args(path: Path | None = None) -> list[str]:
    """``serve MODEL --served-model-name embed-tiny`` plus :data:`ENGINE_ARGS` (the arguments of
    the `vllm` CLI; add ``--host``/``--port``)."""
    return [
        "serve",
        str(path or model_path()),
        "--served-model-name",
        SERVED_MODEL_NAME,
        *ENGINE_ARGS,
    ]


def reference_embeddings(
    texts: Sequence[str],
    *,
    dimensions: int | None = None,
    model: Any = None,
    tokenizer: Any = None,
) -> Any:
    """What vLLM should return for `texts`, computed with transformers in fp32.

    Mean of the last hidden states over every token of each input (``[CLS]`` and ``[SEP]``
    included, padding excluded), cut to the first `dimensions` values when given, then
    L2-normalised: the order of vllm/model_executor/layers/pooler/seqwise/heads.py.

    Args:
        texts: the inputs, each at most :data:`MAX_MODEL_LEN` tokens.
        dimensions: one of :data:`MATRYOSHKA_DIMENSIONS`, or None for all.
        model, tokenizer: already loaded ones (``AutoModel``/``AutoTokenizer`` of the fixture);
            loaded from :func:`model_path` when None.

    Returns:
        A float32 ``torch.Tensor`` of shape ``(len(texts), dimensions or EMBEDDING_DIM)``, rows
        of unit L2 norm.
    """
    import torch
    from transformers import AutoModel, AutoTokenizer

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path()))
    if model is None:
        model = AutoModel.from_pretrained(str(model_path()), dtype=torch.float32).eval()
    batch = tokenizer(list(texts), padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)

"""OpenAI embeddings request → what the engine embeds, and its vectors → OpenAI's response.

What `POST /v1/embeddings` accepts (OpenAI's API reference, vLLM 0.32's `EmbeddingRequest` where
OpenAI says nothing), each rule a 400 (INVALID_ARGUMENT) naming its `param`:

- `input`: a string, an array of strings, an array of token ids, or an array of token-id
  arrays; each string or array is one input, none empty, at most `MAX_INPUTS` (2,048) per
  request; token ids are integers of the model's vocabulary. Strings are tokenized with the
  model's tokenizer *with* its special tokens (`[CLS] … [SEP]` for BERT: what vLLM does,
  `add_special_tokens` defaults to true for embeddings); token ids are embedded as given. An
  input longer than the model's context is refused (`context_length_exceeded`), never
  truncated: as vLLM, an input may use the whole context (no output tokens).
- `dimensions`: only for models trained to be cut (Matryoshka: config.json's
  `matryoshka_dimensions` / `is_matryoshka`, `ModelAssets.matryoshka_dimensions`), and only
  those sizes; any value for another model, its full size included, is refused (vLLM refuses
  it too). The engine cuts the pooled vector, then normalises it.
- `encoding_format`: "float" (the default: numbers) or "base64" (the vector's little-endian
  float32 bytes, base64: what OpenAI and vLLM send, and what the `openai` client decodes).
- `user` is accepted and ignored.
"""

from __future__ import annotations

import base64
import dataclasses
import sys
from array import array
from collections.abc import Sequence

from google.protobuf import struct_pb2

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.replica.pipeline.assets import ModelAssets
from inferplane.replica.pipeline.fields import EMBEDDING_FIELDS, refuse_unserved, set_fields
from inferplane.runtime import InvalidArgumentError

MAX_INPUTS = 2048
"""Inputs per request (OpenAI: "any array must be 2048 dimensions or less")."""
FLOAT, BASE64 = "float", "base64"
ENCODING_FORMATS: tuple[str, ...] = (FLOAT, BASE64)
THREAD_BYTES = 64 * 1024
"""`input` larger than this (serialized) is parsed and tokenized in a worker thread, so that
a 2,048-input batch does not stall the replica's event loop (`needs_thread`)."""

_SHAPES = "a string, an array of strings, an array of token ids, or an array of token-id arrays"


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingPlan:
    """A validated embeddings request, ready for `EngineClient.embed`.

    Attributes:
        inputs: each input's token ids, in request order.
        dimensions: the Matryoshka size asked for, None for the model's full size.
        encoding_format: "float" or "base64".
    """

    inputs: tuple[tuple[int, ...], ...]
    dimensions: int | None
    encoding_format: str

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every input together (OpenAI's usage; vLLM counts the same)."""
        return sum(len(ids) for ids in self.inputs)


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidArgumentError:
    return InvalidArgumentError(message, param=param, code=code)


def needs_thread(request: pb.EmbeddingRequest) -> bool:
    """True when `plan_embedding` should run off the event loop (a large `input`)."""
    return request.input.ByteSize() > THREAD_BYTES


def plan_embedding(request: pb.EmbeddingRequest, assets: ModelAssets) -> EmbeddingPlan:
    """Validates `request` for `assets`' model and tokenizes its strings (see the module
    docstring for the rules). Thread-safe: the tokenizer's backend encodes without state.

    Raises:
        InvalidArgumentError: the request breaks a rule (`param` is input, dimensions or
            encoding_format; code `context_length_exceeded` for an input beyond the context,
            `unsupported_parameter` for `dimensions` on a model without Matryoshka sizes,
            else `invalid_value`).
    """
    refuse_unserved(set_fields(request, skip=("input",)), EMBEDDING_FIELDS)
    encoding = request.encoding_format or FLOAT
    if encoding not in ENCODING_FORMATS:
        raise _bad(
            f"'encoding_format' must be 'float' or 'base64'; got {encoding!r}", "encoding_format"
        )
    dimensions = request.dimensions if request.HasField("dimensions") else None
    if dimensions is not None:
        allowed = assets.matryoshka_dimensions
        if not allowed:
            raise _bad(
                "This model does not support 'dimensions': its embeddings cannot be shortened "
                "(it lists no Matryoshka dimensions); leave 'dimensions' unset.",
                "dimensions",
                code="unsupported_parameter",
            )
        if dimensions not in allowed:
            raise _bad(
                f"'dimensions' must be one of this model's Matryoshka dimensions "
                f"({_sizes(allowed)}); got {dimensions}",
                "dimensions",
            )
    inputs = _token_inputs(request.input, assets)
    limit = assets.max_model_len
    for index, ids in enumerate(inputs):
        if len(ids) > limit:
            which = "input" if len(inputs) == 1 else f"input {index}"
            raise _bad(
                f"This model's maximum context length is {limit} tokens. However, {which} "
                f"resulted in {len(ids)} tokens. Please reduce the length of the input.",
                "input",
                code="context_length_exceeded",
            )
    return EmbeddingPlan(inputs=inputs, dimensions=dimensions, encoding_format=encoding)


def _sizes(allowed: tuple[int, ...]) -> str:
    if len(allowed) > 8 and allowed == tuple(range(allowed[0], allowed[-1] + 1)):
        return f"{allowed[0]} to {allowed[-1]}"
    return ", ".join(str(d) for d in allowed)


def _token_inputs(value: struct_pb2.Value, assets: ModelAssets) -> tuple[tuple[int, ...], ...]:
    """`input` as token ids per input: strings tokenized (special tokens added), token ids
    checked against the vocabulary."""
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        raise _bad("'input' is required", "input")
    if kind == "string_value":
        return _tokenize([_text(value.string_value, None)], assets)
    if kind != "list_value":
        raise _bad(f"'input' must be {_SHAPES}", "input")
    items = value.list_value.values
    if not items:
        raise _bad("'input' must not be an empty array", "input")
    first = items[0].WhichOneof("kind")
    if first == "number_value":  # one input given as token ids
        return (_token_ids(items, None, assets),)
    if len(items) > MAX_INPUTS:
        raise _bad(
            f"'input' has {len(items)} items; at most {MAX_INPUTS} inputs are allowed per request",
            "input",
        )
    if first == "string_value":
        texts = []
        for index, item in enumerate(items):
            if item.WhichOneof("kind") != "string_value":
                raise _bad(f"'input' must be {_SHAPES}; item {index} is not a string", "input")
            texts.append(_text(item.string_value, index))
        return _tokenize(texts, assets)
    if first == "list_value":
        out = []
        for index, item in enumerate(items):
            if item.WhichOneof("kind") != "list_value":
                raise _bad(f"'input' must be {_SHAPES}; item {index} is not an array", "input")
            out.append(_token_ids(item.list_value.values, index, assets))
        return tuple(out)
    raise _bad(f"'input' must be {_SHAPES}", "input")


def _text(text: str, index: int | None) -> str:
    if not text:
        where = "'input'" if index is None else f"'input' item {index}"
        raise _bad(f"{where} must not be an empty string", "input")
    return text


def _token_ids(
    values: Sequence[struct_pb2.Value], index: int | None, assets: ModelAssets
) -> tuple[int, ...]:
    """One input's token ids. JSON numbers reach the proto as doubles, so an integer is a
    double without a fraction (1.0 and 1 are the same token, as in JSON)."""
    where = "'input'" if index is None else f"'input' item {index}"
    if not values:
        raise _bad(f"{where} must not be an empty array", "input")
    vocab = assets.vocab_size
    ids = []
    for value in values:
        number = value.number_value
        if value.WhichOneof("kind") != "number_value" or not number.is_integer():
            shown = number if value.WhichOneof("kind") == "number_value" else "a non-number"
            raise _bad(f"{where} must hold integer token ids; got {shown}", "input")
        if not 0 <= number < vocab:
            raise _bad(
                f"{where} holds token id {int(number)}, outside the model's vocabulary "
                f"(0 to {vocab - 1})",
                "input",
            )
        ids.append(int(number))
    return tuple(ids)


def _tokenize(texts: list[str], assets: ModelAssets) -> tuple[tuple[int, ...], ...]:
    # The fast backend directly: the ids transformers' tokenizer gives with
    # add_special_tokens=True (assets.py turns off any truncation tokenizer.json set).
    encodings = assets.backend.encode_batch(texts, add_special_tokens=True)
    return tuple(tuple(e.ids) for e in encodings)


def embedding_response(
    vectors: Sequence[array[float]], plan: EmbeddingPlan, model: str
) -> pb.CreateEmbeddingResponse:
    """OpenAI's response: `object` "list", one `embedding` per input in input order (`index`),
    numbers or base64 of little-endian float32 bytes by `plan.encoding_format`, `model`, and
    usage (`prompt_tokens` = `total_tokens` = every input's tokens)."""
    tokens = plan.prompt_tokens
    response = pb.CreateEmbeddingResponse(
        object="list",
        model=model,
        usage=pb.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    base64_format = plan.encoding_format == BASE64
    for index, vector in enumerate(vectors):
        item = response.data.add(object="embedding", index=index)
        if base64_format:
            item.embedding.string_value = base64.b64encode(_le_bytes(vector)).decode("ascii")
        else:
            item.embedding.list_value.MergeFromString(_list_value_bytes(vector))
    return response


_NUMBER_ENTRY = b"\x0a\x09\x11"
"""ListValue.values entry (field 1, 9 bytes long) holding a Value whose number_value (field 2,
a 64-bit double) follows."""


def _list_value_bytes(vector: array[float]) -> bytes:
    """The serialized `google.protobuf.ListValue` of `vector`'s numbers. Written by hand
    because `ListValue.extend` costs ~0.5 µs per number (16 ms for 32 vectors of 1,024) and
    this a quarter of it; the parse that takes it in is upb's."""
    doubles = array("d", vector)
    if sys.byteorder != "little":
        doubles.byteswap()
    raw = doubles.tobytes()
    return b"".join([_NUMBER_ENTRY + raw[i : i + 8] for i in range(0, len(raw), 8)])


def _le_bytes(vector: array[float]) -> bytes:
    """The vector as little-endian float32 bytes (`array("f")` is the machine's order)."""
    if vector.typecode != "f":
        vector = array("f", vector)
    if sys.byteorder == "little":
        return vector.tobytes()
    swapped = array("f", vector)
    swapped.byteswap()
    return swapped.tobytes()

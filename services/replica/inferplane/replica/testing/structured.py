"""Strict `json_schema` requests against a real vLLM engine in this process, and their verdicts:
the harness `tests` (e2e) and `bench/structured_output_validity.py` share.

`serve_inproc(spec)` starts vLLM's AsyncLLM in-process (`InprocEngine`, CPU, the platform's
engine environment) behind the replica's own server on a loopback port and yields a client
stub; `schema_requests` draws random object schemas (`inferplane.testing.tool_schemas`) and
asks for each as a strict `response_format`, half with thinking on; `verdict` says what the
response is: `valid` (content parses and validates against the schema), `length` (cut by
max_tokens: allowed), `invalid` (anything else: what the guarantee rules out), and whether
marker or special-token text showed in the content.

Needs `hypothesis`, `jsonschema` and vLLM (the `dev` extra and the engine).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import jsonschema
from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica.pipeline.assets import Loader, ModelAssetsCache, load_model_assets
from inferplane.replica.testing.pipeline import FakeReplica, kimi_tiny_spec, serve_inference
from inferplane.testing.tool_schemas import draw, object_schemas
from inferplane.wire import chat_request_from_dict

PROMPTS = (
    "What is the weather in Tokyo?",
    "Convert 5 CHF to EUR.",
    "What time is it in Lima?",
    "Search the web for rust async runtimes.",
    "Tell me about Oslo.",
    "Create an event called design review.",
)
"""Questions in the kimi-tiny fixture's training phrasings (its answers are tool calls or
short texts, never JSON: the grammar is what makes them JSON)."""


def qwen3_tiny_spec(max_model_len: int = 2048) -> nodeagent_pb2.ReplicaSpec:
    """A replica spec for models/qwen3-tiny with the qwen3 parsers (fp32)."""
    from inferplane.fixtures import qwen3_tiny

    return nodeagent_pb2.ReplicaSpec(
        deployment=qwen3_tiny.SERVED_MODEL_NAME,
        served_model_name=qwen3_tiny.SERVED_MODEL_NAME,
        model_source=str(qwen3_tiny.model_path()),
        max_model_len=max_model_len,
        reasoning_parser=qwen3_tiny.PARSER,
        tool_parser=qwen3_tiny.PARSER,
        dtype="float32",
        revision="rev-1",
    )


def kimi_tiny_inproc_spec() -> nodeagent_pb2.ReplicaSpec:
    """kimi-tiny's spec for an in-process engine (fp32)."""
    spec = kimi_tiny_spec()
    spec.dtype = "float32"
    return spec


@asynccontextmanager
async def serve_inproc(
    spec: nodeagent_pb2.ReplicaSpec,
    *,
    loader: Loader = load_model_assets,
    kv_cache_bytes: int = 1 << 30,
    max_num_seqs: int = 8,
) -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    """The replica's server over a real in-process vLLM engine for `spec` (CPU; `loader`
    builds the model assets: tests and benches pass variants)."""
    from inferplane.replica.engines.environment import apply_engine_environment, patch_vllm_version

    apply_engine_environment(os.environ, cpu=True, cache_root=None)
    patch_vllm_version(True)
    from inferplane.replica.engines.inproc import InprocEngine, engine_argv
    from inferplane.replica.server import InferenceServicer

    spec.max_num_seqs = max_num_seqs
    engine = await InprocEngine.start(engine_argv(spec, cpu=True, kv_cache_bytes=kv_cache_bytes))
    try:
        servicer = InferenceServicer(
            FakeReplica("r1", spec, engine), ModelAssetsCache(loader=loader)
        )
        async with serve_inference(servicer) as stub:
            yield stub
    finally:
        await engine.close()


COUNTRY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "country": {"type": "string"},
        "summary": {"type": "string"},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["country", "summary", "population"],
    "additionalProperties": False,
}
"""Free strings, as in the request of issue 27's measurement: the fixture model writes text
into them, where an unfiltered grammar lets it write its markers too."""


def schema_requests(
    model: str, n: int, seed: int = 0, *, max_tokens: int = 256
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """`n` (request body, schema) pairs: `COUNTRY_SCHEMA` for every third, random object
    schemas for the others, as strict `response_format` json_schema; thinking on for even ones
    and off (`reasoning_effort: none`) for odd ones; sampled (temperature 1, seed i)."""
    out = []
    schemas = draw(object_schemas(max_length=40), n, seed)
    for i in range(0, n, 3):
        schemas[i] = COUNTRY_SCHEMA
    for i, schema in enumerate(schemas):
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"answer_{i}", "strict": True, "schema": schema},
            },
        }
        if i % 2:
            body["reasoning_effort"] = "none"
        out.append((body, schema))
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one response is.

    Attributes:
        outcome: `valid`, `length` (cut by max_tokens) or `invalid`.
        content_marker: a marker or special-token text showed in the content.
        reasoning_marker: one showed in the reasoning.
        finish_reason: the response's.
        content: its content.
    """

    outcome: str
    content_marker: bool
    reasoning_marker: bool
    finish_reason: str
    content: str


def verdict(
    response: pb.CreateChatCompletionResponse, schema: Any, markers: Sequence[str]
) -> Verdict:
    """The verdict on a unary chat response to a `schema` request (`markers`: the model's
    marker texts, `ModelAssets.marker_texts`)."""
    d = json_format.MessageToDict(response, preserving_proto_field_name=True)
    choice = d["choices"][0]
    message = choice.get("message", {})
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or ""
    finish = choice.get("finish_reason", "")
    try:
        jsonschema.validate(json.loads(content), schema)
        outcome = "valid"
    except (ValueError, jsonschema.ValidationError):
        outcome = "length" if finish == "length" else "invalid"
    return Verdict(
        outcome,
        any(m in content for m in markers),
        any(m in reasoning for m in markers),
        finish,
        content,
    )


async def ask(
    stub: inference_pb2_grpc.InferenceServiceStub, body: dict[str, Any]
) -> pb.CreateChatCompletionResponse:
    """One unary chat completion."""
    request = pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))
    return await stub.CreateChatCompletion(request)

"""The inproc engine's arguments carry the spec's KV cache dtype and speculative decoding
(issue 30) in a form vLLM's own engine-argument parser takes (`AsyncEngineArgs`)."""

from __future__ import annotations

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.fixtures import kimi_tiny
from inferplane.replica.engines.inproc import engine_args, engine_argv


def test_vllms_parser_takes_the_dtype_and_the_speculative_config() -> None:
    pytest.importorskip("vllm")
    model = str(kimi_tiny.model_path())  # the parser reads a real folder's config
    spec = nodeagent_pb2.ReplicaSpec(
        model_source=model,
        kv_cache_dtype="bf16",
        speculative=nodeagent_pb2.SpeculativeDecoding(
            method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1
        ),
    )
    parsed = engine_args(engine_argv(spec, cpu=True, kv_cache_bytes=1 << 20))
    assert parsed.kv_cache_dtype == "bfloat16"
    assert parsed.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    plain = engine_args(engine_argv(nodeagent_pb2.ReplicaSpec(model_source=model), cpu=True))
    assert plain.kv_cache_dtype == "auto" and plain.speculative_config is None

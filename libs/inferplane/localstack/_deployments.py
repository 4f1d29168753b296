"""The fixture deployments a local stack creates in the orchestrator's catalogue: kimi-tiny
(chat, Kimi K2 parsers), qwen3-tiny (`StackConfig.qwen3`: chat, Qwen3 parsers), embed-tiny
(`StackConfig.embeddings`) and whisper-tiny (`StackConfig.speech`), each on CPU replicas
(`engine: vllm-cpu`, fp32). Placement's sizing numbers come from each model folder's
`config.json` and `MANIFEST.json`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.fixtures import embed_tiny, qwen3_tiny, whisper_tiny
from inferplane.localstack._config import StackConfig, StackError

#: kimi-tiny's expected context per sequence when `StackConfig.expected_context_tokens` is 0:
#: 16 sequences × 65,536 tokens × 1 KiB of fp32 KV = a 1 GiB KV budget.
EXPECTED_CONTEXT = 65_536


def kimi_tiny_deployment(config: StackConfig) -> orchestrator_pb2.Deployment:
    """The kimi-tiny deployment the stack creates: `config.replicas` CPU replicas (`engine:
    vllm-cpu`, fp32), the Kimi K2 parsers, `config.transport`, `config.routing_policy`,
    `config.max_model_len`, `config.max_num_seqs`, `config.stream_interval`,
    `config.constrain_tool_choice_auto`, `config.sampling_defaults` (when set),
    `config.max_loras` / `config.max_lora_rank` (LoRA), one surge replica per rollout.

    Sizing numbers (layers, KV heads, head dim) come from the model's `config.json`, the
    parameter count from its `MANIFEST.json` (else the fp32 weights file size / 4 bytes).
    Placement's KV budget is `max_num_seqs` × `config.expected_context_tokens` (0:
    `min(max_model_len, 65,536)`) × 1 KiB (2 layers × 2 KV heads × 32 × K and V × 4 bytes of
    fp32 KV), at least one `max_model_len` sequence: 1 GiB at the defaults (16 sequences of
    65,536 tokens, i.e. 8 of the 131,072-token maximum), passed to vLLM in bytes.

    Raises:
        StackError: the model folder has no readable `config.json`, or `config.max_model_len`
            exceeds its `max_position_embeddings`.
    """
    model = config.model_path
    try:
        arch = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StackError(f"cannot read the fixture model's config.json in {model}: {exc}") from exc
    _check_context(config, arch, model)
    heads = int(arch["num_attention_heads"])
    parameters = 0
    with contextlib.suppress(OSError, ValueError, KeyError):
        parameters = int(json.loads((model / "MANIFEST.json").read_text())["parameters"])
    if not parameters:
        parameters = (model / "model.safetensors").stat().st_size // 4
    return orchestrator_pb2.Deployment(
        replicas=config.replicas,
        owned_by="inferplane",
        routing_policy=config.routing_policy,
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=parameters,
            num_layers=int(arch["num_hidden_layers"]),
            num_kv_heads=int(arch.get("num_key_value_heads") or heads),
            head_dim=int(arch.get("head_dim") or int(arch["hidden_size"]) // heads),
            max_model_len=config.max_model_len,
            expected_context_tokens=(
                config.expected_context_tokens or min(config.max_model_len, EXPECTED_CONTEXT)
            ),
            # The router caps in-flight requests per replica at this; the default 16 lets the
            # edge benchmark's concurrency-16 level run unqueued.
            max_num_seqs=config.max_num_seqs,
            reasoning_parser="kimi_k2",
            tool_parser="kimi_k2",
            transport=config.transport,
            stream_interval=config.stream_interval,
            constrain_tool_choice_auto=config.constrain_tool_choice_auto,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            sampling_defaults=(
                json_format.ParseDict(
                    dict(config.sampling_defaults), nodeagent_pb2.SamplingDefaults()
                )
                if config.sampling_defaults
                else None
            ),
        ),
        rollout=orchestrator_pb2.RolloutStrategy(max_surge=1, drain_grace_period_seconds=30),
    )


def _check_context(config: StackConfig, arch: dict[str, Any], model: object) -> None:
    limit = int(arch.get("max_position_embeddings") or 0)
    if not 0 < config.max_model_len <= limit:
        raise StackError(
            f"max_model_len {config.max_model_len} is not within 1..{limit}, the position "
            f"limit of {model} (config.json max_position_embeddings)"
        )


def qwen3_tiny_deployment(config: StackConfig) -> orchestrator_pb2.Deployment:
    """The qwen3-tiny deployment (`config.qwen3`): `qwen3_tiny.deployment()` (one `inproc` CPU
    replica, fp32, the `qwen3` parsers, 4 sequences) with `config.max_model_len`.

    Raises:
        StackError: `config.max_model_len` exceeds the model's position limit.
        FileNotFoundError: the model folder is missing (`qwen3_tiny.model_path`).
    """
    deployment = qwen3_tiny.deployment()
    model = qwen3_tiny.model_path()
    _check_context(config, json.loads((model / "config.json").read_text()), model)
    deployment.profile.max_model_len = config.max_model_len
    return deployment


def embed_tiny_deployment() -> orchestrator_pb2.Deployment:
    """The embed-tiny deployment (`config.embeddings`): one CPU replica of the fixture
    embedding model, task "embed", `inproc` (vLLM's pooling runner), least-load routing."""
    model = embed_tiny.model_path()
    manifest: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((model / "MANIFEST.json").read_text())
    return orchestrator_pb2.Deployment(
        replicas=1,
        owned_by="inferplane",
        routing_policy="least_load",
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=int(manifest.get("parameters") or 0) or 1,
            max_model_len=embed_tiny.MAX_MODEL_LEN,
            max_num_seqs=16,
            transport="inproc",
            task="embed",
        ),
    )


def whisper_tiny_deployment() -> orchestrator_pb2.Deployment:
    """The whisper-tiny deployment (`config.speech`): one CPU replica of the fixture speech
    model, task "transcribe", `inproc`, float32, least-load routing; placement sizes its
    decoder's KV cache (Whisper's decoder layers and heads, 448 positions)."""
    model = whisper_tiny.model_path()
    manifest: dict[str, Any] = {}
    arch: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((model / "MANIFEST.json").read_text())
        arch = json.loads((model / "config.json").read_text())
    heads = int(arch.get("decoder_attention_heads") or 1)
    return orchestrator_pb2.Deployment(
        replicas=1,
        owned_by="inferplane",
        routing_policy="least_load",
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=int(manifest.get("parameters") or 0) or 1,
            num_layers=int(arch.get("decoder_layers") or 1),
            num_kv_heads=heads,
            head_dim=int(arch.get("d_model") or heads) // heads,
            max_model_len=whisper_tiny.MAX_MODEL_LEN,
            max_num_seqs=16,
            transport="inproc",
            task="transcribe",
        ),
    )

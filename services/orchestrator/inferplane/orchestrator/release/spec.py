"""What a node-agent is asked to run: `ReplicaSpec` from a deployment's profile and one placement,
and the node-agent replica id of a (slot, revision) pair.

Replica ids carry the revision (`{slot}-{revision[:8]}`), so a rolling release starts the new
revision's replica beside the old one on the same node-agent (make before break), and an
orchestrator that lost its memory can tell from a node-agent's list which replica is which.
"""

from __future__ import annotations

import hashlib
import re

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.engine_features import speculation_to_proto
from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.convert import sampling_to_proto, task_enum, transport_enum
from inferplane.orchestrator.fleet.model import Node
from inferplane.orchestrator.placement.model import Placement

# vLLM's `--dtype` names for the unquantized precisions; quantized checkpoints carry their
# method in their config (vLLM detects AWQ/GPTQ/fp8/nvfp4), so they get no `--dtype`.
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_MAX_ID = 63  # node-agent replica ids are RFC 1123 labels


def agent_replica_id(slot: str, revision: str) -> str:
    """The node-agent replica id for desired replica `slot` (`{deployment}-{ordinal}`) at
    `revision`: lowercase letters, digits and '-', at most 63 characters.

    Deployment ids may hold upper case, '.' and '_' (node-agents accept none of them); long or
    rewritten ids keep 8 hex digits of the slot's SHA-256 so two slots never collide.
    """
    suffix = revision[:8] or "0"
    base = re.sub(r"[^a-z0-9-]+", "-", slot.lower()).strip("-") or "replica"
    room = _MAX_ID - len(suffix) - 1
    if base != slot or len(base) > room:
        digest = hashlib.sha256(slot.encode()).hexdigest()[:8]
        base = f"{base[: room - 9].rstrip('-')}-{digest}"
    return f"{base}-{suffix}"


def build_spec(
    deployment: Deployment,
    profile: DeploymentProfile,
    revision: str,
    placement: Placement,
    node: Node | None,
    *,
    lora_root: str = "",
) -> nodeagent_pb2.ReplicaSpec:
    """The spec of one replica.

    Args:
        deployment: names, owner and creation time (`created` in /v1/models).
        profile: the profile to run (the deployment's, or the serving one during a rollback).
        revision: `profile.revision()`; node-agents report it back and rollouts compare it.
        placement: node, GPU indices, memory fraction (`--gpu-memory-utilization`) and the KV
            budget in bytes (a CPU engine's KV cache size).
        node: the placement's node, for the GPUs' UUIDs (None: unknown, no UUIDs).
        lora_root: the orchestrator's adapter root, sent (with `max_loras` and
            `max_lora_rank`) when the profile serves LoRA adapters.

    The KV cache dtype and speculative decoding (issue 30) are sent as typed fields, the
    speculative defaults resolved (`inferplane.engine_features`); the engine gets
    `--kv-cache-dtype` and `--speculative-config` from them.

    Task and transport are sent in both spellings, the deprecated strings (what node-agents
    older than the enums read) and `replica_task` / `replica_transport`.
    """
    uuids = {g.index: g.uuid for g in node.gpus} if node is not None else {}
    created = deployment.create_time
    return nodeagent_pb2.ReplicaSpec(
        deployment=deployment.deployment_id,
        served_model_name=deployment.deployment_id,
        model_source=profile.model_source,
        engine=profile.engine,
        engine_version=profile.engine_version,
        dtype=_DTYPES.get(profile.precision, ""),
        tensor_parallel_size=profile.tensor_parallel_size,
        max_model_len=profile.max_model_len,
        max_num_seqs=profile.max_num_seqs,
        gpu_indices=list(placement.gpu_indices),
        gpu_memory_fraction=placement.memory_fraction if placement.gpu_indices else 0.0,
        kv_cache_bytes=placement.kv_cache_bytes,
        reasoning_parser=profile.reasoning_parser,
        tool_parser=profile.tool_parser,
        transport=profile.transport,
        stream_interval=profile.stream_interval,
        constrain_tool_choice_auto=profile.constrain_tool_choice_auto,
        extra_engine_args=list(profile.extra_engine_args),
        task=profile.task,
        replica_task=task_enum(profile.task),
        replica_transport=transport_enum(profile.transport),
        revision=revision,
        gpu_uuids=[uuids.get(i, "") for i in placement.gpu_indices] if uuids else [],
        created=int(created.timestamp()) if created is not None else 0,
        owned_by=deployment.owned_by,
        sampling_defaults=sampling_to_proto(profile.sampling_defaults)
        if profile.sampling_defaults
        else None,
        max_loras=profile.max_loras,
        max_lora_rank=profile.max_lora_rank if profile.max_loras else 0,
        lora_root=lora_root if profile.max_loras else "",
        kv_cache_dtype=profile.kv_cache_dtype,
        speculative=speculation_to_proto(profile.speculation),
    )

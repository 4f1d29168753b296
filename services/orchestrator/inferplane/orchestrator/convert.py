"""Proto ⇄ domain conversions for the orchestrator (no logic beyond field mapping)."""

from __future__ import annotations

from datetime import datetime

from google.protobuf import timestamp_pb2

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.orchestrator.catalog.model import (
    DEFAULT_CONSTRAIN_TOOL_CHOICE_AUTO,
    Deployment,
    DeploymentProfile,
    RolloutStrategy,
)
from inferplane.orchestrator.control import DeploymentView, ObservedReplica
from inferplane.orchestrator.fleet.model import Gpu, GpuPartition, Node
from inferplane.orchestrator.placement.model import Placement, Unplaced

pb = orchestrator_pb2


def _ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def profile_from_proto(p: pb.DeploymentProfile) -> DeploymentProfile:
    return DeploymentProfile(
        model_source=p.model_source,
        engine=p.engine,
        engine_version=p.engine_version,
        precision=p.precision,
        parameter_count=p.parameter_count,
        active_parameter_count=p.active_parameter_count,
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        kv_cache_dtype=p.kv_cache_dtype,
        tensor_parallel_size=p.tensor_parallel_size,
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs,
        expected_context_tokens=p.expected_context_tokens,
        reasoning_parser=p.reasoning_parser,
        tool_parser=p.tool_parser,
        speculative_method=p.speculative_method,
        speculative_model=p.speculative_model,
        transport=p.transport,
        stream_interval=p.stream_interval,
        constrain_tool_choice_auto=(
            p.constrain_tool_choice_auto
            if p.HasField("constrain_tool_choice_auto")
            else DEFAULT_CONSTRAIN_TOOL_CHOICE_AUTO
        ),
        extra_engine_args=tuple(p.extra_engine_args),
        task=p.task,
    )


def profile_to_proto(p: DeploymentProfile) -> pb.DeploymentProfile:
    return pb.DeploymentProfile(
        model_source=p.model_source,
        engine=p.engine,
        engine_version=p.engine_version,
        precision=p.precision,
        parameter_count=p.parameter_count,
        active_parameter_count=p.active_parameter_count,
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        kv_cache_dtype=p.kv_cache_dtype,
        tensor_parallel_size=p.tensor_parallel_size,
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs,
        expected_context_tokens=p.expected_context_tokens,
        reasoning_parser=p.reasoning_parser,
        tool_parser=p.tool_parser,
        speculative_method=p.speculative_method,
        speculative_model=p.speculative_model,
        transport=p.transport,
        stream_interval=p.stream_interval,
        constrain_tool_choice_auto=p.constrain_tool_choice_auto,
        extra_engine_args=list(p.extra_engine_args),
        task=p.task,
    )


def deployment_from_proto(d: pb.Deployment, deployment_id: str) -> Deployment:
    """The domain deployment; `rollout` unset in the request means the default strategy."""
    r = d.rollout
    rollout = (
        RolloutStrategy(
            max_surge=r.max_surge,
            max_unavailable=r.max_unavailable,
            max_error_rate=r.max_error_rate,
            max_ttft_p99_seconds=r.max_ttft_p99_seconds,
            gate_window_seconds=r.gate_window_seconds,
            drain_grace_period_seconds=r.drain_grace_period_seconds,
        )
        if d.HasField("rollout")
        else RolloutStrategy()
    )
    return Deployment(
        deployment_id=deployment_id,
        profile=profile_from_proto(d.profile),
        replicas=d.replicas,
        min_replicas=d.min_replicas,
        max_replicas=d.max_replicas,
        aliases=tuple(d.aliases),
        rollout=rollout,
        owned_by=d.owned_by,
        routing_policy=d.routing_policy,
    )


def deployment_to_proto(view: DeploymentView) -> pb.Deployment:
    d, s = view.deployment, view.status
    r = d.rollout
    return pb.Deployment(
        name=d.name,
        aliases=list(d.aliases),
        profile=profile_to_proto(d.profile),
        min_replicas=d.min_replicas,
        max_replicas=d.max_replicas,
        replicas=d.replicas,
        rollout=pb.RolloutStrategy(
            max_surge=r.max_surge,
            max_unavailable=r.max_unavailable,
            max_error_rate=r.max_error_rate,
            max_ttft_p99_seconds=r.max_ttft_p99_seconds,
            gate_window_seconds=r.gate_window_seconds,
            drain_grace_period_seconds=r.drain_grace_period_seconds,
        ),
        status=pb.DeploymentStatus(
            phase=s.phase,
            message=s.message,
            ready_replicas=s.ready_replicas,
            current_revision=s.current_revision,
            target_revision=s.target_revision,
        ),
        create_time=_ts(d.create_time),
        update_time=_ts(d.update_time),
        owned_by=d.owned_by,
        routing_policy=d.routing_policy,
    )


def placement_to_proto(
    item: Placement | Unplaced, observed: ObservedReplica | None
) -> pb.Placement:
    """A placed replica, or an unplaced one (empty node and GPUs)."""
    if isinstance(item, Unplaced):
        return pb.Placement(
            replica_id=item.replica_id,
            deployment=f"deployments/{item.deployment_id}",
            unplaced_reason=item.reason,
        )
    message = pb.Placement(
        replica_id=item.replica_id,
        deployment=f"deployments/{item.deployment_id}",
        node=item.node,
        gpu_indices=list(item.gpu_indices),
        memory_bytes_per_gpu=item.memory_bytes_per_device,
        memory_fraction=item.memory_fraction,
        revision=item.revision,
        kv_cache_bytes=item.kv_cache_bytes,
    )
    if observed is not None and isinstance(observed.raw, nodeagent_pb2.Replica):
        message.replica.CopyFrom(observed.raw)
    return message


def node_from_status(status: nodeagent_pb2.NodeStatus) -> Node:
    """The inventory a node-agent reports (condition and times are the orchestrator's)."""
    return Node(
        name=status.node,
        address=status.address,
        gpus=tuple(
            Gpu(
                index=g.index,
                memory_bytes=g.memory_bytes,
                healthy=g.healthy,
                model=g.model,
                uuid=g.uuid,
                memory_used_bytes=g.memory_used_bytes,
                partitions=tuple(
                    GpuPartition(p.uuid, p.profile, p.memory_bytes) for p in g.partitions
                ),
            )
            for g in sorted(status.gpus, key=lambda g: g.index)
        ),
        cpu_count=status.cpu_count,
        memory_bytes=status.memory_bytes,
        labels=tuple(sorted(status.labels.items())),
        agent_version=status.agent_version,
    )


def observed_from_status(status: nodeagent_pb2.NodeStatus) -> list[ObservedReplica]:
    return [
        ObservedReplica(
            replica_id=r.name.removeprefix("replicas/"),
            state=nodeagent_pb2.Replica.State.Name(r.state),
            raw=r,
        )
        for r in status.replicas
    ]


def node_to_proto(node: Node, replicas: list[nodeagent_pb2.Replica] | None = None) -> pb.Node:
    status = nodeagent_pb2.NodeStatus(
        node=node.name,
        address=node.address,
        gpus=[
            nodeagent_pb2.Gpu(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory_bytes=g.memory_bytes,
                memory_used_bytes=g.memory_used_bytes,
                healthy=g.healthy,
                partitions=[
                    nodeagent_pb2.GpuPartition(
                        uuid=p.uuid, profile=p.profile, memory_bytes=p.memory_bytes
                    )
                    for p in g.partitions
                ],
            )
            for g in node.gpus
        ],
        cpu_count=node.cpu_count,
        memory_bytes=node.memory_bytes,
        labels=dict(node.labels),
        replicas=replicas or [],
        agent_version=node.agent_version,
    )
    return pb.Node(
        name=node.resource_name,
        status=status,
        condition=node.condition.value,
        unschedulable=node.unschedulable,
        last_heartbeat_time=_ts(node.last_heartbeat_time),
    )

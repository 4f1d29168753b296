"""Proto ⇄ domain conversions for the orchestrator (field mapping, nothing else).

A deployment profile travels by ONE field list, `PROFILE_FIELDS`: each entry names a domain
attribute of `DeploymentProfile` and the proto field(s) of `DeploymentProfile` it is read from and
written to, with converters where the types differ. Every proto field is either in that list or
in `REFUSED_PROFILE_FIELDS` (deprecated, never implemented: a request that sets one is refused
with INVALID_ARGUMENT naming it); `tests/test_convert.py` fails for a proto field in neither, so a
new field needs a decision. The rollout strategy has its own list, `ROLLOUT_FIELDS`.

Task and transport travel twice during their deprecation window: the deprecated strings (`task`,
`transport`) and the enums (`replica_task`, `replica_transport`). Read: the enum when it is set,
else the string. Written (responses, and the `ReplicaSpec` node-agents get): both, the string
for clients and node-agents older than the enums. The domain keeps the strings, so a profile's
revision is the same whichever spelling a client sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from google.protobuf import timestamp_pb2

from inferplane import replica_contract as contract
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.orchestrator.autoscale.demand import RouterDemand
from inferplane.orchestrator.autoscale.model import AutoscalerStatus, ScaleDecision, Signals
from inferplane.orchestrator.catalog.model import (
    DEFAULT_CONSTRAIN_TOOL_CHOICE_AUTO,
    SAMPLING_FIELDS,
    TASK_GENERATE,
    Autoscaling,
    Deployment,
    DeploymentProfile,
    LoraAdapter,
    RolloutStrategy,
)
from inferplane.orchestrator.catalog.service import DeploymentView
from inferplane.orchestrator.fleet.model import (
    EngineInstall,
    Gpu,
    GpuPartition,
    Node,
    NodeCapabilities,
    ObservedReplica,
)
from inferplane.orchestrator.placement.model import Placement, Unplaced
from inferplane.runtime import InvalidArgumentError

pb = orchestrator_pb2
na = nodeagent_pb2

TASK_ENUMS: Mapping[int, str] = contract.TASK_ENUMS
TRANSPORT_ENUMS: Mapping[int, str] = contract.TRANSPORT_ENUMS
_TASK_VALUES = {v: k for k, v in TASK_ENUMS.items()}
_TRANSPORT_VALUES = {v: k for k, v in TRANSPORT_ENUMS.items()}


def task_from_wire(text: str, value: int, param: str) -> str:
    """The task a message means: the enum `value` when set, else the string `text` (unchecked:
    catalogue validation names an unknown string).

    Raises:
        InvalidArgumentError: `value` is not a `ReplicaTask` (`param` names the field).
    """
    return _from_wire(text, value, TASK_ENUMS, na.ReplicaTask, param)


def transport_from_wire(text: str, value: int, param: str) -> str:
    """The transport a message means: the enum `value` when set, else the string `text`.

    Raises:
        InvalidArgumentError: `value` is not a `ReplicaTransport` (`param` names the field).
    """
    return _from_wire(text, value, TRANSPORT_ENUMS, na.ReplicaTransport, param)


def task_enum(task: str) -> int:
    """The `ReplicaTask` of a task string ("" reads as generate); UNSPECIFIED for an unknown one."""
    return _TASK_VALUES.get(task or TASK_GENERATE, na.REPLICA_TASK_UNSPECIFIED)


def transport_enum(transport: str) -> int:
    """The `ReplicaTransport` of a transport string; UNSPECIFIED for "" or an unknown one."""
    return _TRANSPORT_VALUES.get(transport, na.REPLICA_TRANSPORT_UNSPECIFIED)


def _from_wire(text: str, value: int, known: Mapping[int, str], enum: Any, param: str) -> str:
    if value == 0:
        return text
    if value not in known:
        names = ", ".join(enum.Name(v) for v in known)
        raise InvalidArgumentError(f"unknown {param} {value}; known: {names}", param=param)
    return known[value]


def _ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class WireField:
    """One domain attribute and the proto field it travels in.

    `proto` is the proto field name (default: `attr`). `read(message)` gives the domain value
    (default: the proto field through `to_domain`); `write(value)` gives the proto fields to set
    (default: `{proto: to_proto(value)}`). `also` names the further proto fields `read` and
    `write` handle (an enum beside its deprecated string).
    """

    attr: str
    proto: str = ""
    to_domain: Callable[[Any], Any] = _same
    to_proto: Callable[[Any], Any] = _same
    read: Callable[[Any], Any] | None = None
    write: Callable[[Any], dict[str, Any]] | None = None
    also: tuple[str, ...] = ()

    @property
    def proto_name(self) -> str:
        return self.proto or self.attr

    @property
    def proto_fields(self) -> tuple[str, ...]:
        """Every proto field this entry reads and writes."""
        return (self.proto_name, *self.also)

    def from_message(self, message: Any) -> Any:
        if self.read is not None:
            return self.read(message)
        return self.to_domain(getattr(message, self.proto_name))

    def to_message(self, value: Any) -> dict[str, Any]:
        if self.write is not None:
            return self.write(value)
        return {self.proto_name: self.to_proto(value)}


def _read_tool_choice(p: pb.DeploymentProfile) -> bool:
    # `optional` in the proto: unset means the API's default (on), not the proto's False.
    if p.HasField("constrain_tool_choice_auto"):
        return p.constrain_tool_choice_auto
    return DEFAULT_CONSTRAIN_TOOL_CHOICE_AUTO


def _read_task(p: pb.DeploymentProfile) -> str:
    if p.replica_task == na.REPLICA_TASK_GENERATE:
        return ""  # the domain's spelling of generate (`DeploymentProfile.with_defaults`)
    return task_from_wire(p.task, p.replica_task, "deployment.profile.replica_task")


def _write_task(task: str) -> dict[str, Any]:
    return {"task": task, "replica_task": task_enum(task)}


def _read_transport(p: pb.DeploymentProfile) -> str:
    return transport_from_wire(
        p.transport, p.replica_transport, "deployment.profile.replica_transport"
    )


def _write_transport(transport: str) -> dict[str, Any]:
    return {"transport": transport, "replica_transport": transport_enum(transport)}


def sampling_from_proto(m: na.SamplingDefaults) -> tuple[tuple[str, float | int], ...]:
    """The (parameter, value) pairs a `SamplingDefaults` message sets, by name (unset fields,
    `optional` in the proto, are left out)."""
    return tuple(sorted((n, getattr(m, n)) for n in SAMPLING_FIELDS if m.HasField(n)))


def sampling_to_proto(pairs: tuple[tuple[str, float | int], ...]) -> na.SamplingDefaults:
    """The `SamplingDefaults` message of (parameter, value) pairs (`DeploymentProfile`'s)."""
    message = na.SamplingDefaults()
    for name, value in pairs:
        setattr(message, name, value)
    return message


def _read_sampling(p: pb.DeploymentProfile) -> tuple[tuple[str, float | int], ...]:
    return sampling_from_proto(p.sampling_defaults) if p.HasField("sampling_defaults") else ()


def _write_sampling(pairs: tuple[tuple[str, float | int], ...]) -> dict[str, Any]:
    # None set: the field stays unset (responses show no empty message).
    return {"sampling_defaults": sampling_to_proto(pairs)} if pairs else {}


def _read_gates(p: pb.DeploymentProfile) -> tuple[tuple[str, float | int | bool], ...]:
    # The fields set (proto3 presence: non-zero, or `conformance` set even to false).
    if not p.HasField("release_gates"):
        return ()
    return tuple(sorted((f.name, v) for f, v in p.release_gates.ListFields()))


def _write_gates(pairs: tuple[tuple[str, float | int | bool], ...]) -> dict[str, Any]:
    return {"release_gates": pb.ReleaseGates(**dict(pairs))} if pairs else {}


#: `DeploymentProfile` (domain) ⇄ `inferplane.orchestrator.v1.DeploymentProfile`, in proto
#: field-number order.
PROFILE_FIELDS: tuple[WireField, ...] = (
    WireField("model_source"),
    WireField("engine"),
    WireField("engine_version"),
    WireField("precision"),
    WireField("parameter_count"),
    WireField("active_parameter_count"),
    WireField("num_layers"),
    WireField("num_kv_heads"),
    WireField("head_dim"),
    WireField("kv_cache_dtype"),
    WireField("tensor_parallel_size"),
    WireField("max_model_len"),
    WireField("max_num_seqs"),
    WireField("expected_context_tokens"),
    WireField("reasoning_parser"),
    WireField("tool_parser"),
    WireField("speculative_method"),
    WireField("speculative_model"),
    WireField(
        "transport", read=_read_transport, write=_write_transport, also=("replica_transport",)
    ),
    WireField("extra_engine_args", to_domain=tuple, to_proto=list),
    WireField("stream_interval"),
    WireField("constrain_tool_choice_auto", read=_read_tool_choice),
    WireField("task", read=_read_task, write=_write_task, also=("replica_task",)),
    WireField("sampling_defaults", read=_read_sampling, write=_write_sampling),
    WireField("ttft_slo_seconds"),
    WireField("max_loras"),
    WireField("max_lora_rank"),
    WireField("num_speculative_tokens"),
    WireField("speculative_prompt_lookup_max"),
    WireField("speculative_prompt_lookup_min"),
    WireField("release_gates", read=_read_gates, write=_write_gates),
)
#: Proto profile fields with no domain attribute, and why: a request that sets one is refused
#: (INVALID_ARGUMENT, `param` `deployment.profile.<field>`), never silently dropped.
REFUSED_PROFILE_FIELDS: Mapping[str, str] = {
    "accelerator": (
        "deprecated, never implemented: what a replica runs on follows from the engine "
        '("vllm-cpu": a CPU node\'s host memory; any other engine: GPUs of one node)'
    ),
    "quantization_group_size": (
        "deprecated, never implemented: sizing counts the precision's bytes per parameter; "
        "per-group scales and zeros are not sized"
    ),
}
#: `RolloutStrategy` (domain) ⇄ `inferplane.orchestrator.v1.RolloutStrategy`.
ROLLOUT_FIELDS: tuple[WireField, ...] = tuple(
    WireField(f.name) for f in dataclasses.fields(RolloutStrategy)
)
#: Proto profile field name → domain attribute, for update-mask paths (`profile.replica_task`
#: updates the domain's `task`).
PROFILE_PATHS: Mapping[str, str] = {name: f.attr for f in PROFILE_FIELDS for name in f.proto_fields}


def profile_from_proto(p: pb.DeploymentProfile) -> DeploymentProfile:
    """The domain profile (unset values stay unset: `with_defaults` fills them).

    Raises:
        InvalidArgumentError: a refused field (`REFUSED_PROFILE_FIELDS`) is set, or an enum holds
            a value this version does not know; `param` names the field.
    """
    for name, reason in REFUSED_PROFILE_FIELDS.items():
        if getattr(p, name):
            raise InvalidArgumentError(
                f"profile.{name} is not supported ({reason}); leave it unset",
                param=f"deployment.profile.{name}",
            )
    return DeploymentProfile(**{f.attr: f.from_message(p) for f in PROFILE_FIELDS})


def profile_to_proto(p: DeploymentProfile) -> pb.DeploymentProfile:
    """The proto profile, task and transport in both spellings (string and enum)."""
    fields: dict[str, Any] = {}
    for f in PROFILE_FIELDS:
        fields.update(f.to_message(getattr(p, f.attr)))
    return pb.DeploymentProfile(**fields)


def rollout_from_proto(r: pb.RolloutStrategy) -> RolloutStrategy:
    return RolloutStrategy(**{f.attr: f.from_message(r) for f in ROLLOUT_FIELDS})


def rollout_to_proto(r: RolloutStrategy) -> pb.RolloutStrategy:
    fields: dict[str, Any] = {}
    for f in ROLLOUT_FIELDS:
        fields.update(f.to_message(getattr(r, f.attr)))
    return pb.RolloutStrategy(**fields)


def domain_paths(paths: list[str]) -> list[str]:
    """Update-mask paths in domain attribute names: `profile.<proto field>` becomes
    `profile.<attribute>` (`profile.replica_task` → `profile.task`); other paths unchanged."""
    out = []
    for path in paths:
        head, _, leaf = path.partition(".")
        if head == "profile" and leaf in PROFILE_PATHS:
            path = f"profile.{PROFILE_PATHS[leaf]}"
        out.append(path)
    return out


def autoscaling_from_proto(a: pb.Autoscaling) -> Autoscaling:
    """The domain settings (0 stays 0: the default, resolved by `Autoscaling.effective_*`)."""
    return Autoscaling(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Autoscaling)})


def autoscaling_to_proto(a: Autoscaling) -> pb.Autoscaling:
    return pb.Autoscaling(**dataclasses.asdict(a))


def signals_to_proto(s: Signals) -> pb.AutoscalerSignals:
    return pb.AutoscalerSignals(**dataclasses.asdict(s))


def autoscaler_status_to_proto(a: AutoscalerStatus) -> pb.AutoscalerStatus:
    return pb.AutoscalerStatus(
        desired_replicas=a.desired_replicas,
        last_decision=a.last_decision,
        reason=a.reason,
        last_change_time=_ts(a.last_change_time),
        signals=signals_to_proto(a.signals),
    )


def decision_to_proto(d: ScaleDecision) -> pb.AutoscalerDecision:
    return pb.AutoscalerDecision(
        deployment=f"deployments/{d.deployment_id}",
        time=_ts(d.time),
        decision=d.decision,
        from_replicas=d.from_replicas,
        to_replicas=d.to_replicas,
        reason=d.reason,
        signals=signals_to_proto(d.signals),
    )


def demand_from_proto(d: pb.DeploymentDemand) -> RouterDemand:
    """One router's report of one deployment's demand (the autoscaler's input)."""
    return RouterDemand(
        queued_requests=d.queued_requests,
        max_queue_wait_seconds=d.max_queue_wait_seconds,
        queue_rejections_total=d.queue_rejections_total,
        in_flight_requests=d.in_flight_requests,
        engine_waiting_requests=d.engine_waiting_requests,
        kv_usage=d.kv_usage,
        cold_waiting_requests=d.cold_waiting_requests,
        requests_total=d.requests_total,
    )


def deployment_from_proto(d: pb.Deployment, deployment_id: str) -> Deployment:
    """The domain deployment; `rollout` unset in the request means the default strategy."""
    rollout = rollout_from_proto(d.rollout) if d.HasField("rollout") else RolloutStrategy()
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
        autoscaling=autoscaling_from_proto(d.autoscaling),
    )


def deployment_to_proto(view: DeploymentView) -> pb.Deployment:
    d, s = view.deployment, view.status
    return pb.Deployment(
        name=d.name,
        aliases=list(d.aliases),
        profile=profile_to_proto(d.profile),
        min_replicas=d.min_replicas,
        max_replicas=d.max_replicas,
        replicas=d.replicas,
        rollout=rollout_to_proto(d.rollout),
        status=pb.DeploymentStatus(
            phase=s.phase,
            message=s.message,
            ready_replicas=s.ready_replicas,
            current_revision=s.current_revision,
            target_revision=s.target_revision,
            autoscaler=None if s.autoscaler is None else autoscaler_status_to_proto(s.autoscaler),
            release=s.release,
        ),
        create_time=_ts(d.create_time),
        update_time=_ts(d.update_time),
        owned_by=d.owned_by,
        routing_policy=d.routing_policy,
        # Never set: no message (responses of deployments from before issue 29 stay as they were).
        autoscaling=None if d.autoscaling == Autoscaling() else autoscaling_to_proto(d.autoscaling),
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
        engines=tuple(
            sorted(
                (EngineInstall(e.engine, e.version, e.location, e.default) for e in status.engines),
                key=lambda e: (e.engine, e.version, e.location),
            )
        ),
        capabilities=NodeCapabilities(
            cpu_features=tuple(sorted(set(status.capabilities.cpu_features))),
            cpu_model=status.capabilities.cpu_model,
            kv_cache_dtypes=tuple(sorted(set(status.capabilities.kv_cache_dtypes))),
            speculative_methods=tuple(sorted(set(status.capabilities.speculative_methods))),
        ),
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
        engines=[
            nodeagent_pb2.EngineInstall(
                engine=e.engine, version=e.version, location=e.location, default=e.default
            )
            for e in node.engines or ()
        ],
        capabilities=None
        if node.capabilities is None
        else nodeagent_pb2.NodeCapabilities(
            cpu_features=list(node.capabilities.cpu_features),
            cpu_model=node.capabilities.cpu_model,
            kv_cache_dtypes=list(node.capabilities.kv_cache_dtypes),
            speculative_methods=list(node.capabilities.speculative_methods),
        ),
    )
    return pb.Node(
        name=node.resource_name,
        status=status,
        condition=node.condition.value,
        unschedulable=node.unschedulable,
        last_heartbeat_time=_ts(node.last_heartbeat_time),
    )


def adapter_from_proto(a: pb.LoraAdapter, adapter_id: str) -> LoraAdapter:
    """The domain adapter of a create request (output-only fields ignored)."""
    return LoraAdapter(
        adapter_id=adapter_id,
        base_deployment=a.base_deployment,
        source=a.source,
        rank=a.rank,
        aliases=tuple(a.aliases),
    )


def adapter_to_proto(a: LoraAdapter) -> pb.LoraAdapter:
    return pb.LoraAdapter(
        name=a.name,
        base_deployment=f"deployments/{a.base_deployment}",
        source=a.source,
        rank=a.rank,
        aliases=list(a.aliases),
        phase=a.phase,
        create_time=_ts(a.create_time),
    )

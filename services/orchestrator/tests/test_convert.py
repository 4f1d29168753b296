"""convert.py: every proto profile and rollout field is mapped or refused (a new proto field
fails here until someone decides), round trips, task and transport in both spellings (the enum
wins when set), and the refused fields over gRPC."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from inferplane.api.nodeagent.v1 import nodeagent_pb2 as na
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator import convert
from inferplane.orchestrator.catalog.model import DeploymentProfile, RolloutStrategy
from inferplane.runtime import InvalidArgumentError

FULL = pb.DeploymentProfile(
    model_source="/models/m",
    engine="vllm",
    engine_version="0.32.0",
    precision="fp8",
    parameter_count=8_000_000_000,
    active_parameter_count=1_000_000_000,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    kv_cache_dtype="fp8",
    tensor_parallel_size=2,
    max_model_len=8192,
    max_num_seqs=16,
    expected_context_tokens=4096,
    reasoning_parser="qwen3",
    tool_parser="qwen3",
    speculative_method="eagle",
    speculative_model="/models/draft",
    transport="grpc",
    replica_transport=na.REPLICA_TRANSPORT_GRPC,
    extra_engine_args=["--enable-prefix-caching"],
    stream_interval=4,
    constrain_tool_choice_auto=False,
    task="embed",
    replica_task=na.REPLICA_TASK_EMBED,
    sampling_defaults=na.SamplingDefaults(repetition_penalty=1.3, top_k=20, temperature=0.0),
)


def proto_fields(message: Any) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}


def test_every_profile_field_is_mapped_or_refused() -> None:
    mapped = [name for f in convert.PROFILE_FIELDS for name in f.proto_fields]
    assert len(mapped) == len(set(mapped)), "a proto field is mapped twice"
    refused = set(convert.REFUSED_PROFILE_FIELDS)
    assert not refused & set(mapped)
    unmapped = proto_fields(pb.DeploymentProfile) - set(mapped) - refused
    assert not unmapped, (
        f"DeploymentProfile fields {sorted(unmapped)} are neither in convert.PROFILE_FIELDS "
        "nor in convert.REFUSED_PROFILE_FIELDS: map or refuse them"
    )
    assert set(mapped) | refused == proto_fields(pb.DeploymentProfile)
    assert all(reason for reason in convert.REFUSED_PROFILE_FIELDS.values())
    attrs = [f.attr for f in convert.PROFILE_FIELDS]
    assert sorted(attrs) == sorted(f.name for f in dataclasses.fields(DeploymentProfile))


def test_every_rollout_field_is_mapped() -> None:
    mapped = {f.proto_name for f in convert.ROLLOUT_FIELDS}
    assert mapped == proto_fields(pb.RolloutStrategy)
    assert {f.attr for f in convert.ROLLOUT_FIELDS} == {
        f.name for f in dataclasses.fields(RolloutStrategy)
    }


def test_profile_round_trips() -> None:
    profile = convert.profile_from_proto(FULL)
    assert profile.task == "embed" and profile.transport == "grpc"
    assert profile.extra_engine_args == ("--enable-prefix-caching",)
    assert profile.constrain_tool_choice_auto is False
    assert convert.profile_to_proto(profile) == FULL
    assert convert.profile_from_proto(convert.profile_to_proto(profile)) == profile


def test_unset_tool_choice_reads_as_the_api_default() -> None:
    assert convert.profile_from_proto(pb.DeploymentProfile()).constrain_tool_choice_auto is True


def test_rollout_round_trips() -> None:
    rollout = RolloutStrategy(2, 1, 0.05, 1.5, 60, 10)
    assert convert.rollout_from_proto(convert.rollout_to_proto(rollout)) == rollout


@pytest.mark.parametrize(
    ("string", "enum", "task"),
    [
        ("", na.REPLICA_TASK_UNSPECIFIED, ""),
        ("embed", na.REPLICA_TASK_UNSPECIFIED, "embed"),
        ("", na.REPLICA_TASK_TRANSCRIBE, "transcribe"),
        ("embed", na.REPLICA_TASK_GENERATE, ""),  # both sent: the enum wins ("" = generate)
        ("bogus", na.REPLICA_TASK_EMBED, "embed"),
    ],
)
def test_task_enum_wins_when_set(string: str, enum: int, task: str) -> None:
    p = convert.profile_from_proto(pb.DeploymentProfile(task=string, replica_task=enum))
    assert p.task == task


@pytest.mark.parametrize(
    ("string", "enum", "transport"),
    [
        ("", na.REPLICA_TRANSPORT_UNSPECIFIED, ""),
        ("grpc", na.REPLICA_TRANSPORT_UNSPECIFIED, "grpc"),
        ("", na.REPLICA_TRANSPORT_HTTP_COMPLETIONS, "http-completions"),
        ("grpc", na.REPLICA_TRANSPORT_INPROC, "inproc"),  # both sent: the enum wins
    ],
)
def test_transport_enum_wins_when_set(string: str, enum: int, transport: str) -> None:
    p = convert.profile_from_proto(pb.DeploymentProfile(transport=string, replica_transport=enum))
    assert p.transport == transport


def test_responses_carry_both_spellings() -> None:
    out = convert.profile_to_proto(DeploymentProfile(task="", transport="inproc"))
    assert (out.task, out.replica_task) == ("", na.REPLICA_TASK_GENERATE)
    assert (out.transport, out.replica_transport) == ("inproc", na.REPLICA_TRANSPORT_INPROC)
    out = convert.profile_to_proto(DeploymentProfile(task="transcribe", transport="bogus"))
    assert out.replica_task == na.REPLICA_TASK_TRANSCRIBE
    assert out.replica_transport == na.REPLICA_TRANSPORT_UNSPECIFIED


def test_an_unknown_enum_value_is_refused() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        convert.profile_from_proto(pb.DeploymentProfile(replica_task=42))  # type: ignore[arg-type]
    assert info.value.param == "deployment.profile.replica_task"
    assert "REPLICA_TASK_EMBED" in str(info.value)
    with pytest.raises(InvalidArgumentError) as info:
        convert.profile_from_proto(pb.DeploymentProfile(replica_transport=9))  # type: ignore[arg-type]
    assert info.value.param == "deployment.profile.replica_transport"


@pytest.mark.parametrize(
    ("field", "value"), [("accelerator", "cpu"), ("quantization_group_size", 128)]
)
def test_refused_fields_are_refused_not_dropped(field: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        convert.profile_from_proto(pb.DeploymentProfile(**{field: value}))
    assert info.value.param == f"deployment.profile.{field}"
    assert field in str(info.value)


def test_update_mask_paths_in_proto_names() -> None:
    assert convert.domain_paths(
        ["replicas", "profile.replica_task", "profile.transport", "profile.replica_transport"]
    ) == ["replicas", "profile.task", "profile.transport", "profile.transport"]


def test_the_api_refuses_a_refused_field_and_takes_the_enums(orch: Any, fx: Any) -> None:
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("c")), timeout=10)
    bad = fx.tiny_cpu_proto()
    bad.profile.quantization_group_size = 128
    with pytest.raises(grpc.RpcError) as info:
        orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id="m", deployment=bad), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "quantization_group_size" in (info.value.details() or "")

    by_string = fx.tiny_cpu_proto()
    by_string.profile.transport = "grpc"
    by_enum = fx.tiny_cpu_proto()
    by_enum.profile.replica_transport = na.REPLICA_TRANSPORT_GRPC
    created = [
        orch.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(deployment_id=name, deployment=d, validate_only=True),
            timeout=10,
        ).deployment
        for name, d in (("s", by_string), ("e", by_enum))
    ]
    assert created[0].status.current_revision == created[1].status.current_revision
    assert created[1].profile.transport == "grpc"
    assert created[1].profile.replica_task == na.REPLICA_TASK_GENERATE

    orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="m", deployment=fx.tiny_cpu_proto()), timeout=10
    )
    update = pb.Deployment(
        name="deployments/m",
        profile=pb.DeploymentProfile(replica_transport=na.REPLICA_TRANSPORT_HTTP_COMPLETIONS),
    )
    after = orch.deployments.UpdateDeployment(
        pb.UpdateDeploymentRequest(
            deployment=update,
            update_mask=field_mask_pb2.FieldMask(paths=["profile.replica_transport"]),
        ),
        timeout=10,
    ).deployment
    assert after.profile.transport == "http-completions"
    assert after.profile.replica_transport == na.REPLICA_TRANSPORT_HTTP_COMPLETIONS


def test_replica_specs_carry_both_spellings() -> None:
    """Node-agents older than the enums read the strings; newer ones the enums."""
    from inferplane.orchestrator.catalog.model import Accelerator, Deployment
    from inferplane.orchestrator.placement.model import Placement
    from inferplane.orchestrator.release.spec import build_spec

    profile = DeploymentProfile(model_source="/m", task="embed", transport="http-completions")
    placement = Placement(
        replica_id="e-0",
        deployment_id="e",
        revision="rev-1",
        node="n1",
        accelerator=Accelerator.CPU,
        gpu_indices=(),
        memory_bytes_per_device=10**9,
        memory_fraction=0.1,
        kv_cache_bytes=0,
    )
    spec = build_spec(Deployment("e", profile), profile, "rev-1", placement, None)
    assert (spec.task, spec.replica_task) == ("embed", na.REPLICA_TASK_EMBED)
    assert spec.transport == "http-completions"
    assert spec.replica_transport == na.REPLICA_TRANSPORT_HTTP_COMPLETIONS


def test_the_enums_and_the_contract_name_the_same_values() -> None:
    """Every `ReplicaTask` / `ReplicaTransport` value but UNSPECIFIED is a contract member."""
    from inferplane import replica_contract as contract

    assert sorted(convert.TASK_ENUMS.values()) == sorted(t.value for t in contract.Task)
    assert set(convert.TASK_ENUMS) == set(na.ReplicaTask.values()) - {0}
    assert sorted(convert.TRANSPORT_ENUMS.values()) == sorted(t.value for t in contract.Transport)
    assert set(convert.TRANSPORT_ENUMS) == set(na.ReplicaTransport.values()) - {0}

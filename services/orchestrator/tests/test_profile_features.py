"""Profiles mean what they say (issue 30): speculative decoding and the KV cache dtype are
validated naming the field, hashed into the revision, sent in the replica spec and sized as the
engine runs them; placement uses only nodes with the engine and capabilities a profile needs,
ExplainPlacement says which node lacks what, and Create/Update refuse a setting no registered
node can run (FAILED_PRECONDITION naming the field)."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb
from inferplane.orchestrator.catalog.model import Deployment, DeploymentProfile
from inferplane.orchestrator.catalog.sizing import GB, SizingPolicy, estimate
from inferplane.orchestrator.catalog.validation import validate_deployment
from inferplane.orchestrator.convert import node_from_status, profile_from_proto, profile_to_proto
from inferplane.orchestrator.fleet.model import EngineInstall, Gpu, Node, NodeCapabilities
from inferplane.orchestrator.placement.best_fit import BestFitSpreadPolicy
from inferplane.orchestrator.placement.capabilities import capability_error, same_version
from inferplane.orchestrator.placement.model import Placement
from inferplane.orchestrator.placement.planner import plan
from inferplane.orchestrator.release.spec import build_spec
from inferplane.runtime import InvalidArgumentError

CPU_PROFILE = DeploymentProfile(
    model_source="/models/kimi-tiny",
    engine="vllm-cpu",
    precision="fp32",
    parameter_count=750_000,
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    max_model_len=2048,
    max_num_seqs=8,
)
LLAMA = DeploymentProfile(
    model_source="meta-llama/Llama-3.1-8B-Instruct",
    precision="bf16",
    parameter_count=8_030_000_000,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    max_model_len=8192,
    max_num_seqs=8,
)
SIZING = SizingPolicy()


def cpu_node(
    name: str,
    versions: tuple[str, ...] = ("0.32.0",),
    kv: tuple[str, ...] = ("auto", "bf16", "fp16"),
    methods: tuple[str, ...] = ("ngram",),
    *,
    reported: bool = True,
) -> Node:
    return Node(
        name=name,
        memory_bytes=32 * GB,
        engines=tuple(
            EngineInstall("vllm-cpu", v, f"/e/{v}", i == 0) for i, v in enumerate(versions)
        )
        if reported
        else None,
        capabilities=NodeCapabilities(kv_cache_dtypes=kv, speculative_methods=methods)
        if reported
        else None,
    )


def invalid(profile: DeploymentProfile, **changes: Any) -> InvalidArgumentError:
    deployment = Deployment("m", dataclasses.replace(profile, **changes)).normalised()
    with pytest.raises(InvalidArgumentError) as err:
        validate_deployment(deployment)
    return err.value


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"speculative_method": "medusa"}, "speculative_method", "known: "),
        ({"speculative_method": "eagle"}, "speculative_model", "needs a draft model"),
        (
            {"speculative_method": "ngram", "speculative_model": "/d"},
            "speculative_model",
            "no draft",
        ),
        (
            {"speculative_method": "ngram", "num_speculative_tokens": 17},
            "num_speculative_tokens",
            "",
        ),
        ({"num_speculative_tokens": 2}, "num_speculative_tokens", "no speculative method"),
        (
            {"speculative_method": "mtp", "speculative_prompt_lookup_max": 3},
            "speculative_prompt_lookup_max",
            "only for method ngram",
        ),
        (
            {
                "speculative_method": "ngram",
                "speculative_prompt_lookup_max": 2,
                "speculative_prompt_lookup_min": 3,
            },
            "speculative_prompt_lookup_min",
            "must not exceed",
        ),
        ({"speculative_method": "ngram", "task": "embed"}, "speculative_method", "takes none"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype", "known: "),
    ],
)
def test_bad_settings_are_invalid_argument_naming_the_profile_field(
    changes: dict[str, Any], field: str, words: str
) -> None:
    err = invalid(LLAMA, **changes)
    assert err.param == f"deployment.profile.{field}"
    assert words in str(err)


def test_engine_args_keep_refusing_speculative_config_and_a_disagreeing_kv_dtype() -> None:
    err = invalid(LLAMA, extra_engine_args=("--speculative-config", '{"method":"ngram"}'))
    assert err.param == "deployment.profile.extra_engine_args"
    assert "profile.speculative_method" in str(err) and "num_speculative_tokens" in str(err)
    err = invalid(LLAMA, kv_cache_dtype="fp8", extra_engine_args=("--kv-cache-dtype", "auto"))
    assert "disagrees with profile.kv_cache_dtype 'fp8'" in str(err)
    ok = dataclasses.replace(
        LLAMA, kv_cache_dtype="fp8", extra_engine_args=("--kv-cache-dtype=fp8",)
    )
    validate_deployment(Deployment("m", ok).normalised())


def test_the_settings_are_revision_changes_and_unset_ones_keep_the_old_revision() -> None:
    base = LLAMA.revision()
    ngram = dataclasses.replace(LLAMA, speculative_method="ngram")
    assert ngram.revision() != base
    tokens = dataclasses.replace(ngram, num_speculative_tokens=2)
    window = dataclasses.replace(ngram, speculative_prompt_lookup_max=6)
    assert len({ngram.revision(), tokens.revision(), window.revision()}) == 3
    assert dataclasses.replace(LLAMA, kv_cache_dtype="fp8").revision() != base
    # unset (0) new fields are not in the hash: a stored profile keeps its revision
    assert dataclasses.replace(LLAMA, num_speculative_tokens=0).revision() == base


def test_the_api_round_trips_the_new_fields() -> None:
    profile = dataclasses.replace(
        LLAMA,
        speculative_method="ngram",
        num_speculative_tokens=3,
        speculative_prompt_lookup_max=5,
        speculative_prompt_lookup_min=2,
        kv_cache_dtype="fp8",
    )
    wire = profile_to_proto(profile)
    assert (wire.num_speculative_tokens, wire.speculative_prompt_lookup_max) == (3, 5)
    assert profile_from_proto(wire) == profile


def _spec(profile: DeploymentProfile) -> nodeagent_pb2.ReplicaSpec:
    deployment = Deployment("m", profile).normalised()
    placement = Placement(
        "m-0", "m", deployment.revision, "n", CPU_PROFILE.accelerator, (), 1, 0.1, 1
    )
    return build_spec(deployment, deployment.profile, deployment.revision, placement, None)


def test_the_spec_carries_the_dtype_and_the_resolved_speculation() -> None:
    spec = _spec(dataclasses.replace(CPU_PROFILE, kv_cache_dtype="fp8", speculative_method="ngram"))
    assert spec.kv_cache_dtype == "fp8"
    assert (spec.speculative.method, spec.speculative.num_speculative_tokens) == ("ngram", 4)
    assert (spec.speculative.prompt_lookup_max, spec.speculative.prompt_lookup_min) == (4, 1)
    plain = _spec(CPU_PROFILE)
    assert plain.kv_cache_dtype == "auto" and not plain.HasField("speculative")


def test_sizing_follows_the_kv_dtype_and_adds_the_draft(tmp_path: Path) -> None:
    auto, fp8 = estimate(LLAMA, SIZING), estimate(dataclasses.replace(LLAMA, kv_cache_dtype="fp8"))
    assert auto.kv_bytes_per_token == 2 * fp8.kv_bytes_per_token == 131_072
    # fp32 weights: "auto" is the model's dtype, 4 bytes
    assert estimate(CPU_PROFILE).kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert estimate(dataclasses.replace(LLAMA, speculative_method="ngram")) == auto
    # eagle from a hub id: estimated as two decoder layers' share, 16 bit, plus one KV layer
    hub = estimate(dataclasses.replace(LLAMA, speculative_method="eagle", speculative_model="x/y"))
    share = -(-LLAMA.parameter_count // LLAMA.num_layers)
    assert hub.weights_bytes - auto.weights_bytes == 2 * share * 2
    assert hub.kv_bytes_per_token == auto.kv_bytes_per_token * 33 // 32
    # eagle from a local folder: counted from its safetensors header and config
    folder = tmp_path / "draft"
    folder.mkdir()
    header = json.dumps({"a": {"dtype": "BF16", "shape": [1000, 300], "data_offsets": [0, 0]}})
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    local = estimate(
        dataclasses.replace(LLAMA, speculative_method="eagle", speculative_model=str(folder))
    )
    assert local.weights_bytes - auto.weights_bytes == 300_000 * 2
    assert local.kv_bytes_per_token == auto.kv_bytes_per_token * 34 // 32
    # mtp: its layers are in the checkpoint (no weights added), one more KV layer
    mtp = estimate(dataclasses.replace(LLAMA, speculative_method="mtp"))
    assert (
        mtp.weights_bytes == auto.weights_bytes and mtp.kv_bytes_per_token > auto.kv_bytes_per_token
    )


def _place(profile: DeploymentProfile, nodes: list[Node], previous: dict | None = None) -> Any:
    deployment = Deployment("m", profile, replicas=1).normalised()
    return plan([deployment], nodes, previous or {}, BestFitSpreadPolicy(), SIZING)


def test_placement_uses_only_nodes_with_the_engine_version_and_capabilities() -> None:
    nodes = [
        cpu_node("a-old"),  # 0.32.0 only
        cpu_node("b-new", versions=("0.32.0", "0.31.0")),
        cpu_node("c-fp8", kv=("auto", "fp8")),
    ]
    pinned = _place(dataclasses.replace(CPU_PROFILE, engine_version="0.31.0"), nodes)
    assert [p.node for p in pinned.placements] == ["b-new"]
    # the node-agent selects by the exact string: "0.31" is not placed where it would fail
    assert not same_version("0.31.0", "0.31")
    fp8 = _place(dataclasses.replace(CPU_PROFILE, kv_cache_dtype="fp8"), nodes)
    assert [p.node for p in fp8.placements] == ["c-fp8"]
    none = _place(
        dataclasses.replace(CPU_PROFILE, speculative_method="ngram", kv_cache_dtype="fp8"),
        nodes[:2],
    )
    assert not none.placements
    reason = none.unplaced[0].reason
    assert (
        "0 of 2 CPU nodes can host it: 2 lack what it needs (engine vllm-cpu (node default)"
        in reason
    )
    assert "a-old lacks KV cache dtype fp8 (offers auto, bf16, fp16)" in reason


def test_nodes_from_before_issue_30_offer_the_default_engine_only() -> None:
    old = node_from_status(nodeagent_pb2.NodeStatus(node="old", memory_bytes=32 * GB))
    assert old.engines == () and old.capabilities == NodeCapabilities()
    assert [p.node for p in _place(CPU_PROFILE, [old]).placements] == ["old"]
    pinned = _place(dataclasses.replace(CPU_PROFILE, engine_version="0.32.0"), [old])
    assert (
        "old lacks engine vllm-cpu 0.32.0 (has vllm-cpu (unknown version))"
        in pinned.unplaced[0].reason
    )
    ngram = _place(dataclasses.replace(CPU_PROFILE, speculative_method="ngram"), [old])
    assert "old lacks speculative method ngram (offers none)" in ngram.unplaced[0].reason


def test_a_node_not_reported_yet_keeps_its_replica_and_gets_no_new_one() -> None:
    profile = dataclasses.replace(CPU_PROFILE, speculative_method="ngram")
    first = _place(profile, [cpu_node("n")])
    assert [p.node for p in first.placements] == ["n"]
    previous = {p.replica_id: p for p in first.placements}
    restarted = [cpu_node("n", reported=False)]
    assert _place(profile, restarted, previous).placements == first.placements
    fresh = _place(profile, restarted)
    assert "has not reported its engines yet" in fresh.unplaced[0].reason
    # a node that reports it lost the capability: the replica moves off it
    gone = _place(profile, [cpu_node("n", methods=())], previous)
    assert not gone.placements


def test_capability_error_names_the_most_basic_missing_field() -> None:
    nodes = [cpu_node("a"), cpu_node("b")]
    field, message = capability_error(
        dataclasses.replace(CPU_PROFILE, engine_version="0.30.0"), nodes
    ) or ("", "")
    assert field == "engine_version"
    assert message.startswith(
        "no registered CPU node can run profile.engine_version 0.30.0: a lacks"
    )
    both = dataclasses.replace(
        CPU_PROFILE, kv_cache_dtype="fp8", speculative_method="eagle", speculative_model="/d"
    )
    assert (capability_error(both, nodes) or ("",))[0] == "kv_cache_dtype"
    assert (
        capability_error(
            dataclasses.replace(CPU_PROFILE, kv_cache_dtype="fp8"),
            [*nodes, cpu_node("c", kv=("fp8",))],
        )
        is None
    )
    assert capability_error(dataclasses.replace(CPU_PROFILE, kv_cache_dtype="fp8"), []) is None
    # a node that has not reported its engines yet may offer it: no refusal yet
    assert (
        capability_error(
            dataclasses.replace(CPU_PROFILE, kv_cache_dtype="fp8"),
            [*nodes, cpu_node("c", reported=False)],
        )
        is None
    )
    # GPU nodes do not answer for a CPU profile
    gpu = Node(name="g", gpus=(Gpu(0, 80 * GB),), engines=(EngineInstall("vllm", "0.32.0"),))
    assert capability_error(dataclasses.replace(CPU_PROFILE, kv_cache_dtype="fp8"), [gpu]) is None


def _rpc_error(call: Any, request: Any) -> Any:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value


def test_create_and_update_refuse_what_no_node_can_run(orch: Any, fx: Any) -> None:
    deployments = orch.deployments
    fp8 = fx.tiny_cpu_proto()
    fp8.profile.kv_cache_dtype = "fp8"
    # no node yet: accepted, Unplaceable with the reason
    created = deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="early", deployment=fp8), timeout=10
    ).deployment
    assert created.status.phase != "Ready"
    orch.nodes.RegisterNode(pb.RegisterNodeRequest(status=fx.cpu_status("cpu-0")), timeout=10)
    err = _rpc_error(
        deployments.CreateDeployment, pb.CreateDeploymentRequest(deployment_id="m", deployment=fp8)
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        dict(err.trailing_metadata())["x-openai-error-param"] == "deployment.profile.kv_cache_dtype"
    )
    assert "cpu-0 lacks KV cache dtype fp8 (offers auto only)" in err.details()
    lines = deployments.ExplainPlacement(
        pb.ExplainPlacementRequest(name="deployments/early"), timeout=10
    ).lines
    assert any("cpu-0 lacks KV cache dtype fp8" in line for line in lines[1:])

    ngram = fx.tiny_cpu_proto()
    ngram.profile.speculative_method = "ngram"
    err = _rpc_error(
        deployments.CreateDeployment,
        pb.CreateDeploymentRequest(deployment_id="m", deployment=ngram),
    )
    assert (
        dict(err.trailing_metadata())["x-openai-error-param"]
        == "deployment.profile.speculative_method"
    )

    plain = fx.tiny_cpu_proto()
    deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="m", deployment=plain), timeout=10
    )
    update = pb.Deployment(
        name="deployments/m", profile=pb.DeploymentProfile(engine_version="0.29.0")
    )
    err = _rpc_error(
        deployments.UpdateDeployment,
        pb.UpdateDeploymentRequest(
            deployment=update, update_mask={"paths": ["profile.engine_version"]}
        ),
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        dict(err.trailing_metadata())["x-openai-error-param"] == "deployment.profile.engine_version"
    )
    caps = nodeagent_pb2.NodeCapabilities(
        kv_cache_dtypes=["auto", "fp8"], speculative_methods=["ngram"]
    )
    orch.nodes.RegisterNode(
        pb.RegisterNodeRequest(status=fx.cpu_status("cpu-1", capabilities=caps)), timeout=10
    )
    ok = deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="m2", deployment=ngram), timeout=10
    )
    assert ok.deployment.profile.speculative_method == "ngram"
    placed = deployments.ListDeploymentReplicas(
        pb.ListDeploymentReplicasRequest(parent="deployments/m2"), timeout=10
    )
    assert [p.node for p in placed.placements] == ["cpu-1"]

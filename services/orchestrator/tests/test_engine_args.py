"""A deployment's `extra_engine_args` come from the allow-list (`inferplane.engine_args`,
issue 18): CreateDeployment and UpdateDeployment refuse anything else with INVALID_ARGUMENT
naming the flag, and nothing is stored."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from inferplane.api.orchestrator.v1 import orchestrator_pb2 as pb

PARAM = "deployment.profile.extra_engine_args"


def rpc_error(call: Any, request: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value


def param(error: grpc.RpcError) -> str:
    return str(dict(error.trailing_metadata())["x-openai-error-param"])  # type: ignore[attr-defined]


def test_create_refuses_a_flag_off_the_list_and_stores_nothing(orch: Any, fx: Any) -> None:
    """Invariant: no API caller can make a node run `--trust-remote-code` (or any flag off the
    allow-list): the deployment is refused before anything is stored or placed."""
    bad = fx.llama8b_proto(
        profile={"extra_engine_args": ["--enable-prefix-caching", "--trust-remote-code"]}
    )
    error = rpc_error(
        orch.deployments.CreateDeployment,
        pb.CreateDeploymentRequest(deployment_id="m", deployment=bad),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error.details().startswith(  # type: ignore[attr-defined]
        "engine argument '--trust-remote-code' is not allowed; allowed: --async-scheduling, "
    )
    assert param(error) == PARAM
    missing = rpc_error(
        orch.deployments.GetDeployment, pb.GetDeploymentRequest(name="deployments/m")
    )
    assert missing.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]

    good = fx.llama8b_proto(
        profile={"extra_engine_args": ["--enable-prefix-caching", "--max-num-batched-tokens=8192"]}
    )
    created = orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(deployment_id="m", deployment=good), timeout=10
    ).deployment
    assert list(created.profile.extra_engine_args) == [
        "--enable-prefix-caching",
        "--max-num-batched-tokens=8192",
    ]


def test_update_refuses_a_bad_value_and_keeps_the_profile(orch: Any, fx: Any) -> None:
    orch.deployments.CreateDeployment(
        pb.CreateDeploymentRequest(
            deployment_id="m", deployment=fx.llama8b_proto(profile={"extra_engine_args": []})
        ),
        timeout=10,
    )
    mask = field_mask_pb2.FieldMask(paths=["profile.extra_engine_args"])
    for args, message in (
        (["--block-size", "0"], "engine argument --block-size takes an integer 1-1024; got '0'"),
        (
            ["--gpu-memory-utilization", "0.99"],
            "engine argument --gpu-memory-utilization is set from placement, from the "
            "profile's sizing; set that instead",
        ),
        (
            ["--kv-cache-dtype", "fp8"],
            "engine argument --kv-cache-dtype fp8 disagrees with profile.kv_cache_dtype 'auto', "
            "which sizes the KV cache; set profile.kv_cache_dtype to 'fp8' too",
        ),
    ):
        update = pb.Deployment(
            name="deployments/m", profile=pb.DeploymentProfile(extra_engine_args=args)
        )
        error = rpc_error(
            orch.deployments.UpdateDeployment,
            pb.UpdateDeploymentRequest(deployment=update, update_mask=mask),
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert error.details() == message  # type: ignore[attr-defined]
        assert param(error) == PARAM
    current = orch.deployments.GetDeployment(
        pb.GetDeploymentRequest(name="deployments/m"), timeout=10
    ).deployment
    assert list(current.profile.extra_engine_args) == []

    both = pb.Deployment(
        name="deployments/m",
        profile=pb.DeploymentProfile(
            kv_cache_dtype="fp8", extra_engine_args=["--kv-cache-dtype", "fp8"]
        ),
    )
    updated = orch.deployments.UpdateDeployment(
        pb.UpdateDeploymentRequest(
            deployment=both,
            update_mask=field_mask_pb2.FieldMask(
                paths=["profile.kv_cache_dtype", "profile.extra_engine_args"]
            ),
        ),
        timeout=10,
    ).deployment
    assert list(updated.profile.extra_engine_args) == ["--kv-cache-dtype", "fp8"]

"""What the sync and async clients share: resource names, request building and response
unwrapping, so that each operation is written once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from google.protobuf import field_mask_pb2, json_format

from inferplane.api.auth.v1 import auth_pb2, usage_pb2
from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import chat_request_from_dict

ChatRequest = inference_pb2.ChatCompletionRequest | Mapping[str, Any]
EmbeddingRequest = inference_pb2.EmbeddingRequest | Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class KeyWithSecret:
    """What `keys.create` and `keys.rotate` return: the key's metadata and its secret, which
    the server shows this once and never again."""

    api_key: auth_pb2.ApiKey
    secret: str


def _prefixed(prefix: str, name: str) -> str:
    return name if name.startswith(prefix) else prefix + name


def key_name(name: str) -> str:
    """`api-keys/{id}` from a key id or a key name."""
    return _prefixed("api-keys/", name)


def deployment_name(name: str) -> str:
    """`deployments/{id}` from a deployment id, an alias or a name (the orchestrator resolves
    aliases, which may hold slashes)."""
    return _prefixed("deployments/", name)


def adapter_name(name: str) -> str:
    """`adapters/{adapter}` from a LoRA adapter id or a resource name."""
    return _prefixed("adapters/", name)


def node_name(name: str) -> str:
    """`nodes/{node}` from a node name or a resource name."""
    return _prefixed("nodes/", name)


def mask(paths: Iterable[str] | None) -> field_mask_pb2.FieldMask:
    """An update mask; None or empty lets the server infer it (each service documents how)."""
    return field_mask_pb2.FieldMask(paths=list(paths or ()))


def chat_request(request: ChatRequest) -> inference_pb2.ChatCompletionRequest:
    """A chat request from the proto or from OpenAI's JSON body (parsed as the edge does:
    unknown fields ignored). Raises InvalidArgumentError for a field of the wrong type."""
    if isinstance(request, inference_pb2.ChatCompletionRequest):
        return request
    return chat_request_from_dict(dict(request))


def embedding_request(request: EmbeddingRequest) -> inference_pb2.EmbeddingRequest:
    """An embeddings request from the proto or from OpenAI's JSON body (unknown fields
    ignored). Raises InvalidArgumentError for a field of the wrong type."""
    if isinstance(request, inference_pb2.EmbeddingRequest):
        return request
    try:
        return json_format.ParseDict(
            dict(request), inference_pb2.EmbeddingRequest(), ignore_unknown_fields=True
        )
    except json_format.ParseError as exc:
        raise InvalidArgumentError(f"invalid embeddings request: {exc}") from exc


def create_deployment_request(
    deployment_id: str,
    deployment: orchestrator_pb2.Deployment,
    validate_only: bool,
    force: bool = False,
    force_reason: str = "",
) -> orchestrator_pb2.CreateDeploymentRequest:
    return orchestrator_pb2.CreateDeploymentRequest(
        deployment_id=deployment_id,
        deployment=deployment,
        validate_only=validate_only,
        force=force,
        force_reason=force_reason,
    )


def list_compatibility_request(
    *, deployment: str, engine_version: str, model_digest: str, verdict: str, page_size: int
) -> orchestrator_pb2.ListCompatibilityRequest:
    """ListCompatibility's filters (the page token is set per page)."""
    return orchestrator_pb2.ListCompatibilityRequest(
        deployment=deployment.removeprefix("deployments/"),
        engine_version=engine_version,
        model_digest=model_digest,
        verdict=verdict,
        page_size=page_size,
    )


def usage_query(
    *,
    start: datetime | None,
    end: datetime | None,
    key: str,
    tenant: str,
    model: str,
    group_by: str,
    page_size: int,
    page_token: str,
    api: str = "",
) -> usage_pb2.QueryUsageRequest:
    """A `QueryUsageRequest` (times timezone-aware; `key` an id or `api-keys/{id}`).

    Raises:
        ValueError: a naive `start` or `end` (its zone would be a guess).
    """
    request = usage_pb2.QueryUsageRequest(
        key_id=key.removeprefix("api-keys/"),
        tenant=tenant,
        model=model,
        group_by=group_by,
        page_size=page_size,
        page_token=page_token,
        api=api,
    )
    for field, value in (("start_time", start), ("end_time", end)):
        if value is None:
            continue
        if value.tzinfo is None:
            raise ValueError(f"{field.removesuffix('_time')} must be timezone-aware")
        getattr(request, field).FromDatetime(value)
    return request

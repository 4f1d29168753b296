"""Every RPC the SDK calls, with the service address it goes to and whether it may be retried.

A call is retried on UNAVAILABLE only when repeating it cannot change the outcome: the
server may have done the work and lost only the answer, so a repeat must leave the same state
and give the same kind of answer. None of the create requests carries an idempotency key (no
`request_id` in auth.v1 or orchestrator.v1), so no create is retried; the reason for each
other decision sits beside it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Generic, TypeVar

from google.protobuf import message as _message

from inferplane.api.auth.v1 import auth_pb2, usage_pb2
from inferplane.api.inference.v1 import inference_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2

Req = TypeVar("Req", bound=_message.Message)
Resp = TypeVar("Resp", bound=_message.Message)


class Target(enum.Enum):
    """Which address of the client a method goes to (the constructor argument's name)."""

    AUTH = "auth"
    ORCHESTRATOR = "orchestrator"
    INFERENCE = "inference"


@dataclasses.dataclass(frozen=True, slots=True)
class Method(Generic[Req, Resp]):
    """One RPC: `path` is `/package.Service/Method`; `retry` says whether UNAVAILABLE may be
    retried."""

    target: Target
    path: str
    request: type[Req]
    response: type[Resp]
    retry: bool

    def serialize(self, request: Req) -> bytes:
        return request.SerializeToString()

    def deserialize(self, data: bytes) -> Resp:
        return self.response.FromString(data)


def _method(
    target: Target,
    module: Any,
    service: str,
    name: str,
    request: type[Req],
    response: type[Resp],
    *,
    retry: bool,
) -> Method[Req, Resp]:
    """A `Method`, checked against the service's descriptor (a typo or a wrong message type
    fails at import, not on a call)."""
    descriptor = module.DESCRIPTOR.services_by_name[service].methods_by_name[name]
    if (descriptor.input_type.full_name, descriptor.output_type.full_name) != (
        request.DESCRIPTOR.full_name,
        response.DESCRIPTOR.full_name,
    ):
        raise TypeError(f"{service}.{name}: request or response type does not match the proto")
    return Method(
        target, f"/{descriptor.containing_service.full_name}/{name}", request, response, retry
    )


_A, _O, _I = Target.AUTH, Target.ORCHESTRATOR, Target.INFERENCE
auth, orch, inf, usage = auth_pb2, orchestrator_pb2, inference_pb2, usage_pb2

# -- inferplane.auth.v1.ApiKeyService ----------------------------------------------------------
CREATE_API_KEY = _method(
    _A, auth, "ApiKeyService", "CreateApiKey",
    auth.CreateApiKeyRequest, auth.CreateApiKeyResponse,
    retry=False,  # a repeat creates a second key
)  # fmt: skip
GET_API_KEY = _method(
    _A, auth, "ApiKeyService", "GetApiKey",
    auth.GetApiKeyRequest, auth.GetApiKeyResponse,
    retry=True,  # a read
)  # fmt: skip
LIST_API_KEYS = _method(
    _A, auth, "ApiKeyService", "ListApiKeys",
    auth.ListApiKeysRequest, auth.ListApiKeysResponse,
    retry=True,  # a read
)  # fmt: skip
UPDATE_API_KEY = _method(
    _A, auth, "ApiKeyService", "UpdateApiKey",
    auth.UpdateApiKeyRequest, auth.UpdateApiKeyResponse,
    retry=True,  # sets the masked fields to the values given: a repeat leaves the same key
)  # fmt: skip
REVOKE_API_KEY = _method(
    _A, auth, "ApiKeyService", "RevokeApiKey",
    auth.RevokeApiKeyRequest, auth.RevokeApiKeyResponse,
    retry=True,  # "revoking a revoked key changes nothing" (auth's ApiKeyManager.revoke)
)  # fmt: skip
DELETE_API_KEY = _method(
    _A, auth, "ApiKeyService", "DeleteApiKey",
    auth.DeleteApiKeyRequest, auth.DeleteApiKeyResponse,
    retry=False,  # a repeat after a lost answer says NOT_FOUND for a key that was deleted
)  # fmt: skip
ROTATE_API_KEY = _method(
    _A, auth, "ApiKeyService", "RotateApiKey",
    auth.RotateApiKeyRequest, auth.RotateApiKeyResponse,
    retry=False,  # each call issues a new secret and ends the one a lost answer carried
)  # fmt: skip

# -- inferplane.auth.v1.UsageLedgerService ---------------------------------------------------
QUERY_USAGE = _method(
    _A, usage, "UsageLedgerService", "QueryUsage",
    usage.QueryUsageRequest, usage.QueryUsageResponse,
    retry=True,  # a read
)  # fmt: skip

# -- inferplane.orchestrator.v1.DeploymentService ----------------------------------------------
CREATE_DEPLOYMENT = _method(
    _O, orch, "DeploymentService", "CreateDeployment",
    orch.CreateDeploymentRequest, orch.CreateDeploymentResponse,
    retry=False,  # a repeat after a lost answer says ALREADY_EXISTS
)  # fmt: skip
PREVIEW_DEPLOYMENT = dataclasses.replace(
    CREATE_DEPLOYMENT,
    retry=True,  # CreateDeployment with validate_only: creates nothing
)
GET_DEPLOYMENT = _method(
    _O, orch, "DeploymentService", "GetDeployment",
    orch.GetDeploymentRequest, orch.GetDeploymentResponse,
    retry=True,  # a read
)  # fmt: skip
LIST_DEPLOYMENTS = _method(
    _O, orch, "DeploymentService", "ListDeployments",
    orch.ListDeploymentsRequest, orch.ListDeploymentsResponse,
    retry=True,  # a read
)  # fmt: skip
UPDATE_DEPLOYMENT = _method(
    _O, orch, "DeploymentService", "UpdateDeployment",
    orch.UpdateDeploymentRequest, orch.UpdateDeploymentResponse,
    retry=True,  # the revision is a hash of the profile: a repeat with the same values gives
    # the same revision and starts no second rollout (orchestrator's ControlPlane.update)
)  # fmt: skip
DELETE_DEPLOYMENT = _method(
    _O, orch, "DeploymentService", "DeleteDeployment",
    orch.DeleteDeploymentRequest, orch.DeleteDeploymentResponse,
    retry=False,  # a repeat after a lost answer says NOT_FOUND
)  # fmt: skip
LIST_DEPLOYMENT_REPLICAS = _method(
    _O, orch, "DeploymentService", "ListDeploymentReplicas",
    orch.ListDeploymentReplicasRequest, orch.ListDeploymentReplicasResponse,
    retry=True,  # a read
)  # fmt: skip
EXPLAIN_PLACEMENT = _method(
    _O, orch, "DeploymentService", "ExplainPlacement",
    orch.ExplainPlacementRequest, orch.ExplainPlacementResponse,
    retry=True,  # a read
)  # fmt: skip
LIST_AUTOSCALER_DECISIONS = _method(
    _O, orch, "DeploymentService", "ListAutoscalerDecisions",
    orch.ListAutoscalerDecisionsRequest, orch.ListAutoscalerDecisionsResponse,
    retry=True,  # a read
)  # fmt: skip
CREATE_ADAPTER = _method(
    _O, orch, "DeploymentService", "CreateAdapter",
    orch.CreateAdapterRequest, orch.CreateAdapterResponse,
    retry=False,  # a repeat after a lost answer says ALREADY_EXISTS
)  # fmt: skip
GET_ADAPTER = _method(
    _O, orch, "DeploymentService", "GetAdapter",
    orch.GetAdapterRequest, orch.GetAdapterResponse,
    retry=True,  # a read
)  # fmt: skip
LIST_ADAPTERS = _method(
    _O, orch, "DeploymentService", "ListAdapters",
    orch.ListAdaptersRequest, orch.ListAdaptersResponse,
    retry=True,  # a read
)  # fmt: skip
DELETE_ADAPTER = _method(
    _O, orch, "DeploymentService", "DeleteAdapter",
    orch.DeleteAdapterRequest, orch.DeleteAdapterResponse,
    retry=False,  # a repeat after a lost answer may say NOT_FOUND (an adapter without drain)
)  # fmt: skip
LIST_COMPATIBILITY = _method(
    _O, orch, "DeploymentService", "ListCompatibility",
    orch.ListCompatibilityRequest, orch.ListCompatibilityResponse,
    retry=True,  # a read
)  # fmt: skip
LIST_FORCED_CHANGES = _method(
    _O, orch, "DeploymentService", "ListForcedChanges",
    orch.ListForcedChangesRequest, orch.ListForcedChangesResponse,
    retry=True,  # a read
)  # fmt: skip

# -- inferplane.orchestrator.v1.NodeService ----------------------------------------------------
GET_NODE = _method(
    _O, orch, "NodeService", "GetNode",
    orch.GetNodeRequest, orch.GetNodeResponse,
    retry=True,  # a read
)  # fmt: skip
LIST_NODES = _method(
    _O, orch, "NodeService", "ListNodes",
    orch.ListNodesRequest, orch.ListNodesResponse,
    retry=True,  # a read
)  # fmt: skip
DRAIN_NODE = _method(
    _O, orch, "NodeService", "DrainNode",
    orch.DrainNodeRequest, orch.DrainNodeResponse,
    retry=True,  # sets unschedulable: a drained node stays drained
)  # fmt: skip
UNCORDON_NODE = _method(
    _O, orch, "NodeService", "UncordonNode",
    orch.UncordonNodeRequest, orch.UncordonNodeResponse,
    retry=True,  # clears unschedulable: a schedulable node stays schedulable
)  # fmt: skip

# -- inferplane.inference.v1.InferenceService --------------------------------------------------
# A replica answers UNAVAILABLE only when no output was generated (engine not ready, draining,
# an engine failure before the first token: docs/architecture.md, "Failure semantics"); the
# edge retries exactly these on another replica. A stream is retried only before its first
# chunk (the transport's rule).
CREATE_CHAT_COMPLETION = _method(
    _I, inf, "InferenceService", "CreateChatCompletion",
    inf.CreateChatCompletionRequest, inf.CreateChatCompletionResponse,
    retry=True,
)  # fmt: skip
STREAM_CHAT_COMPLETION = _method(
    _I, inf, "InferenceService", "StreamChatCompletion",
    inf.StreamChatCompletionRequest, inf.StreamChatCompletionResponse,
    retry=True,
)  # fmt: skip
CREATE_EMBEDDING = _method(
    _I, inf, "InferenceService", "CreateEmbedding",
    inf.CreateEmbeddingRequest, inf.CreateEmbeddingResponse,
    retry=True,
)  # fmt: skip
LIST_MODELS = _method(
    _I, inf, "InferenceService", "ListModels",
    inf.ListModelsRequest, inf.ListModelsResponse,
    retry=True,  # a read
)  # fmt: skip

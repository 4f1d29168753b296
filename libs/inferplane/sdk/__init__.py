"""inferplane's Python SDK: typed clients for the admin APIs and for inference over gRPC
(issue 21; examples in docs/sdk.md).

    from inferplane.sdk import Client

    with Client(auth="127.0.0.1:50051", orchestrator="127.0.0.1:50053", admin_key=key) as c:
        created = c.keys.create(auth_pb2.ApiKey(tenant="acme", scopes=["inference"]))
        for deployment in c.deployments.list():
            print(deployment.name, c.deployments.explain(deployment.name))

- `Client` (blocking) and `AsyncClient` (grpc.aio) have the same sub-clients: `keys` and
  `usage` (auth),
  `deployments` and `nodes` (orchestrator), `inference` (a replica process's
  `InferenceService`). They present an operator identity over mutual TLS
  (`operator_security()` unless given a `PeerSecurity`).
- Arguments and results are the API's protos (`inferplane.api.*`); inference requests may
  also be OpenAI's JSON bodies as dicts. `keys.create` / `keys.rotate` return a
  `KeyWithSecret`; lists return `Paged` / `AsyncPaged` iterators that fetch page by page.
- Every call has a deadline (the client's `timeout`, or its own `timeout=`); UNAVAILABLE is
  retried with exponential backoff and full jitter (`RetryPolicy`) only for calls a repeat
  cannot change (reads, updates, revoke, drain; never a create, rotate or delete:
  `inferplane.sdk._methods` gives each method's reason).
- Errors are the platform's one error root, `InferplaneError` (re-exported here), rebuilt
  from the status: the class of the gRPC code, `grpc_code`, `http_status` (what the edge
  answers), OpenAI's `openai_type` / `code` / `param`, `message`, `reason` (ErrorInfo).
- `usage` reads the usage ledger (auth): request rows, or totals per hour, day, model, key or
  tenant, filtered by time, key, tenant and model.
- `MultiRegionUsage` / `AsyncMultiRegionUsage` read several regions' ledgers (region name →
  auth address or client) and `merge_usage` them: each request id once (`MERGE_RULE`), each
  row labelled with its region, totals and groups summed from the merged rows; a region that
  cannot be read raises `UnavailableError` with reason `USAGE_INCOMPLETE` (or, with
  `partial=True`, is named in `MergedUsage.missing`).
"""

from inferplane.runtime import (
    AlreadyExistsError,
    ConfigError,
    DeadlineExceededError,
    FailedPreconditionError,
    InferplaneError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from inferplane.sdk._async_client import (
    AsyncClient,
    AsyncDeployments,
    AsyncInference,
    AsyncKeys,
    AsyncNodes,
    AsyncUsage,
)
from inferplane.sdk._client import Client, Deployments, Inference, Keys, Nodes, Usage
from inferplane.sdk._pages import AsyncPaged, Page, Paged
from inferplane.sdk._regions import (
    MERGE_RULE,
    MERGED_GROUPINGS,
    AsyncMultiRegionUsage,
    MergedUsage,
    MultiRegionUsage,
    RegionRow,
    incomplete_usage_error,
    merge_usage,
)
from inferplane.sdk._requests import KeyWithSecret
from inferplane.sdk._transport import RetryPolicy

__all__ = [
    "MERGED_GROUPINGS",
    "MERGE_RULE",
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncDeployments",
    "AsyncInference",
    "AsyncKeys",
    "AsyncMultiRegionUsage",
    "AsyncNodes",
    "AsyncPaged",
    "AsyncUsage",
    "Client",
    "ConfigError",
    "DeadlineExceededError",
    "Deployments",
    "FailedPreconditionError",
    "Inference",
    "InferplaneError",
    "InternalError",
    "InvalidArgumentError",
    "KeyWithSecret",
    "Keys",
    "MergedUsage",
    "MultiRegionUsage",
    "Nodes",
    "NotFoundError",
    "Page",
    "Paged",
    "PermissionDeniedError",
    "RegionRow",
    "ResourceExhaustedError",
    "RetryPolicy",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "incomplete_usage_error",
    "merge_usage",
]

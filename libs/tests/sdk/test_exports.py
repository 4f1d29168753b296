"""The SDK's public surface, pinned: a name added or removed is a decision, not an accident."""

from __future__ import annotations

import inferplane.runtime as runtime
import inferplane.sdk as sdk

EXPORTS = {
    "MERGE_RULE",
    "MERGED_GROUPINGS",
    "AsyncMultiRegionUsage",
    "MergedUsage",
    "MultiRegionUsage",
    "RegionRow",
    "incomplete_usage_error",
    "merge_usage",
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncDeployments",
    "AsyncInference",
    "AsyncKeys",
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
    "Nodes",
    "NotFoundError",
    "Page",
    "Paged",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
}


def test_exports() -> None:
    assert set(sdk.__all__) == EXPORTS
    assert all(hasattr(sdk, name) for name in EXPORTS)


def test_one_error_root() -> None:
    """The SDK raises the platform's own error classes (one root for the library)."""
    for name in EXPORTS:
        value = getattr(sdk, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert value is getattr(runtime, name)
            assert issubclass(value, runtime.InferplaneError)

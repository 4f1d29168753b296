"""UsageService.ReportUsage over real gRPC: tokens reach the key's window, re-sent batches
count once, and only internal callers are accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from inferplane.api.auth.v1 import auth_pb2, usage_pb2, usage_pb2_grpc
from inferplane.auth.ledger import UsageQuery
from inferplane.runtime import PermissionDeniedError, UnauthenticatedError, UnavailableError
from inferplane.runtime.security.internal import InternalCallerGuard, is_loopback_peer
from inferplane.wire.headers import INTERNAL_TOKEN

RESOURCE_EXHAUSTED = 8


def _key(auth: Any, **limits: int) -> tuple[str, str]:
    created = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(
            api_key=auth_pb2.ApiKey(tenant="acme", limits=auth_pb2.Limits(**limits))
        ),
        metadata=auth.admin_md(),
    )
    return created.secret, created.api_key.name.split("/")[1]


def _usage(key_id: str, request_id: str, prompt: int, completion: int) -> usage_pb2.RequestUsage:
    return usage_pb2.RequestUsage(
        key_id=key_id,
        request_id=request_id,
        model="kimi-tiny",
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def _report(auth: Any, *usage: usage_pb2.RequestUsage, metadata: Any = ()) -> None:
    stub = usage_pb2_grpc.UsageServiceStub(auth.channel)
    stub.ReportUsage(usage_pb2.ReportUsageRequest(usage=list(usage)), metadata=metadata, timeout=5)


def test_reported_tokens_refuse_the_key_until_its_window_resets(auth: Any) -> None:
    """A re-sent batch (the sender's call failed after delivery) is accounted once."""
    secret, key_id = _key(auth, tokens_per_minute=100)
    assert auth.check(secret, extra={"x-request-id": "r1"}).status.code == 0
    _report(auth, _usage(key_id, "r1", 40, 20))
    _report(auth, _usage(key_id, "r1", 40, 20))  # duplicate: not counted again
    assert auth.check(secret, extra={"x-request-id": "r2"}).status.code == 0
    _report(auth, _usage(key_id, "r2", 30, 10), _usage("", "x", 5, 5))  # invalid entry skipped
    refused = auth.check(secret, extra={"x-request-id": "r3"})
    assert refused.status.code == RESOURCE_EXHAUSTED
    assert refused.denied_response.status.code == 429
    auth.clock.advance(60)
    assert auth.check(secret, extra={"x-request-id": "r4"}).status.code == 0
    metrics = auth.components.registry
    counts = {
        o: metrics.get_sample_value("inferplane_auth_usage_requests_total", {"outcome": o})
        for o in ("accounted", "duplicate", "invalid")
    }
    assert counts == {"accounted": 2.0, "duplicate": 1.0, "invalid": 1.0}


def test_a_counter_store_failure_after_the_ledger_write_does_not_fail_the_batch(
    auth: Any,
) -> None:
    """The ledger row is the record: once written, the batch succeeds even when the minute's
    token window cannot be updated (a re-send would find the rows and never add the tokens),
    so the router does not re-send it and every row is accounted once."""
    _, key_id = _key(auth, tokens_per_minute=100)
    limiter = auth.components.limiter

    async def store_away(key: str, tokens: int) -> None:
        raise UnavailableError("the rate-limit store is unavailable")

    real, limiter.record_usage = limiter.record_usage, store_away
    try:
        _report(auth, _usage(key_id, "w1", 4, 2), _usage(key_id, "w2", 3, 1))
    finally:
        limiter.record_usage = real
    _report(auth, _usage(key_id, "w1", 4, 2))  # a copy: the row is there
    rows = auth.components.ledger.query(UsageQuery(key_id=key_id)).rows
    assert sorted(r.request_id for r in rows) == ["w1", "w2"]
    metrics = auth.components.registry
    counts = {
        o: metrics.get_sample_value("inferplane_auth_usage_requests_total", {"outcome": o})
        for o in ("accounted", "duplicate")
    }
    assert counts == {"accounted": 2.0, "duplicate": 1.0}


def test_a_configured_internal_token_is_required(
    tmp_path: Path, make_settings: Any, start_auth: Any
) -> None:
    with start_auth(make_settings(tmp_path, internal_token="s3cret-internal")) as auth:
        _, key_id = _key(auth, tokens_per_minute=10)
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (((INTERNAL_TOKEN, "wrong"),), grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(grpc.RpcError) as info:
                _report(auth, _usage(key_id, "r1", 1, 1), metadata=metadata)
            assert info.value.code() == code
        _report(auth, _usage(key_id, "r1", 1, 1), metadata=((INTERNAL_TOKEN, "s3cret-internal"),))


def test_without_a_token_only_loopback_peers_are_accepted() -> None:
    guard = InternalCallerGuard()
    for peer in ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/run/auth.sock"):
        assert is_loopback_peer(peer)
        guard.check({}, peer, None)
    for peer in ("ipv4:10.0.0.7:5000", "ipv6:[2001:db8::1]:5000", "", "garbage"):
        assert not is_loopback_peer(peer)
        with pytest.raises(PermissionDeniedError):
            guard.check({}, peer, None)
    with pytest.raises(UnauthenticatedError):
        InternalCallerGuard("t0ken").check({}, "ipv4:127.0.0.1:1", None)

"""The `console` scope over real gRPC (issue 21): a tenant's console key sees and manages only
its own tenant's keys and usage, never grants or touches the admin scope; an admin sees all."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from inferplane.api.auth.v1 import auth_pb2, usage_pb2, usage_pb2_grpc

Req = auth_pb2


def _create(auth: Any, md: Any, **fields: Any) -> auth_pb2.CreateApiKeyResponse:
    response: auth_pb2.CreateApiKeyResponse = auth.keys.CreateApiKey(
        Req.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(**fields)), metadata=md, timeout=5
    )
    return response


def _error(call: Any, request: Any, md: Any) -> Any:
    with pytest.raises(grpc.RpcError) as info:
        call(request, metadata=md, timeout=5)
    return info.value


@pytest.fixture
def tenants(auth: Any) -> dict[str, Any]:
    """Console keys of tenants acme and globex, an inference key of each, and an admin-scoped
    key inside acme."""
    admin = auth.admin_md()
    made = {
        "acme_console": _create(auth, admin, tenant="acme", scopes=["console", "inference"]),
        "globex_console": _create(auth, admin, tenant="globex", scopes=["console"]),
        "acme_app": _create(auth, admin, tenant="acme", scopes=["inference"]),
        "globex_app": _create(auth, admin, tenant="globex", scopes=["inference"]),
        "acme_admin": _create(auth, admin, tenant="acme", scopes=["admin"]),
    }
    return made


def test_console_scope_is_known_and_lists_only_its_own_tenant(
    auth: Any, tenants: dict[str, Any]
) -> None:
    acme = auth.admin_md(tenants["acme_console"].secret)
    listed = auth.keys.ListApiKeys(Req.ListApiKeysRequest(), metadata=acme, timeout=5)
    assert {k.tenant for k in listed.api_keys} == {"acme"}
    assert {k.name for k in listed.api_keys} == {
        tenants[n].api_key.name for n in ("acme_console", "acme_app", "acme_admin")
    }
    err = _error(auth.keys.ListApiKeys, Req.ListApiKeysRequest(tenant="globex"), acme)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    # The admin still sees every tenant.
    everyone = auth.keys.ListApiKeys(Req.ListApiKeysRequest(), metadata=auth.admin_md())
    assert {"acme", "globex", "system"} <= {k.tenant for k in everyone.api_keys}


def test_another_tenants_key_is_not_found_to_a_console_key(
    auth: Any, tenants: dict[str, Any]
) -> None:
    """A console key cannot read, revoke, rotate, update or delete another tenant's key, and
    the answer does not reveal that the key exists."""
    acme = auth.admin_md(tenants["acme_console"].secret)
    other = tenants["globex_app"].api_key.name
    for call, request in (
        (auth.keys.GetApiKey, Req.GetApiKeyRequest(name=other)),
        (auth.keys.RevokeApiKey, Req.RevokeApiKeyRequest(name=other)),
        (auth.keys.RotateApiKey, Req.RotateApiKeyRequest(name=other)),
        (auth.keys.DeleteApiKey, Req.DeleteApiKeyRequest(name=other)),
        (
            auth.keys.UpdateApiKey,
            Req.UpdateApiKeyRequest(api_key=auth_pb2.ApiKey(name=other, display_name="x")),
        ),
    ):
        err = _error(call, request, acme)
        assert err.code() == grpc.StatusCode.NOT_FOUND, call
        assert "not found" in err.details()
    got = auth.keys.GetApiKey(Req.GetApiKeyRequest(name=other), metadata=auth.admin_md())
    assert got.api_key.state == auth_pb2.ApiKey.STATE_ACTIVE  # untouched


def test_console_key_manages_its_own_tenant(auth: Any, tenants: dict[str, Any]) -> None:
    acme = auth.admin_md(tenants["acme_console"].secret)
    made = _create(auth, acme, display_name="ci", scopes=["inference"])
    assert made.api_key.tenant == "acme" and made.secret.startswith("ip-")
    rotated = auth.keys.RotateApiKey(
        Req.RotateApiKeyRequest(name=made.api_key.name), metadata=acme, timeout=5
    )
    assert rotated.secret != made.secret
    revoked = auth.keys.RevokeApiKey(
        Req.RevokeApiKeyRequest(name=made.api_key.name), metadata=acme, timeout=5
    )
    assert revoked.api_key.state == auth_pb2.ApiKey.STATE_REVOKED
    err = _error(
        auth.keys.CreateApiKey,
        Req.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="globex")),
        acme,
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "acme" in err.details()


def test_console_key_never_reaches_the_admin_scope(auth: Any, tenants: dict[str, Any]) -> None:
    """No escalation: a console key cannot create a key with the admin scope, add it to a key,
    or rotate / revoke / change an admin key of its own tenant (rotating would hand it the
    admin secret)."""
    acme = auth.admin_md(tenants["acme_console"].secret)
    err = _error(
        auth.keys.CreateApiKey,
        Req.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(scopes=["admin"])),
        acme,
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    app = tenants["acme_app"].api_key.name
    err = _error(
        auth.keys.UpdateApiKey,
        Req.UpdateApiKeyRequest(
            api_key=auth_pb2.ApiKey(name=app, scopes=["inference", "admin"]),
            update_mask={"paths": ["scopes"]},
        ),
        acme,
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    admin_key = tenants["acme_admin"].api_key.name
    for call, request in (
        (auth.keys.RotateApiKey, Req.RotateApiKeyRequest(name=admin_key)),
        (auth.keys.RevokeApiKey, Req.RevokeApiKeyRequest(name=admin_key)),
        (auth.keys.DeleteApiKey, Req.DeleteApiKeyRequest(name=admin_key)),
    ):
        assert _error(call, request, acme).code() == grpc.StatusCode.PERMISSION_DENIED


def test_inference_key_is_refused_and_edge_headers_carry_the_tenant(
    auth: Any, tenants: dict[str, Any]
) -> None:
    err = _error(
        auth.keys.ListApiKeys,
        Req.ListApiKeysRequest(),
        auth.admin_md(tenants["acme_app"].secret),
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "console" in err.details()
    # Through the edge, the Check's headers name the tenant a console key is bound to.
    edge = (
        ("x-inferplane-scopes", "console"),
        ("x-inferplane-key-id", "k"),
        ("x-inferplane-tenant", "globex"),
    )
    listed = auth.keys.ListApiKeys(Req.ListApiKeysRequest(), metadata=edge, timeout=5)
    assert {k.tenant for k in listed.api_keys} == {"globex"}


def test_console_key_reads_only_its_tenants_usage(auth: Any, tenants: dict[str, Any]) -> None:
    report = usage_pb2_grpc.UsageServiceStub(auth.channel)
    rows = []
    for i, name in enumerate(("acme_app", "globex_app")):
        key_id = tenants[name].api_key.name.split("/")[1]
        rows.append(
            usage_pb2.RequestUsage(
                key_id=key_id,
                request_id=f"r{i}",
                model="kimi-tiny",
                prompt_tokens=10,
                completion_tokens=5,
            )
        )
    report.ReportUsage(usage_pb2.ReportUsageRequest(usage=rows), timeout=5)
    ledger = usage_pb2_grpc.UsageLedgerServiceStub(auth.channel)
    acme = auth.admin_md(tenants["acme_console"].secret)
    seen = ledger.QueryUsage(usage_pb2.QueryUsageRequest(), metadata=acme, timeout=5)
    assert [r.tenant for r in seen.rows] == ["acme"]
    grouped = ledger.QueryUsage(
        usage_pb2.QueryUsageRequest(group_by="tenant"), metadata=acme, timeout=5
    )
    assert [g.group for g in grouped.groups] == ["acme"]
    other_key = tenants["globex_app"].api_key.name.split("/")[1]
    by_key = ledger.QueryUsage(usage_pb2.QueryUsageRequest(key_id=other_key), metadata=acme)
    assert list(by_key.rows) == []
    err = _error(ledger.QueryUsage, usage_pb2.QueryUsageRequest(tenant="globex"), acme)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    everything = ledger.QueryUsage(usage_pb2.QueryUsageRequest(), metadata=auth.admin_md())
    assert sorted(r.tenant for r in everything.rows) == ["acme", "globex"]

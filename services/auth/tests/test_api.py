"""ApiKeyService over real gRPC against SQLite: what an admin sees and what it changes."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.domain import AuditAction

Req = auth_pb2


def create(auth: Any, **fields: Any) -> auth_pb2.CreateApiKeyResponse:
    fields.setdefault("tenant", "acme")
    response: auth_pb2.CreateApiKeyResponse = auth.keys.CreateApiKey(
        Req.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(**fields)),
        metadata=auth.admin_md(),
        timeout=5,
    )
    return response


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> Any:
    """The grpc.RpcError (also a grpc.Call: code(), details(), trailing_metadata()) raised."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=5, **kwargs)
    return info.value


def trailer(err: Any, key: str) -> str | None:
    """A trailing-metadata value of a failed call."""
    return {k: str(v) for k, v in err.trailing_metadata() or ()}.get(key)


def test_create_shows_the_secret_once_and_get_never(auth: Any) -> None:
    created = create(
        auth,
        display_name="ci",
        scopes=["inference"],
        allowed_models=["kimi-tiny"],
        tier="priority",
        limits=auth_pb2.Limits(requests_per_minute=60, tokens_per_minute=1000),
    )
    secret = created.secret
    assert secret.startswith("ip-") and len(secret) == 46
    key = created.api_key
    assert key.name.startswith("api-keys/")
    assert key.key_prefix == secret[:8]
    assert key.state == auth_pb2.ApiKey.STATE_ACTIVE
    assert (key.tenant, list(key.scopes), list(key.allowed_models), key.tier) == (
        "acme",
        ["inference"],
        ["kimi-tiny"],
        "priority",
    )
    assert key.limits.requests_per_minute == 60 and key.limits.max_concurrent_requests == 0
    assert key.create_time.ToDatetime() == auth.clock.now().replace(tzinfo=None)

    got = auth.keys.GetApiKey(Req.GetApiKeyRequest(name=key.name), metadata=auth.admin_md())
    listed = auth.keys.ListApiKeys(Req.ListApiKeysRequest(), metadata=auth.admin_md())
    for msg in (got, listed):
        assert secret.encode() not in msg.SerializeToString()
        assert secret[8:].encode() not in msg.SerializeToString()
    assert got.api_key == key


def test_database_holds_no_plaintext_secret(auth: Any) -> None:
    secret = create(auth).secret
    rotated = auth.keys.RotateApiKey(
        Req.RotateApiKeyRequest(name=create(auth).api_key.name, grace_period_seconds=60),
        metadata=auth.admin_md(),
    ).secret
    auth.components.store.close()  # checkpoint nothing in memory; read every file on disk
    blobs = b"".join(p.read_bytes() for p in auth.settings.data_dir.glob("auth.db*"))
    assert blobs, "the SQLite database should exist in data_dir"
    for s in (secret, rotated, auth.admin_key):
        assert s.encode() not in blobs
        assert s[10:30].encode() not in blobs


def test_list_pages_newest_first_with_filters(auth: Any) -> None:
    names = []
    for i in range(5):
        names.append(create(auth, display_name=f"k{i}", tenant="a" if i % 2 else "b").api_key.name)
        auth.clock.advance(1)
    auth.keys.RevokeApiKey(Req.RevokeApiKeyRequest(name=names[4]), metadata=auth.admin_md())

    seen, token, pages = [], "", 0
    while True:
        page = auth.keys.ListApiKeys(
            Req.ListApiKeysRequest(page_size=2, page_token=token, show_inactive=True),
            metadata=auth.admin_md(),
        )
        seen += [k.name for k in page.api_keys if k.tenant in ("a", "b")]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == names[::-1]  # newest first, every key exactly once
    assert pages == 3  # 5 keys + the bootstrap admin key, 2 per page

    active = auth.keys.ListApiKeys(Req.ListApiKeysRequest(tenant="b"), metadata=auth.admin_md())
    assert [k.name for k in active.api_keys] == [names[2], names[0]]  # names[4] is revoked
    with_inactive = auth.keys.ListApiKeys(
        Req.ListApiKeysRequest(tenant="b", show_inactive=True), metadata=auth.admin_md()
    )
    assert [k.name for k in with_inactive.api_keys] == [names[4], names[2], names[0]]
    assert with_inactive.api_keys[0].state == auth_pb2.ApiKey.STATE_REVOKED


def test_page_token_must_match_its_filters(auth: Any) -> None:
    for _ in range(3):
        create(auth)
    page = auth.keys.ListApiKeys(
        Req.ListApiKeysRequest(page_size=1, tenant="acme"), metadata=auth.admin_md()
    )
    assert page.next_page_token
    err = rpc_error(
        auth.keys.ListApiKeys,
        Req.ListApiKeysRequest(page_size=1, page_token=page.next_page_token, tenant="other"),
        metadata=auth.admin_md(),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailer(err, "x-openai-error-param") == "page_token"
    err = rpc_error(
        auth.keys.ListApiKeys,
        Req.ListApiKeysRequest(page_token="garbage!"),
        metadata=auth.admin_md(),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_update_mask_changes_only_named_fields(auth: Any) -> None:
    key = create(
        auth,
        display_name="old",
        tier="standard",
        limits=auth_pb2.Limits(requests_per_minute=10, tokens_per_minute=20),
    ).api_key
    auth.clock.advance(5)
    patch = auth_pb2.ApiKey(
        name=key.name,
        display_name="new",
        tier="priority",  # not in the mask: must not change
        limits=auth_pb2.Limits(requests_per_minute=99, tokens_per_minute=0),
    )
    updated = auth.keys.UpdateApiKey(
        Req.UpdateApiKeyRequest(
            api_key=patch,
            update_mask=field_mask_pb2.FieldMask(
                paths=["display_name", "limits.requests_per_minute"]
            ),
        ),
        metadata=auth.admin_md(),
    ).api_key
    assert updated.display_name == "new"
    assert updated.tier == "standard"
    assert updated.limits.requests_per_minute == 99
    assert updated.limits.tokens_per_minute == 20  # the other limit is kept
    assert updated.update_time.ToDatetime() > key.update_time.ToDatetime()
    assert updated.create_time == key.create_time

    implied = auth.keys.UpdateApiKey(  # no mask: the fields set in the message (AIP-134)
        Req.UpdateApiKeyRequest(api_key=auth_pb2.ApiKey(name=key.name, scopes=["admin"])),
        metadata=auth.admin_md(),
    ).api_key
    assert list(implied.scopes) == ["admin"] and implied.display_name == "new"


def test_update_rejects_bad_fields_naming_each(auth: Any) -> None:
    key = create(auth).api_key
    err = rpc_error(
        auth.keys.UpdateApiKey,
        Req.UpdateApiKeyRequest(
            api_key=auth_pb2.ApiKey(name=key.name),
            update_mask=field_mask_pb2.FieldMask(paths=["tenant", "key_prefix", "colour"]),
        ),
        metadata=auth.admin_md(),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    message: str = err.details()
    assert "'tenant' cannot be changed" in message
    assert "'key_prefix' is output only" in message
    assert "'colour' is not a field of ApiKey" in message
    assert trailer(err, "x-openai-error-param") == "update_mask"

    err = rpc_error(
        auth.keys.UpdateApiKey,
        Req.UpdateApiKeyRequest(
            api_key=auth_pb2.ApiKey(name=key.name, scopes=["inference", "superuser"]),
            update_mask=field_mask_pb2.FieldMask(paths=["scopes"]),
        ),
        metadata=auth.admin_md(),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'superuser'" in err.details()
    assert trailer(err, "x-openai-error-param") == "api_key.scopes"


def test_create_rejects_unknown_scope_and_past_expiry(auth: Any) -> None:
    err = rpc_error(
        auth.keys.CreateApiKey,
        Req.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="acme", scopes=["root"])),
        metadata=auth.admin_md(),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "known scopes" in err.details()
    past = auth_pb2.ApiKey(tenant="acme")
    past.expire_time.FromDatetime(auth.clock.now() - timedelta(seconds=1))
    err = rpc_error(
        auth.keys.CreateApiKey, Req.CreateApiKeyRequest(api_key=past), metadata=auth.admin_md()
    )
    assert trailer(err, "x-openai-error-param") == "api_key.expire_time"


def test_admin_rpcs_need_an_admin(auth: Any) -> None:
    user_key = create(auth, scopes=["inference"]).secret
    request = Req.ListApiKeysRequest()

    err = rpc_error(auth.keys.ListApiKeys, request)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert trailer(err, "x-openai-error-code") == "invalid_api_key"
    err = rpc_error(auth.keys.ListApiKeys, request, metadata=auth.admin_md("ip-" + "x" * 43))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    err = rpc_error(auth.keys.ListApiKeys, request, metadata=auth.admin_md(user_key))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert trailer(err, "x-openai-error-code") == "insufficient_scope"
    # Through the edge: Check's headers say who is calling.
    err = rpc_error(
        auth.keys.ListApiKeys,
        request,
        metadata=(("x-inferplane-scopes", "inference"), ("x-inferplane-key-id", "k1")),
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    edge_admin = (("x-inferplane-scopes", "admin,inference"), ("x-inferplane-key-id", "edgeadm"))
    created = auth.keys.CreateApiKey(
        Req.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(tenant="t")), metadata=edge_admin
    )
    key_id = created.api_key.name.split("/")[1]
    [event] = auth.run(auth.components.manager.audit_events(key_id))
    assert event.actor_key_id == "edgeadm"


def test_edge_headers_are_ignored_when_not_trusted(
    tmp_path: Any, make_settings: Any, start_auth: Any
) -> None:
    with start_auth(make_settings(tmp_path, trust_edge_headers=False)) as auth:
        err = rpc_error(
            auth.keys.ListApiKeys,
            Req.ListApiKeysRequest(),
            metadata=(("x-inferplane-scopes", "admin"),),
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_revoke_stops_the_key_at_once_on_this_instance(auth: Any) -> None:
    created = create(auth)
    assert auth.check(created.secret).status.code == 0  # now cached
    revoked = auth.keys.RevokeApiKey(
        Req.RevokeApiKeyRequest(name=created.api_key.name), metadata=auth.admin_md()
    ).api_key
    assert revoked.state == auth_pb2.ApiKey.STATE_REVOKED
    assert revoked.revoke_time.ToDatetime() == auth.clock.now().replace(tzinfo=None)
    denied = auth.check(created.secret)
    assert denied.denied_response.status.code == 401
    assert "revoked" in denied.denied_response.body
    again = auth.keys.RevokeApiKey(  # idempotent
        Req.RevokeApiKeyRequest(name=created.api_key.name), metadata=auth.admin_md()
    ).api_key
    assert again.revoke_time == revoked.revoke_time
    err = rpc_error(
        auth.keys.RotateApiKey,
        Req.RotateApiKeyRequest(name=created.api_key.name),
        metadata=auth.admin_md(),
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_expiry_follows_the_clock(auth: Any) -> None:
    msg = auth_pb2.ApiKey(tenant="acme")
    msg.expire_time.FromDatetime(auth.clock.now() + timedelta(hours=1))
    created = auth.keys.CreateApiKey(Req.CreateApiKeyRequest(api_key=msg), metadata=auth.admin_md())
    assert auth.check(created.secret).status.code == 0
    auth.clock.advance(3599)
    assert auth.check(created.secret).status.code == 0
    auth.clock.advance(1)  # expire_time reached: the cached entry must not outlive it
    denied = auth.check(created.secret)
    assert denied.denied_response.status.code == 401 and "expired" in denied.denied_response.body
    got = auth.keys.GetApiKey(
        Req.GetApiKeyRequest(name=created.api_key.name), metadata=auth.admin_md()
    )
    assert got.api_key.state == auth_pb2.ApiKey.STATE_EXPIRED
    listed = auth.keys.ListApiKeys(Req.ListApiKeysRequest(tenant="acme"), metadata=auth.admin_md())
    assert list(listed.api_keys) == []


def test_rotate_keeps_the_old_secret_for_the_grace_period(auth: Any) -> None:
    created = create(auth)
    old = created.secret
    assert auth.check(old).status.code == 0
    rotated = auth.keys.RotateApiKey(
        Req.RotateApiKeyRequest(name=created.api_key.name, grace_period_seconds=300),
        metadata=auth.admin_md(),
    )
    new = rotated.secret
    assert new != old and rotated.api_key.key_prefix == new[:8]
    assert auth.check(new).status.code == 0
    auth.clock.advance(299)
    assert auth.check(old).status.code == 0
    auth.clock.advance(1)
    assert auth.check(old).denied_response.status.code == 401
    assert auth.check(new).status.code == 0

    again = auth.keys.RotateApiKey(  # no grace: the previous secret stops at once
        Req.RotateApiKeyRequest(name=created.api_key.name), metadata=auth.admin_md()
    )
    assert auth.check(new).denied_response.status.code == 401
    assert auth.check(again.secret).status.code == 0


def test_delete_removes_the_key_and_audit_keeps_every_operation(auth: Any) -> None:
    created = create(auth)
    name = created.api_key.name
    key_id = name.split("/")[1]
    md = auth.admin_md()
    auth.keys.UpdateApiKey(
        Req.UpdateApiKeyRequest(
            api_key=auth_pb2.ApiKey(name=name, display_name="x"),
            update_mask=field_mask_pb2.FieldMask(paths=["display_name"]),
        ),
        metadata=md,
    )
    auth.keys.RotateApiKey(Req.RotateApiKeyRequest(name=name, grace_period_seconds=5), metadata=md)
    auth.keys.RevokeApiKey(Req.RevokeApiKeyRequest(name=name), metadata=md)
    auth.keys.DeleteApiKey(Req.DeleteApiKeyRequest(name=name), metadata=md)

    err = rpc_error(auth.keys.GetApiKey, Req.GetApiKeyRequest(name=name), metadata=md)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert auth.check(created.secret).denied_response.status.code == 401
    err = rpc_error(auth.keys.DeleteApiKey, Req.DeleteApiKeyRequest(name=name), metadata=md)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(auth.keys.GetApiKey, Req.GetApiKeyRequest(name="keys/1"), metadata=md)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

    events = auth.run(auth.components.manager.audit_events(key_id))
    assert [e.action for e in events] == [
        AuditAction.CREATE,
        AuditAction.UPDATE,
        AuditAction.ROTATE,
        AuditAction.REVOKE,
        AuditAction.DELETE,
    ]
    admin_id = next(
        e.key_id
        for e in auth.run(auth.components.manager.audit_events())
        if e.actor_key_id == "bootstrap"
    )
    assert {e.actor_key_id for e in events} == {admin_id}
    assert all(e.time == auth.clock.now() and e.tenant == "acme" for e in events)
    assert events[1].detail == {"fields": "display_name"}
    assert events[2].detail == {"grace_period_seconds": "5"}


def test_last_used_is_written_at_most_once_a_minute(auth: Any) -> None:
    created = create(auth)
    name = created.api_key.name

    def last_used() -> Any:
        got = auth.keys.GetApiKey(Req.GetApiKeyRequest(name=name), metadata=auth.admin_md())
        return (
            got.api_key.last_used_time.ToDatetime()
            if got.api_key.HasField("last_used_time")
            else None
        )

    assert last_used() is None
    first = auth.clock.now().replace(tzinfo=None)
    auth.check(created.secret)
    auth.clock.advance(30)
    auth.check(created.secret)
    auth.run(auth.components.flush_last_used())
    assert last_used() == first  # the second use, 30 s later, was not recorded
    auth.clock.advance(30)
    auth.check(created.secret)
    auth.run(auth.components.flush_last_used())
    assert last_used() == auth.clock.now().replace(tzinfo=None)


@pytest.mark.skipif(
    not os.environ.get("INFERPLANE_TEST_POSTGRES_URL"),
    reason="set INFERPLANE_TEST_POSTGRES_URL to run the service on PostgreSQL",
)
def test_service_runs_on_postgresql(tmp_path: Any, make_settings: Any, start_auth: Any) -> None:
    from inferplane.auth import schema
    from inferplane.auth.migrations import MIGRATIONS
    from inferplane.testing.databases import drop_schema

    url = os.environ["INFERPLANE_TEST_POSTGRES_URL"]
    drop_schema(url, MIGRATIONS, schema.METADATA)
    with start_auth(make_settings(tmp_path, database_url=url)) as auth:
        created = create(auth)
        assert auth.check(created.secret).status.code == 0
        auth.keys.RevokeApiKey(
            Req.RevokeApiKeyRequest(name=created.api_key.name), metadata=auth.admin_md()
        )
        assert auth.check(created.secret).denied_response.status.code == 401
        assert not list(auth.settings.data_dir.glob("auth.db*"))

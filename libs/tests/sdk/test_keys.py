"""`Client.keys` against a real auth service under mutual TLS: the lifecycle of a key, and
lists that span pages."""

from __future__ import annotations

import pytest

from inferplane.api.auth.v1 import auth_pb2
from inferplane.sdk import Client, FailedPreconditionError, KeyWithSecret, NotFoundError


def _key(tenant: str, label: str = "") -> auth_pb2.ApiKey:
    return auth_pb2.ApiKey(display_name=label, tenant=tenant, scopes=["inference"])


def test_create_get_update_rotate_revoke_delete(client: Client) -> None:
    created = client.keys.create(_key("acme", "ci"))
    assert isinstance(created, KeyWithSecret) and created.secret.startswith("ip-")
    key_id = created.api_key.name.removeprefix("api-keys/")
    assert created.secret.startswith(created.api_key.key_prefix)

    # A key id or a name; never the secret again.
    fetched = client.keys.get(key_id)
    assert fetched == client.keys.get(created.api_key.name)
    assert fetched.state == auth_pb2.ApiKey.STATE_ACTIVE
    assert created.secret not in str(fetched)

    updated = client.keys.update(
        auth_pb2.ApiKey(name=key_id, limits=auth_pb2.Limits(requests_per_minute=5)),
        ["limits.requests_per_minute"],
    )
    assert updated.limits.requests_per_minute == 5 and updated.display_name == "ci"

    rotated = client.keys.rotate(key_id, grace_period_seconds=60)
    assert rotated.secret != created.secret
    assert rotated.api_key.key_prefix != created.api_key.key_prefix

    revoked = client.keys.revoke(key_id)
    assert revoked.state == auth_pb2.ApiKey.STATE_REVOKED
    assert client.keys.revoke(key_id).revoke_time == revoked.revoke_time  # idempotent
    assert key_id not in {k.name.removeprefix("api-keys/") for k in client.keys.list()}
    inactive = client.keys.list(tenant="acme", show_inactive=True)
    assert [k.name for k in inactive] == [created.api_key.name]
    with pytest.raises(FailedPreconditionError) as info:
        client.keys.rotate(key_id)
    assert info.value.reason == "API_KEY_REVOKED"

    client.keys.delete(key_id)
    with pytest.raises(NotFoundError):
        client.keys.get(key_id)


def test_list_follows_pages(client: Client) -> None:
    names = [client.keys.create(_key("paged", f"k{i}")).api_key.name for i in range(5)]

    listing = client.keys.list(tenant="paged", page_size=2)
    pages = list(listing.pages())
    assert [len(p.items) for p in pages] == [2, 2, 1]
    assert [bool(p.next_page_token) for p in pages] == [True, True, False]
    # Every key once across the pages, in the pages' order; iterating again lists again.
    listed = [k.name for k in listing]
    assert listed == [k.name for p in pages for k in p.items]
    assert sorted(listed) == sorted(names)
    assert [k.name for k in listing] == listed

    # A listing resumes from a page token.
    rest = client.keys.list(tenant="paged", page_size=2, page_token=pages[0].next_page_token)
    assert [k.name for k in rest] == listed[2:]

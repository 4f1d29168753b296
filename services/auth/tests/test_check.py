"""Envoy ext_authz Check over real gRPC: the exact answers the edge turns into HTTP responses."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from datetime import timedelta
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.domain import SecretHasher
from inferplane.auth.ext_authz import Authorization
from inferplane.auth.verifier import KeyVerifier
from inferplane.runtime import UnavailableError
from inferplane.runtime.time.clock import SystemClock

UNAUTHENTICATED, PERMISSION_DENIED = 16, 7


def create(auth: Any, **fields: Any) -> auth_pb2.CreateApiKeyResponse:
    fields.setdefault("tenant", "acme")
    response: auth_pb2.CreateApiKeyResponse = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(api_key=auth_pb2.ApiKey(**fields)), metadata=auth.admin_md()
    )
    return response


def assert_denied(resp: Any, http_status: int, code: str, message_part: str) -> None:
    """The denial Envoy relays verbatim: status, JSON content type, OpenAI's error body."""
    denied = resp.denied_response
    assert resp.status.code == (UNAUTHENTICATED if http_status == 401 else PERMISSION_DENIED)
    assert denied.status.code == http_status
    assert [(h.header.key, h.header.value) for h in denied.headers] == [
        ("content-type", "application/json")
    ]
    body = json.loads(denied.body)
    assert set(body) == {"error"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] is None
    assert body["error"]["code"] == code
    assert message_part in body["error"]["message"]


@pytest.mark.parametrize(
    ("authorization", "message_part"),
    [
        (None, "You didn't provide an API key"),
        ("", "You didn't provide an API key"),
        ("Basic dXNlcjpwYXNz", "Malformed Authorization header"),
        ("Bearer", "Malformed Authorization header"),
        ("Bearer    ", "Malformed Authorization header"),
        ("Bearer short", "Malformed API key"),
        ("Bearer ip-has spaces and ünïcode-0123456789", "Malformed API key"),
        ("Bearer ip-" + "A" * 43, "Incorrect API key provided: ip-AAA***AAAA."),
    ],
)
def test_bad_credentials_get_401_with_openai_body(
    auth: Any, authorization: str | None, message_part: str
) -> None:
    resp = auth.check(None, authorization=authorization)
    assert_denied(resp, 401, "invalid_api_key", message_part)


def test_unknown_key_message_never_echoes_the_secret(auth: Any) -> None:
    guess = "ip-" + "Zq9" * 14 + "x"
    body = auth.check(guess).denied_response.body
    assert guess not in body and guess[6:-4] not in body


def test_valid_key_adds_identity_headers_and_strips_key_and_forgeries(auth: Any) -> None:
    created = create(auth, scopes=["inference"], allowed_models=["kimi-tiny", "m/x:1"])
    key_id = created.api_key.name.split("/")[1]
    resp = auth.check(
        created.secret,
        extra={
            "x-inferplane-tenant": "someone-else",
            "x-inferplane-scopes": "admin",
            "x-inferplane-internal-bypass": "1",
            "x-request-id": "r1",
        },
    )
    assert resp.status.code == 0 and resp.WhichOneof("http_response") == "ok_response"
    ok = resp.ok_response
    headers = {h.header.key: h.header.value for h in ok.headers}
    assert headers == {
        "x-inferplane-tenant": "acme",
        "x-inferplane-key-id": key_id,
        "x-inferplane-scopes": "inference",
        "x-inferplane-allowed-models": "kimi-tiny,m/x:1",
        "x-inferplane-tier": "standard",
    }
    # Overwrite (not append) replaces the client's forged copies of our five headers.
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert all(h.append_action == overwrite for h in ok.headers)
    assert sorted(ok.headers_to_remove) == [
        "authorization",
        "x-api-key",
        "x-inferplane-internal-bypass",
    ]


def test_anthropics_x_api_key_is_a_key_too(auth: Any) -> None:
    """`x-api-key: KEY` (Anthropic's convention) is accepted, and removed before any upstream;
    a bad one is the same 401; with both headers Authorization wins."""
    created = create(auth, scopes=["inference"])
    ok = auth.check(None, path="/v1/messages", extra={"x-api-key": created.secret})
    assert ok.WhichOneof("http_response") == "ok_response"
    assert "x-api-key" in ok.ok_response.headers_to_remove
    for bad in (
        auth.check(None, path="/v1/messages", extra={"x-api-key": "ip-" + "N" * 43}),
        auth.check("ip-" + "N" * 43, path="/v1/messages", extra={"x-api-key": created.secret}),
        auth.check(None, path="/v1/messages/count_tokens?beta=true"),
    ):
        # Anthropic's paths get Anthropic's error shape.
        assert bad.denied_response.status.code == 401
        body = json.loads(bad.denied_response.body)
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert "API key" in body["error"]["message"]
    assert_denied(
        auth.check(None, path="/v1/messagesx", extra={"x-api-key": "ip-" + "N" * 43}),
        401,
        "invalid_api_key",
        "Incorrect API key provided",
    )


def test_empty_allow_list_is_sent_as_an_empty_header(auth: Any) -> None:
    created = create(auth)
    ok = auth.check(created.secret, extra={"x-inferplane-allowed-models": "forged"}).ok_response
    [models] = [h for h in ok.headers if h.header.key == "x-inferplane-allowed-models"]
    assert models.header.value == "" and models.keep_empty_value


@pytest.mark.parametrize(
    "path",
    [
        "/v1/admin/api-keys",
        "/v1/admin/api-keys/abc:revoke?x=1",
        "/v1//admin/api-keys",
        "/v1/chat/../admin/api-keys",
        "/v1/%61dmin/api-keys",
    ],
)
def test_admin_paths_need_the_admin_scope(auth: Any, path: str) -> None:
    user = create(auth, scopes=["inference"]).secret
    assert_denied(auth.check(user, path=path), 403, "insufficient_scope", "'admin' scope")
    assert auth.check(auth.admin_key, path=path).status.code == 0


def test_inference_paths_need_the_inference_scope(auth: Any) -> None:
    admin_only = create(auth, scopes=["admin"]).secret
    resp = auth.check(admin_only, path="/v1/chat/completions")
    assert_denied(resp, 403, "insufficient_scope", "'inference' scope")
    both = create(auth, scopes=["admin", "inference"]).secret
    assert auth.check(both, path="/v1/models").status.code == 0


def test_revoked_and_expired_keys_get_401(auth: Any) -> None:
    revoked = create(auth)
    auth.keys.RevokeApiKey(
        auth_pb2.RevokeApiKeyRequest(name=revoked.api_key.name), metadata=auth.admin_md()
    )
    assert_denied(auth.check(revoked.secret), 401, "invalid_api_key", "has been revoked")
    msg = auth_pb2.ApiKey(tenant="acme")
    msg.expire_time.FromDatetime(auth.clock.now() + timedelta(seconds=10))
    expiring = auth.keys.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(api_key=msg), metadata=auth.admin_md()
    ).secret
    auth.clock.advance(10)
    assert_denied(auth.check(expiring), 401, "invalid_api_key", "has expired")


def test_other_instances_see_a_revocation_within_the_cache_ttl(
    auth: Any, make_settings: Any, start_auth: Any
) -> None:
    """Invariant: a revocation reaches every instance within `cache_ttl_seconds`."""
    created = create(auth)
    settings = make_settings(auth.settings.data_dir, bootstrap_admin_key="")
    with start_auth(settings, auth.clock) as other:
        assert other.check(created.secret).status.code == 0  # cached on the other instance
        auth.keys.RevokeApiKey(
            auth_pb2.RevokeApiKeyRequest(name=created.api_key.name), metadata=auth.admin_md()
        )
        assert auth.check(created.secret).denied_response.status.code == 401  # at once here
        assert other.check(created.secret).status.code == 0  # still cached there
        auth.clock.advance(settings.cache_ttl_seconds)
        assert other.check(created.secret).denied_response.status.code == 401


class _DownStore:
    """A store whose database is unreachable."""

    def find_by_secret_hash(self, secret_hash: str) -> None:
        raise UnavailableError("the API key database is unavailable")


def test_store_outage_is_an_error_never_an_allow(auth: Any) -> None:
    verifier = KeyVerifier(_DownStore(), SecretHasher(b"p" * 32), SystemClock())  # type: ignore[arg-type]
    request = external_auth_pb2.CheckRequest(
        attributes=attribute_context_pb2.AttributeContext(
            request=attribute_context_pb2.AttributeContext.Request(
                http=attribute_context_pb2.AttributeContext.HttpRequest(
                    path="/v1/models", headers={"authorization": "Bearer ip-" + "b" * 43}
                )
            )
        )
    )
    with pytest.raises(UnavailableError):
        asyncio.run(Authorization(verifier).Check(request, None))


def test_check_latency_micro_measurement(auth: Any) -> None:
    """Prints Check latency (not asserted): in-process on a cache hit, and over loopback gRPC."""
    secret = create(auth).secret
    authz = auth.components.app().servicers[1].servicer
    request = external_auth_pb2.CheckRequest(
        attributes=attribute_context_pb2.AttributeContext(
            request=attribute_context_pb2.AttributeContext.Request(
                http=attribute_context_pb2.AttributeContext.HttpRequest(
                    path="/v1/chat/completions", headers={"authorization": f"Bearer {secret}"}
                )
            )
        )
    )

    async def in_process(n: int, miss: bool = False) -> list[float]:
        out = []
        for _ in range(n):
            if miss:
                auth.components.verifier.invalidate()
            start = time.perf_counter()
            resp = await authz.Check(request, None)
            out.append(time.perf_counter() - start)
        assert resp.status.code == 0
        return out

    local = auth.run(in_process(3000))[200:]
    misses = auth.run(in_process(300, miss=True))[50:]
    remote = []
    for _ in range(600):
        start = time.perf_counter()
        auth.authz.Check(request, timeout=5)
        remote.append(time.perf_counter() - start)
    remote = remote[100:]

    def ms(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[int(q) - 1] * 1e3

    print(
        f"\nCheck latency (cache hit): in-process p50 {ms(local, 50):.3f} ms "
        f"p99 {ms(local, 99):.3f} ms; loopback gRPC p50 {ms(remote, 50):.3f} ms "
        f"p99 {ms(remote, 99):.3f} ms; in-process cache miss (SQLite) p50 "
        f"{ms(misses, 50):.3f} ms p99 {ms(misses, 99):.3f} ms"
    )

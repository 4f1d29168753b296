"""Auth under mutual TLS (issue 18): who may call which RPC, and whose `x-inferplane-*` headers
count. Only the edge's identity vouches for a caller's scopes; an operator's identity must
present an admin key; another service's identity is refused, whatever it sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc

from inferplane.api.auth.v1 import auth_pb2, auth_pb2_grpc
from inferplane.runtime.security.identity import ADMIN, EDGE, ROUTER, PeerSecurity
from inferplane.runtime.security.pki import LocalCA

FORGED = (("x-inferplane-scopes", "admin"), ("x-inferplane-key-id", "k-forged"))


def _code(call: Any, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    try:
        call(*args, timeout=5, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_identities_and_forged_headers(tmp_path: Path, make_settings: Any, start_auth: Any) -> None:
    pki = tmp_path / "pki"
    ca = LocalCA.ensure(pki)
    for name in ("auth", EDGE, ROUTER, ADMIN):
        ca.issue(name, dns_names=(name,), ip_addresses=("127.0.0.1",))
    with start_auth(make_settings(tmp_path / "auth", tls_dir=pki)) as auth:
        address = f"127.0.0.1:{auth.server.port}"
        listing = auth_pb2.ListApiKeysRequest()
        bearer = (("authorization", f"Bearer {auth.admin_key}"),)

        with PeerSecurity(pki, EDGE).channel(address) as edge:
            keys = auth_pb2_grpc.ApiKeyServiceStub(edge)
            # The edge's headers are its ext_authz verdict: trusted.
            assert _code(keys.ListApiKeys, listing, metadata=FORGED) == grpc.StatusCode.OK

        with PeerSecurity(pki, ADMIN).channel(address) as operator:
            keys = auth_pb2_grpc.ApiKeyServiceStub(operator)
            # An operator's headers are not a verdict: a key is needed.
            assert _code(keys.ListApiKeys, listing, metadata=FORGED) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert _code(keys.ListApiKeys, listing, metadata=bearer) == grpc.StatusCode.OK
            # Only Envoy asks for Check.
            authz = external_auth_pb2_grpc.AuthorizationStub(operator)
            assert _code(authz.Check, external_auth_pb2.CheckRequest()) == (
                grpc.StatusCode.PERMISSION_DENIED
            )

        with PeerSecurity(pki, ROUTER).channel(address) as router:
            keys = auth_pb2_grpc.ApiKeyServiceStub(router)
            # Another service's identity is refused even with the admin key or forged headers.
            for metadata in (FORGED, bearer):
                assert _code(keys.ListApiKeys, listing, metadata=metadata) == (
                    grpc.StatusCode.PERMISSION_DENIED
                )

        # No certificate: no connection at all.
        anonymous = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
        with grpc.secure_channel(address, anonymous) as nobody:
            keys = auth_pb2_grpc.ApiKeyServiceStub(nobody)
            assert _code(keys.ListApiKeys, listing, metadata=bearer) == (
                grpc.StatusCode.UNAVAILABLE
            )


@pytest.mark.parametrize("plaintext_trust", [True, False])
def test_plaintext_keeps_the_development_setting(
    tmp_path: Path, make_settings: Any, start_auth: Any, plaintext_trust: bool
) -> None:
    """Without identities (development), `trust_edge_headers` alone decides, as before."""
    settings = make_settings(tmp_path, trust_edge_headers=plaintext_trust)
    with start_auth(settings) as auth:
        code = _code(auth.keys.ListApiKeys, auth_pb2.ListApiKeysRequest(), metadata=FORGED)
        expected = grpc.StatusCode.OK if plaintext_trust else grpc.StatusCode.UNAUTHENTICATED
        assert code == expected

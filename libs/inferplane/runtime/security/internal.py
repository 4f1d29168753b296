"""Who may call an internal RPC that the service identities alone do not guard: the shared
internal token (`x-inferplane-internal-token` as call metadata) when one is configured, else a
caller whose certificate the server verified (mutual TLS: the service's `PeerPolicy` already
admitted only the identities it lists for the method), else a caller on this host.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping

from inferplane.runtime.service._errors import PermissionDeniedError, UnauthenticatedError
from inferplane.wire.headers import INTERNAL_TOKEN


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:/p`) is
    this host. Unix sockets count as local; anything unparsable does not."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = rest.rsplit(":", 1)[0]
    elif kind == "ipv6":
        host = rest.rsplit(":", 1)[0].strip("[]")
    else:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class InternalCallerGuard:
    """Admits internal callers: with a `token`, exactly the calls that present it; without
    one, a caller with a verified certificate (`identity` not None) or a loopback peer.

    Raises (from `check`):
        UnauthenticatedError: a token is configured and the call carries none.
        PermissionDeniedError: a wrong token, or (no token configured) a plaintext caller
            from another host.
    """

    def __init__(self, token: str = "") -> None:
        self._token = token.encode()

    def check(self, metadata: Mapping[str, str | bytes], peer: str, identity: str | None) -> None:
        """`metadata`: the call's invocation metadata; `peer`: `context.peer()`; `identity`:
        the verified certificate's identity (`identity.peer_identity`), None in plaintext."""
        if self._token:
            presented = metadata.get(INTERNAL_TOKEN)
            if not presented:
                raise UnauthenticatedError(
                    f"internal RPC: missing {INTERNAL_TOKEN}", code="invalid_internal_token"
                )
            raw = presented if isinstance(presented, bytes) else presented.encode()
            if not hmac.compare_digest(raw, self._token):
                raise PermissionDeniedError(
                    "internal RPC: wrong internal token", code="invalid_internal_token"
                )
            return
        if identity is None and not is_loopback_peer(peer):
            raise PermissionDeniedError(
                "internal RPC: without an internal_token only callers with a certificate of "
                "the platform's CA or on this host are accepted",
                code="internal_only",
            )

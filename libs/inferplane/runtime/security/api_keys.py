"""API keys as every service that authenticates a request reads them: the secret's hash
(`SecretHasher`, HMAC-SHA256 under the pepper auth and routers share), where a request carries
its key (`client_key`: `Authorization: Bearer` or `x-api-key`), which scope a path needs
(`required_scope`), and how a key appears in an error (`redact`).

Auth stores and issues keys (`inferplane.auth`); the endpoint picker authenticates requests
against the key table auth streams it (`inferplane.router.keys`). Both import these rules
from here, so a key that works on one works on the other.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
import re
from collections.abc import Mapping
from urllib.parse import unquote

from inferplane.runtime.service._errors import UnauthenticatedError
from inferplane.wire.headers import API_KEY, AUTHORIZATION

SCOPE_INFERENCE = "inference"
SCOPE_ADMIN = "admin"
# Signs in to the web console (services/console) and manages its own tenant's keys and reads
# its own tenant's usage there; never another tenant's, never a key with the admin scope.
SCOPE_CONSOLE = "console"

#: Paths under this prefix need the admin scope (`required_scope`).
ADMIN_PATH_PREFIX = "/v1/admin/"
#: The 401 message for a request without a key (OpenAI's wording).
MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
#: The error code of every authentication failure (OpenAI's).
INVALID_API_KEY = "invalid_api_key"

# Bearer tokens we accept: RFC 6750 token68 characters, bounded length. Our own secrets are
# `ip-` + base64url; operator-chosen bootstrap keys may use any of these characters.
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")


class SecretHasher:
    """Hashes secrets with HMAC-SHA256 under a server-side pepper.

    Keys are 256-bit random values, so a slow KDF (bcrypt, argon2) buys nothing: brute-forcing
    2^256 is infeasible at any hash speed, and a fast hash keeps authentication under a
    microsecond's worth of hashing. The pepper (kept out of the database) makes a stolen
    database useless for offline guessing of operator-chosen bootstrap keys. Changing the
    pepper invalidates every stored key.
    """

    def __init__(self, pepper: bytes) -> None:
        if len(pepper) < 16:
            raise ValueError("the pepper must be at least 16 bytes")
        self._pepper = pepper

    def hash(self, secret: str) -> str:
        """Hex HMAC-SHA256 of `secret` (64 characters)."""
        return hmac.new(self._pepper, secret.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def matches(stored_hash: str | None, candidate_hash: str) -> bool:
        """Constant-time comparison of two hex hashes."""
        return stored_hash is not None and hmac.compare_digest(stored_hash, candidate_hash)


def is_well_formed_secret(token: str) -> bool:
    """Whether `token` could be a key at all (charset and length), before any lookup."""
    return _TOKEN_RE.fullmatch(token) is not None


def redact(token: str) -> str:
    """A token as OpenAI shows it in errors: `ip-abc***wxyz` (never the whole secret)."""
    if len(token) <= 12:
        return "***"
    return f"{token[:6]}***{token[-4:]}"


def parse_bearer(value: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive).

    Raises:
        UnauthenticatedError: missing value, another scheme, or no token.
    """
    if not value or not value.strip():
        raise UnauthenticatedError(MISSING_KEY_MESSAGE, code=INVALID_API_KEY)
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise UnauthenticatedError(
            "Malformed Authorization header: expected 'Authorization: Bearer YOUR_KEY'.",
            code=INVALID_API_KEY,
        )
    return token


def client_key(headers: Mapping[str, str]) -> str:
    """The request's API key: `Authorization: Bearer KEY` (OpenAI's convention) or, without
    an Authorization header, `x-api-key: KEY` (Anthropic's). With both, Authorization wins.

    Raises:
        UnauthenticatedError: neither header, or a malformed one (`parse_bearer`).
    """
    authorization = headers.get(AUTHORIZATION)
    if authorization is None or not authorization.strip():
        api_key = (headers.get(API_KEY) or "").strip()
        if api_key:
            return api_key
    return parse_bearer(authorization)


def required_scope(path: str) -> str:
    """The scope a request path needs: admin under `/v1/admin/`, inference anywhere else.

    The path is percent-decoded and dot segments and repeated slashes are collapsed first, so
    `/v1//admin/...` or `/v1/x/../admin/...` cannot dodge the admin rule.
    """
    clean = unquote(path.split("?", 1)[0])
    clean = posixpath.normpath("/" + clean.lstrip("/"))
    if clean == ADMIN_PATH_PREFIX.rstrip("/") or clean.startswith(ADMIN_PATH_PREFIX):
        return SCOPE_ADMIN
    return SCOPE_INFERENCE

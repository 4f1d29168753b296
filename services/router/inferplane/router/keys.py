"""The key table: every API key by its secret hash, as auth streams it to this router
(`inferplane.auth.v1.KeyTableService.WatchKeyTable`), and `authenticate`, which the endpoint
picker runs on a request's headers in its first exchange (no call to auth per request).

A request's key is hashed with the pepper auth and routers share (HMAC-SHA256,
`inferplane.runtime.security.api_keys.SecretHasher`) and looked up here. Expiry and the end of
a rotated secret's grace period are checked against the clock on every request, so they are
exact; a revocation, a deletion or a changed allow-list reaches the table with the next update
auth sends (within a second: auth's change feed, services/auth/README.md).

While no table was ever received every request is refused with 503 (fail closed). When the
table is older than `stale_after_seconds` (auth unreachable), the router keeps serving the
keys it has and refuses a key it does not know with 503 `auth_unavailable` (the key may have
been created since) rather than 401.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.runtime import PermissionDeniedError, UnauthenticatedError, UnavailableError
from inferplane.runtime.security.api_keys import (
    INVALID_API_KEY,
    SCOPE_ADMIN,
    SecretHasher,
    client_key,
    is_well_formed_secret,
    redact,
    required_scope,
)
from inferplane.runtime.time.clock import Clock

#: The error code of a refusal because the table is missing or stale (503, retryable).
AUTH_UNAVAILABLE = "auth_unavailable"


@dataclasses.dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits (0 = unlimited): requests and tokens per minute, concurrent requests,
    tokens per calendar month (UTC)."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0
    monthly_token_budget: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """Who a request's key belongs to and what it may do (auth's verdict, from the table).

    Attributes:
        key_id, tenant, scopes, allowed_models (empty = all), tier: the key's.
        limits: enforced by the picker (`inferplane.router.keylimits`).
        budget_exhausted / budget_resets: the monthly token budget is spent until then.
        month_tokens: tokens auth's ledger had counted this month when it sent the entry.
    """

    key_id: str
    tenant: str
    scopes: tuple[str, ...]
    allowed_models: tuple[str, ...]
    tier: str
    limits: KeyLimits = KeyLimits()
    budget_exhausted: bool = False
    budget_resets: datetime | None = None
    month_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    principal: Principal
    valid_until: datetime | None
    previous_secret: bool
    revoked: bool


def _time(ts: object) -> datetime | None:
    if ts is None or not ts.ByteSize():  # type: ignore[attr-defined]
        return None
    return ts.ToDatetime(tzinfo=UTC)  # type: ignore[attr-defined,no-any-return]


def _entry(message: kpb.KeyEntry) -> _Entry:
    limits = message.limits
    principal = Principal(
        key_id=message.key_id,
        tenant=message.tenant,
        scopes=tuple(message.scopes),
        allowed_models=tuple(message.allowed_models),
        tier=message.tier,
        limits=KeyLimits(
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrent_requests,
            limits.monthly_token_budget,
        ),
        budget_exhausted=message.budget_exhausted,
        budget_resets=_time(message.budget_resets) if message.HasField("budget_resets") else None,
        month_tokens=message.month_tokens,
    )
    valid_until = _time(message.valid_until) if message.HasField("valid_until") else None
    return _Entry(principal, valid_until, message.previous_secret, message.revoked)


class KeyTable:
    """Secret hash → principal, fed by auth's updates (`apply`), read by `authenticate`.

    Args:
        hasher: the pepper's hasher (the same pepper as auth's, or no key ever matches).
        clock: wall time for expiry, monotonic time for the table's age.
        stale_after_seconds: how old the table may get before unknown keys get 503.
    """

    def __init__(
        self, hasher: SecretHasher, clock: Clock, *, stale_after_seconds: float = 5.0
    ) -> None:
        self._hasher = hasher
        self._clock = clock
        self._stale_after = stale_after_seconds
        self._entries: dict[str, _Entry] = {}
        self._received_at: float | None = None  # monotonic, last update of any kind
        self._as_of: datetime | None = None

    # -- fed by the watch ----------------------------------------------------------------------

    def apply(self, update: kpb.WatchKeyTableResponse) -> None:
        """Applies one update of auth's watch (a snapshot replaces the table)."""
        if update.snapshot:
            self._entries = {e.secret_hash: _entry(e) for e in update.entries}
        else:
            for removed in update.removed:
                self._entries.pop(removed, None)
            for e in update.entries:
                self._entries[e.secret_hash] = _entry(e)
        self._received_at = self._clock.monotonic()
        if update.HasField("as_of"):
            self._as_of = update.as_of.ToDatetime(tzinfo=UTC)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stale_after_seconds(self) -> float:
        """How old the table may get before unknown keys get 503."""
        return self._stale_after

    @property
    def received(self) -> bool:
        """Whether any update arrived (before: every request is refused with 503)."""
        return self._received_at is not None

    def age_seconds(self) -> float | None:
        """Seconds since the last update from auth (None: never), the table-age metric."""
        if self._received_at is None:
            return None
        return self._clock.monotonic() - self._received_at

    def stale(self) -> bool:
        """True when no update arrived within `stale_after_seconds` (or ever)."""
        age = self.age_seconds()
        return age is None or age > self._stale_after

    # -- read by the picker ------------------------------------------------------------------

    def authenticate(self, metadata: Mapping[str, str], path: str) -> Principal:
        """The principal of the key in `metadata` (lower-case request headers), allowed on
        `path`.

        Raises:
            UnauthenticatedError: no key, a malformed, unknown, revoked or expired key, or a
                rotated secret past its grace period (401 invalid_api_key).
            PermissionDeniedError: the key lacks the scope the path needs (403
                insufficient_scope).
            UnavailableError: no table yet, or an unknown key while the table is stale
                (503 auth_unavailable, retryable).
        """
        secret = client_key(metadata)
        if not is_well_formed_secret(secret):
            raise UnauthenticatedError(
                "Malformed API key: expected 'Authorization: Bearer <key>' with a key issued "
                "by inferplane.",
                code=INVALID_API_KEY,
            )
        if self._received_at is None:
            raise UnavailableError(
                "Authentication is not available yet; retry shortly.", code=AUTH_UNAVAILABLE
            )
        entry = self._entries.get(self._hasher.hash(secret))
        if entry is None:
            if self.stale():
                raise UnavailableError(
                    "Authentication is temporarily unavailable; retry shortly.",
                    code=AUTH_UNAVAILABLE,
                )
            raise UnauthenticatedError(
                f"Incorrect API key provided: {redact(secret)}. Check the key, or ask your "
                "administrator for a new one.",
                code=INVALID_API_KEY,
            )
        if entry.revoked:
            raise UnauthenticatedError(
                f"The API key {redact(secret)} has been revoked.", code=INVALID_API_KEY
            )
        if entry.valid_until is not None and self._clock.now() >= entry.valid_until:
            if entry.previous_secret:
                raise UnauthenticatedError(
                    "This API key was rotated and its old secret no longer works; use the new "
                    "secret.",
                    code=INVALID_API_KEY,
                )
            raise UnauthenticatedError(
                f"The API key {redact(secret)} has expired.", code=INVALID_API_KEY
            )
        principal = entry.principal
        scope = required_scope(path)
        if scope not in principal.scopes:
            where = "/v1/admin/ endpoints" if scope == SCOPE_ADMIN else "this endpoint"
            raise PermissionDeniedError(
                f"This API key lacks the '{scope}' scope required for {where}.",
                code="insufficient_scope",
            )
        return principal

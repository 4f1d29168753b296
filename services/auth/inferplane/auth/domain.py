"""Domain values and rules of API keys: plain frozen dataclasses, no gRPC, no SQL.

A key is a 256-bit random secret (`ip-` + 43 base64url characters) that the service shows once
and stores only as `HMAC-SHA256(pepper, secret)`. Its metadata (tenant, scopes, model
allow-list, expiry, limits, tier) travels with every verified request as edge headers.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import re
import secrets
from collections.abc import Mapping
from datetime import datetime, timedelta

from inferplane import regions
from inferplane.regions import SECRET_PREFIX, region_of_secret
from inferplane.runtime import InvalidArgumentError
from inferplane.runtime.security.api_keys import (
    SCOPE_ADMIN,
    SCOPE_CONSOLE,
    SCOPE_INFERENCE,
    SecretHasher,
    is_well_formed_secret,
    redact,
)

__all__ = [  # re-exported: auth's modules and tests import them from here
    "SCOPE_ADMIN",
    "SCOPE_CONSOLE",
    "SCOPE_INFERENCE",
    "SecretHasher",
    "is_well_formed_secret",
    "redact",
]

KNOWN_SCOPES = (SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_CONSOLE)
KNOWN_TIERS = ("standard", "priority")
DEFAULT_TIER = "standard"
DEFAULT_TENANT = "default"

SECRET_BYTES = 32  # 256 bits: brute force is out of reach, hence a fast hash (see SecretHasher)
KEY_PREFIX_CHARS = 8  # what `key_prefix` shows: "ip-" + 5 characters of the random part
MAX_KEY_PREFIX_CHARS = 16  # ... after a region's prefix, cut to the stored column's width
MAX_GRACE_PERIOD = timedelta(days=30)

# Values that end up in edge headers and comma lists: no commas, spaces or control characters.
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")
MAX_DISPLAY_NAME = 200


class KeyState(enum.Enum):
    """Lifecycle of a key, derived from its revoke and expire times."""

    ACTIVE = "active"
    REVOKED = "revoked"
    EXPIRED = "expired"


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Per-key limits; 0 = unlimited. Enforced at the edge by Check (`inferplane.auth.limits`)."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0
    # Prompt + completion tokens per calendar month (UTC), from the usage ledger
    # (`inferplane.auth.ledger`); enforced in Check like the per-minute limits.
    monthly_token_budget: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKey:
    """A stored key. `secret_hash` is HMAC-SHA256(pepper, secret) in hex (64 characters).

    After a rotation, `previous_secret_hash` keeps authenticating until
    `previous_secret_expire_time`.
    """

    key_id: str
    display_name: str
    tenant: str
    scopes: tuple[str, ...]
    allowed_models: tuple[str, ...]
    expire_time: datetime | None
    limits: Limits
    tier: str
    key_prefix: str
    secret_hash: str
    create_time: datetime
    update_time: datetime
    last_used_time: datetime | None = None
    revoke_time: datetime | None = None
    previous_secret_hash: str | None = None
    previous_secret_expire_time: datetime | None = None
    # The region whose auth created the key ("" without regions) and whether the key is
    # pinned there (data residency: never replicated, never failed over; docs/regions.md).
    home_region: str = ""
    region_pinned: bool = False

    @property
    def name(self) -> str:
        """The resource name, `api-keys/{key_id}`."""
        return f"api-keys/{self.key_id}"

    def state(self, now: datetime) -> KeyState:
        """REVOKED wins over EXPIRED; a key expires at `expire_time` exactly."""
        if self.revoke_time is not None:
            return KeyState.REVOKED
        if self.expire_time is not None and now >= self.expire_time:
            return KeyState.EXPIRED
        return KeyState.ACTIVE


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """Who a verified secret belongs to: what the edge forwards as `x-inferplane-*` headers."""

    key_id: str
    tenant: str
    scopes: tuple[str, ...]
    allowed_models: tuple[str, ...]
    tier: str
    limits: Limits = Limits()  # enforced by Check (inferplane.auth.limits), not forwarded

    @classmethod
    def of(cls, key: ApiKey) -> Principal:
        return cls(key.key_id, key.tenant, key.scopes, key.allowed_models, key.tier, key.limits)


class AuditAction(enum.Enum):
    """Operations recorded in the audit log."""

    CREATE = "create"
    UPDATE = "update"
    REVOKE = "revoke"
    DELETE = "delete"
    ROTATE = "rotate"


@dataclasses.dataclass(frozen=True, slots=True)
class AuditEvent:
    """One audit-log entry. `actor_key_id` is the admin key that asked ("bootstrap" at start-up).

    `detail` holds operation specifics as strings (updated fields, grace period...).
    """

    time: datetime
    action: AuditAction
    key_id: str
    actor_key_id: str
    tenant: str
    detail: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class KeySpec:
    """The caller-settable fields of a key (create, and the new values of an update)."""

    display_name: str = ""
    tenant: str = ""
    scopes: tuple[str, ...] = ()
    allowed_models: tuple[str, ...] = ()
    expire_time: datetime | None = None
    limits: Limits = Limits()
    tier: str = ""
    region_pinned: bool = False  # create only: pin the key to the creating auth's region


UPDATABLE_FIELDS = frozenset(
    {"display_name", "scopes", "allowed_models", "expire_time", "limits", "tier"}
)


def new_secret(prefix: str = SECRET_PREFIX) -> str:
    """A fresh secret: `prefix` + base64url of 32 random bytes (43 characters).

    `prefix` is `ip-` (no region) or a region's `inferplane.regions.secret_prefix`
    (`ip-<region>.`, pinned `ip-<region>~`), which the global tier routes by."""
    raw = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode()
    return prefix + raw


def new_key_id() -> str:
    """A key id: 16 lowercase hex characters (AIP-122 friendly)."""
    return secrets.token_hex(8)


def key_prefix(secret: str) -> str:
    """The first characters of a secret, shown in listings so people can recognise it: `ip-`
    and 5 random characters, or with a region's prefix (`ip-eu1.`) its 5 random characters
    too, at most `MAX_KEY_PREFIX_CHARS` in all (the column's width)."""
    found = region_of_secret(secret)
    if found is None:
        return secret[:KEY_PREFIX_CHARS]
    head = len(regions.secret_prefix(found[0], pinned=found[1]))
    return secret[: min(head + KEY_PREFIX_CHARS - len(SECRET_PREFIX), MAX_KEY_PREFIX_CHARS)]


def validate_spec(spec: KeySpec, fields: frozenset[str], now: datetime) -> KeySpec:
    """Checks the named fields of `spec` and fills defaults; returns the normalised spec.

    Defaults: scopes → ("inference",), tier → "standard", tenant → "default". Scopes and
    models are de-duplicated, order kept.

    Raises:
        InvalidArgumentError: naming the field (`param` = `api_key.<field>`).
    """
    changes: dict[str, object] = {}
    if "display_name" in fields and len(spec.display_name) > MAX_DISPLAY_NAME:
        raise InvalidArgumentError(
            f"display_name is longer than {MAX_DISPLAY_NAME} characters",
            param="api_key.display_name",
        )
    if "tenant" in fields:
        tenant = spec.tenant or DEFAULT_TENANT
        if not _TENANT_RE.fullmatch(tenant):
            raise InvalidArgumentError(
                f"tenant {tenant!r} is not valid: 1-128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                param="api_key.tenant",
            )
        changes["tenant"] = tenant
    if "scopes" in fields:
        scopes = tuple(dict.fromkeys(spec.scopes)) or (SCOPE_INFERENCE,)
        unknown = [s for s in scopes if s not in KNOWN_SCOPES]
        if unknown:
            raise InvalidArgumentError(
                f"unknown scope(s) {', '.join(map(repr, unknown))}; "
                f"known scopes: {', '.join(KNOWN_SCOPES)}",
                param="api_key.scopes",
            )
        changes["scopes"] = scopes
    if "allowed_models" in fields:
        models = tuple(dict.fromkeys(spec.allowed_models))
        bad = [m for m in models if not _MODEL_RE.fullmatch(m)]
        if bad:
            raise InvalidArgumentError(
                f"allowed_models has invalid model name(s) {', '.join(map(repr, bad))}",
                param="api_key.allowed_models",
            )
        changes["allowed_models"] = models
    if "tier" in fields:
        tier = spec.tier or DEFAULT_TIER
        if tier not in KNOWN_TIERS:
            raise InvalidArgumentError(
                f"unknown tier {tier!r}; known tiers: {', '.join(KNOWN_TIERS)}",
                param="api_key.tier",
            )
        changes["tier"] = tier
    if "expire_time" in fields and spec.expire_time is not None and spec.expire_time <= now:
        raise InvalidArgumentError(
            "expire_time is in the past; revoke the key to stop it now",
            param="api_key.expire_time",
        )
    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]

"""Proto ⇄ domain conversion of API keys (`inferplane.auth.v1.ApiKey` ⇄ `ApiKey`/`KeySpec`).

- `key_to_proto`: a stored key as the API shows it (never its secret or hashes; timestamps UTC);
- `spec_from_proto`: the caller-settable fields of a create or update;
- `fields_from_mask`: the fields an update sets (AIP-134 update_mask, `limits.<field>` paths);
- `key_id_from_name`: `api-keys/{key_id}` → `key_id`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from inferplane.api.auth.v1 import auth_pb2
from inferplane.auth.domain import UPDATABLE_FIELDS, ApiKey, KeySpec, KeyState, Limits
from inferplane.runtime import InvalidArgumentError

_NAME_RE = re.compile(r"api-keys/([a-z0-9][a-z0-9-]{0,62})")
_STATE = {
    KeyState.ACTIVE: auth_pb2.ApiKey.STATE_ACTIVE,
    KeyState.REVOKED: auth_pb2.ApiKey.STATE_REVOKED,
    KeyState.EXPIRED: auth_pb2.ApiKey.STATE_EXPIRED,
}
_OUTPUT_ONLY = frozenset(
    {
        "name",
        "key_prefix",
        "state",
        "create_time",
        "update_time",
        "last_used_time",
        "revoke_time",
        "home_region",
    }
)
_LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "monthly_token_budget",
)


def _ts(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value.astimezone(UTC))
    return ts


def _dt(ts: timestamp_pb2.Timestamp) -> datetime:
    return ts.ToDatetime(tzinfo=UTC)


def key_to_proto(key: ApiKey, now: datetime) -> auth_pb2.ApiKey:
    """The proto of a key (never its secret or hashes)."""
    msg = auth_pb2.ApiKey(
        name=key.name,
        display_name=key.display_name,
        tenant=key.tenant,
        scopes=list(key.scopes),
        allowed_models=list(key.allowed_models),
        limits=auth_pb2.Limits(
            requests_per_minute=key.limits.requests_per_minute,
            tokens_per_minute=key.limits.tokens_per_minute,
            max_concurrent_requests=key.limits.max_concurrent_requests,
            monthly_token_budget=key.limits.monthly_token_budget,
        ),
        key_prefix=key.key_prefix,
        state=_STATE[key.state(now)],
        tier=key.tier,
        region_pinned=key.region_pinned,
        home_region=key.home_region,
    )
    for field, value in (
        ("expire_time", key.expire_time),
        ("create_time", key.create_time),
        ("update_time", key.update_time),
        ("last_used_time", key.last_used_time),
        ("revoke_time", key.revoke_time),
    ):
        ts = _ts(value)
        if ts is not None:
            getattr(msg, field).CopyFrom(ts)
    return msg


def spec_from_proto(msg: auth_pb2.ApiKey) -> KeySpec:
    """The settable fields of a proto key (output-only fields are ignored)."""
    return KeySpec(
        display_name=msg.display_name,
        tenant=msg.tenant,
        scopes=tuple(msg.scopes),
        allowed_models=tuple(msg.allowed_models),
        expire_time=_dt(msg.expire_time) if msg.HasField("expire_time") else None,
        limits=Limits(
            msg.limits.requests_per_minute,
            msg.limits.tokens_per_minute,
            msg.limits.max_concurrent_requests,
            msg.limits.monthly_token_budget,
        ),
        tier=msg.tier,
        region_pinned=msg.region_pinned,
    )


def fields_from_mask(paths: Iterable[str], msg: auth_pb2.ApiKey) -> frozenset[str]:
    """The fields an update sets, from its update_mask (AIP-134).

    `*` means every updatable field; an empty mask means the updatable fields set to a
    non-default value in `msg`. `limits.<field>` updates one limit and keeps the others.

    Raises:
        InvalidArgumentError: naming every bad path (unknown, output-only, immutable).
    """
    paths = [p.strip() for p in paths if p.strip()]
    if not paths:
        implied = {f for f in UPDATABLE_FIELDS if f != "limits" and _is_set(msg, f)}
        if msg.HasField("limits") and msg.limits.ByteSize():
            implied.add("limits")
        if not implied:
            raise InvalidArgumentError(
                "nothing to update: set update_mask or some updatable field",
                param="update_mask",
            )
        return frozenset(implied)
    if "*" in paths:
        if len(paths) > 1:
            raise InvalidArgumentError(
                "update_mask '*' cannot be combined with other paths", param="update_mask"
            )
        return UPDATABLE_FIELDS
    limit_paths = {f"limits.{f}" for f in _LIMIT_FIELDS}
    problems: list[str] = []
    for p in paths:
        if p in UPDATABLE_FIELDS or p in limit_paths:
            continue
        if p in _OUTPUT_ONLY:
            problems.append(f"{p!r} is output only")
        elif p == "tenant":
            problems.append("'tenant' cannot be changed (create a key for the other tenant)")
        elif p == "region_pinned":
            problems.append("'region_pinned' is set at create only (create a pinned key)")
        else:
            problems.append(f"{p!r} is not a field of ApiKey")
    if problems:
        raise InvalidArgumentError(
            f"invalid update_mask: {'; '.join(problems)}. Updatable: "
            f"{', '.join(sorted(UPDATABLE_FIELDS | limit_paths))}",
            param="update_mask",
        )
    return frozenset(paths)


def _is_set(msg: auth_pb2.ApiKey, field: str) -> bool:
    if field == "expire_time":
        return msg.HasField("expire_time")
    value = getattr(msg, field)
    return bool(len(value)) if not isinstance(value, str) else bool(value)


def key_id_from_name(name: str, param: str = "name") -> str:
    """The key id of a resource name `api-keys/{key_id}` (`param` names the field in the error).

    Raises:
        InvalidArgumentError: `name` is not `api-keys/` + a lower-case id of 1-63 characters.
    """
    match = _NAME_RE.fullmatch(name)
    if match is None:
        raise InvalidArgumentError(
            f"{param} must look like 'api-keys/{{key_id}}', got {name!r}", param=param
        )
    return match.group(1)

"""The API key use cases: create, get, list, update, revoke, delete, rotate, bootstrap.

Async façade over the blocking store (each call runs in a worker thread) that keeps the
verifier's cache coherent: every change to a key invalidates its cached entries on this
instance as soon as the transaction commits, and tells the listeners (`on_change`: the key
table routers follow, `inferplane.auth.key_table`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog

from inferplane import regions
from inferplane.auth.domain import (
    MAX_GRACE_PERIOD,
    SCOPE_ADMIN,
    UPDATABLE_FIELDS,
    ApiKey,
    AuditAction,
    AuditEvent,
    KeySpec,
    Limits,
    SecretHasher,
    is_well_formed_secret,
    key_prefix,
    new_key_id,
    new_secret,
    validate_spec,
)
from inferplane.auth.store import ApiKeyStore, ListQuery
from inferplane.auth.verifier import KeyVerifier
from inferplane.runtime import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from inferplane.runtime.pagination.page_tokens import decode_page_token, encode_page_token
from inferplane.runtime.security.private_files import write_private_file
from inferplane.runtime.time.clock import Clock

log = structlog.get_logger("inferplane.auth")

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
BOOTSTRAP_ACTOR = "bootstrap"
BOOTSTRAP_KEY_FILE = "bootstrap-admin-key"
_CREATE_FIELDS = frozenset(
    {"display_name", "tenant", "scopes", "allowed_models", "expire_time", "limits", "tier"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    """A page of keys and the token of the next one ("" on the last page)."""

    keys: Sequence[ApiKey]
    next_page_token: str


class ApiKeyManager:
    """API key use cases. `actor` arguments are the key id of the admin making the call.

    `region` (`inferplane.regions`; "" = no regions): created keys are homed there and their
    secrets, and rotated ones, carry the region's prefix (`ip-<region>.`, or `ip-<region>~`
    for a key pinned to it), which the global tier routes by (docs/regions.md).

    Raises:
        ValueError: `region` is not a valid region name.
    """

    def __init__(
        self,
        store: ApiKeyStore,
        hasher: SecretHasher,
        verifier: KeyVerifier,
        clock: Clock,
        *,
        region: str = "",
    ) -> None:
        self.region = regions.validate_region(region) if region else ""
        self._store = store
        self._hasher = hasher
        self._verifier = verifier
        self._clock = clock
        self._listeners: list[Callable[[str], None]] = []
        self._settlers: list[Callable[[], Awaitable[bool]]] = []

    def on_change(
        self,
        listener: Callable[[str], None],
        settle: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Calls `listener(key_id)` on the event loop after every committed write of a key
        through this manager (create, update, revoke, delete, rotate, bootstrap): the key
        table pushes it to the routers at once (`inferplane.auth.key_table`). `settle`, when
        given, is awaited before the write returns to its caller (the key table: until the
        routers watching this instance were sent the change, bounded), so a key created here
        authenticates on those routers as soon as CreateApiKey has answered."""
        self._listeners.append(listener)
        if settle is not None:
            self._settlers.append(settle)

    async def _changed(self, key_id: str) -> None:
        """A write of `key_id` committed: this instance's cache forgets it, listeners hear,
        and the write returns once the settlers are done (never failing: it committed)."""
        self._verifier.invalidate(key_id)
        for listener in self._listeners:
            try:
                listener(key_id)
            except Exception:  # a listener must not fail the write that already committed
                log.exception("key_change_listener_failed", key_id=key_id)
        for settle in self._settlers:
            try:
                if not await settle():
                    log.warning("key_change_not_settled", key_id=key_id)
            except Exception:
                log.exception("key_change_settle_failed", key_id=key_id)

    async def create(self, spec: KeySpec, actor: str) -> tuple[ApiKey, str]:
        """Creates a key; returns it and its secret (the only time the secret exists in clear).

        Raises:
            InvalidArgumentError: a field is invalid (see `validate_spec`).
        """
        now = self._clock.now()
        spec = validate_spec(spec, _CREATE_FIELDS, now)
        if spec.region_pinned and not self.region:
            raise InvalidArgumentError(
                "region_pinned needs an auth started with a region (--region)",
                param="api_key.region_pinned",
            )
        secret = self._secret(self.region, pinned=spec.region_pinned)
        key = self._new_key(spec, secret, now)
        event = AuditEvent(
            now,
            AuditAction.CREATE,
            key.key_id,
            actor,
            key.tenant,
            {"scopes": ",".join(key.scopes)},
        )
        await asyncio.to_thread(self._store.insert, key, event)
        await self._changed(key.key_id)
        return key, secret

    @staticmethod
    def _secret(region: str, *, pinned: bool) -> str:
        """A new secret, with `region`'s prefix when there is one."""
        secret: str = (
            new_secret(regions.secret_prefix(region, pinned=pinned)) if region else new_secret()
        )
        return secret

    def _new_key(self, spec: KeySpec, secret: str, now: datetime) -> ApiKey:
        return ApiKey(
            key_id=new_key_id(),
            display_name=spec.display_name,
            tenant=spec.tenant,
            scopes=spec.scopes,
            allowed_models=spec.allowed_models,
            expire_time=spec.expire_time,
            limits=spec.limits,
            tier=spec.tier,
            key_prefix=key_prefix(secret),
            secret_hash=self._hasher.hash(secret),
            create_time=now,
            update_time=now,
            home_region=self.region,
            region_pinned=spec.region_pinned and bool(self.region),
        )

    async def get(self, key_id: str) -> ApiKey:
        """Raises: NotFoundError."""
        key = await asyncio.to_thread(self._store.get, key_id)
        if key is None:
            raise NotFoundError(f"api-keys/{key_id} not found", reason="API_KEY_NOT_FOUND")
        return key

    async def list_keys(
        self, *, page_size: int, page_token: str, tenant: str, show_inactive: bool
    ) -> Page:
        """A page of keys, newest first; `page_size` 0 means 50, larger than 1000 means 1000.

        The page token binds the filters it was issued for (AIP-158): reusing it with other
        filters is an error.

        Raises:
            InvalidArgumentError: a page token that is malformed or issued for other filters.
        """
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        filters = {"tenant": tenant, "show_inactive": show_inactive}
        after = _resume_after(page_token, filters) if page_token else None
        query = ListQuery(
            limit=size + 1,
            now=self._clock.now(),
            tenant=tenant or None,
            include_inactive=show_inactive,
            after=after,
        )
        keys = list(await asyncio.to_thread(self._store.list_keys, query))
        if len(keys) <= size:
            return Page(keys, "")
        keys = keys[:size]
        last = keys[-1]
        cursor = {"t": last.create_time.isoformat(), "k": last.key_id}
        return Page(keys, encode_page_token(cursor, filters))

    async def update(
        self, key_id: str, spec: KeySpec, fields: frozenset[str], actor: str
    ) -> ApiKey:
        """Sets the `fields` of the key from `spec`.

        `fields` are names of UPDATABLE_FIELDS or `limits.<limit>` (one limit, others kept).

        Raises:
            NotFoundError, InvalidArgumentError.
        """
        now = self._clock.now()
        top = frozenset(f for f in fields if f in UPDATABLE_FIELDS)
        limit_fields = {f.removeprefix("limits.") for f in fields - top}
        unknown = limit_fields - {f.name for f in dataclasses.fields(Limits)}
        if unknown:
            raise InvalidArgumentError(
                f"not updatable: {', '.join(sorted(unknown))}", param="update_mask"
            )
        spec = validate_spec(spec, top, now)
        values: dict[str, object] = {f: getattr(spec, f) for f in top}

        def change(key: ApiKey) -> tuple[ApiKey, AuditEvent | None]:
            if limit_fields and "limits" not in top:
                values["limits"] = dataclasses.replace(
                    key.limits, **{f: getattr(spec.limits, f) for f in limit_fields}
                )
            new = dataclasses.replace(key, update_time=now, **values)  # type: ignore[arg-type]
            detail = {"fields": ",".join(sorted(fields))}
            return new, AuditEvent(now, AuditAction.UPDATE, key_id, actor, key.tenant, detail)

        key = await asyncio.to_thread(self._store.update, key_id, change)
        await self._changed(key_id)
        return key

    async def revoke(self, key_id: str, actor: str) -> ApiKey:
        """Revokes the key (idempotent: revoking a revoked key changes nothing).

        Raises:
            NotFoundError.
        """
        now = self._clock.now()

        def change(key: ApiKey) -> tuple[ApiKey, AuditEvent | None]:
            if key.revoke_time is not None:
                return key, None
            new = dataclasses.replace(key, revoke_time=now, update_time=now)
            return new, AuditEvent(now, AuditAction.REVOKE, key_id, actor, key.tenant)

        key = await asyncio.to_thread(self._store.update, key_id, change)
        await self._changed(key_id)
        return key

    async def delete(self, key_id: str, actor: str) -> None:
        """Deletes the key; the audit log keeps the operation. Raises: NotFoundError."""
        now = self._clock.now()

        def event(key: ApiKey) -> AuditEvent:
            return AuditEvent(now, AuditAction.DELETE, key_id, actor, key.tenant)

        await asyncio.to_thread(self._store.delete, key_id, event)
        await self._changed(key_id)

    async def rotate(self, key_id: str, grace: timedelta, actor: str) -> tuple[ApiKey, str]:
        """Issues a new secret; the current one keeps working for `grace` (0 = stops now).

        Only one previous secret is kept: rotating again during a grace period ends the
        older secret at once.

        Raises:
            NotFoundError; InvalidArgumentError (grace over 30 days);
            FailedPreconditionError (the key is revoked).
        """
        if grace < timedelta(0) or grace > MAX_GRACE_PERIOD:
            raise InvalidArgumentError(
                f"grace_period_seconds must be between 0 and "
                f"{int(MAX_GRACE_PERIOD.total_seconds())}",
                param="grace_period_seconds",
            )
        now = self._clock.now()
        minted: dict[str, str] = {}

        def change(key: ApiKey) -> tuple[ApiKey, AuditEvent | None]:
            if key.revoke_time is not None:
                raise FailedPreconditionError(
                    f"{key.name} is revoked; create a new key instead of rotating it",
                    reason="API_KEY_REVOKED",
                )
            # The key's home region names the new secret (a key from before regions is
            # adopted by this auth's region).
            home = key.home_region or self.region
            secret = minted["secret"] = self._secret(home, pinned=key.region_pinned)
            new = dataclasses.replace(
                key,
                home_region=home,
                secret_hash=self._hasher.hash(secret),
                key_prefix=key_prefix(secret),
                previous_secret_hash=key.secret_hash if grace else None,
                previous_secret_expire_time=now + grace if grace else None,
                update_time=now,
            )
            detail = {"grace_period_seconds": str(int(grace.total_seconds()))}
            return new, AuditEvent(now, AuditAction.ROTATE, key_id, actor, key.tenant, detail)

        key = await asyncio.to_thread(self._store.update, key_id, change)
        await self._changed(key_id)
        return key, minted["secret"]

    async def bootstrap_admin(self, configured_secret: str, data_dir: Path) -> str | None:
        """Makes sure an admin key exists; returns the secret when one was generated.

        - `configured_secret` set (env `INFERPLANE_BOOTSTRAP_ADMIN_KEY`): stored hashed unless a
          key with that secret (current or rotated-out) exists already: idempotent across
          restarts; a revoked or rotated bootstrap key stays so, a deleted one comes back.
        - otherwise, when no active admin key exists: a new one is generated, written to
          `<data_dir>/bootstrap-admin-key` (mode 0600) and returned; it is never logged.

        Raises:
            ConfigError: the configured secret is too short or has characters a bearer token
                cannot carry.
        """
        now = self._clock.now()
        spec = validate_spec(
            KeySpec(display_name="bootstrap admin", tenant="system", scopes=(SCOPE_ADMIN,)),
            _CREATE_FIELDS,
            now,
        )
        if configured_secret:
            if len(configured_secret) < 32 or not is_well_formed_secret(configured_secret):
                raise ConfigError(
                    "INFERPLANE_BOOTSTRAP_ADMIN_KEY must be 32-512 characters of "
                    "A-Z a-z 0-9 . _ ~ + / = - (e.g. the output of `openssl rand -hex 32`)"
                )
            existing = await asyncio.to_thread(
                self._store.find_by_secret_hash, self._hasher.hash(configured_secret)
            )
            if existing is not None:
                return None
            key = self._new_key(spec, configured_secret, now)
            event = AuditEvent(
                now, AuditAction.CREATE, key.key_id, BOOTSTRAP_ACTOR, key.tenant, {"from": "env"}
            )
            await asyncio.to_thread(self._store.insert, key, event)
            await self._changed(key.key_id)
            log.info("bootstrap_admin_key_stored", key_id=key.key_id, source="environment")
            return None
        if await asyncio.to_thread(self._store.has_active_admin, now):
            return None
        secret = self._secret(self.region, pinned=False)
        key = self._new_key(spec, secret, now)
        event = AuditEvent(
            now, AuditAction.CREATE, key.key_id, BOOTSTRAP_ACTOR, key.tenant, {"from": "generated"}
        )
        # The file first: if it cannot be written, no key exists that nobody could ever read.
        path = data_dir / BOOTSTRAP_KEY_FILE
        await asyncio.to_thread(write_private_file, path, secret + "\n")
        await asyncio.to_thread(self._store.insert, key, event)
        await self._changed(key.key_id)
        return secret

    async def audit_events(self, key_id: str | None = None, limit: int = 100) -> list[AuditEvent]:
        """The audit log, oldest first."""
        return list(await asyncio.to_thread(self._store.audit_events, key_id, limit))


def _resume_after(token: str, filters: dict[str, Any]) -> tuple[datetime, str]:
    """(create_time, key_id) of the last key of the page `token` ends.

    Raises:
        InvalidArgumentError: a malformed token, or one issued for other filters.
    """
    cursor = decode_page_token(token, filters)
    try:
        after = (datetime.fromisoformat(cursor["t"]), str(cursor["k"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError("page_token is not valid", param="page_token") from exc
    if after[0].tzinfo is None:
        raise InvalidArgumentError("page_token is not valid", param="page_token")
    return after

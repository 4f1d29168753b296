"""Secret → Principal, fast: a short-TTL in-memory cache in front of the store.

Used by Envoy's ext_authz `Check` on every request and by `ApiKeyService` for callers that
present a bearer key. All methods run on the event loop thread; store lookups go to a worker
thread so a slow database never blocks other Checks.

With regions, a secret this region's store does not know is looked up in its copy of the other
regions' keys (`peer_entry`, `inferplane.auth.peers`): such a key authenticates here with its
`inference` scope only (its administration stays in its home region).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from inferplane.api.auth.v1 import key_table_pb2 as kpb
from inferplane.auth.domain import (
    SCOPE_INFERENCE,
    ApiKey,
    KeyState,
    Limits,
    Principal,
    SecretHasher,
    is_well_formed_secret,
    redact,
)
from inferplane.auth.store import ApiKeyStore
from inferplane.runtime import UnauthenticatedError
from inferplane.runtime.time.clock import Clock

_INVALID_API_KEY = "invalid_api_key"


def _incorrect(secret: str) -> UnauthenticatedError:
    return UnauthenticatedError(
        f"Incorrect API key provided: {redact(secret)}. Check the key, or ask your "
        "administrator for a new one.",
        code=_INVALID_API_KEY,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    key: ApiKey | None  # None: the hash is unknown (negative entry)
    expires_at: float  # monotonic seconds


class LastUsedRecorder:
    """Collects "key X was used at T" off the hot path, at most once per `interval` per key.

    `note` is O(1) and touches no I/O; the app flushes `take()` to the store periodically.
    """

    def __init__(self, clock: Clock, interval: timedelta = timedelta(minutes=1)) -> None:
        self._clock = clock
        self._interval = interval
        self._last_noted: dict[str, datetime] = {}
        self._pending: dict[str, datetime] = {}

    def note(self, key_id: str) -> None:
        now = self._clock.now()
        last = self._last_noted.get(key_id)
        if last is None or now - last >= self._interval:
            self._last_noted[key_id] = now
            self._pending[key_id] = now

    def take(self) -> dict[str, datetime]:
        """The pending updates (and forgets keys not seen for an interval, bounding memory)."""
        pending, self._pending = self._pending, {}
        horizon = self._clock.now() - self._interval
        self._last_noted = {k: t for k, t in self._last_noted.items() if t > horizon}
        return pending


class KeyVerifier:
    """Verifies bearer secrets against the store with a short-TTL cache.

    Cache: secret hash → key (or "unknown"), for `ttl_seconds` (monotonic), at most
    `max_entries` (oldest evicted first). Expiry and the rotation grace period are re-checked
    against the clock on every hit, so they are exact; revoke, rotate, delete and update
    invalidate this instance's entries at once (`invalidate`). Other instances of the service
    keep serving their cached entry until it ages out: a revocation reaches them within the TTL.
    """

    def __init__(
        self,
        store: ApiKeyStore,
        hasher: SecretHasher,
        clock: Clock,
        *,
        ttl_seconds: float = 2.0,
        max_entries: int = 10_000,
        last_used: LastUsedRecorder | None = None,
    ) -> None:
        self._store = store
        self._hasher = hasher
        self._clock = clock
        self._ttl = ttl_seconds
        self._max = max_entries
        self._cache: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        # Bumped by every invalidation: a lookup that started before one must not cache its
        # (possibly stale) result.
        self._generation = 0
        self._last_used = last_used
        # Secret hash -> another region's entry (None: no regions); set by the composition root.
        self.peer_entry: Callable[[str], kpb.KeyEntry | None] | None = None

    async def verify(self, secret: str) -> Principal:
        """The principal of `secret` if it authenticates now.

        Raises:
            UnauthenticatedError: malformed, unknown, revoked or expired (code invalid_api_key).
            UnavailableError: the store cannot be reached (the edge answers 503, never allows).
        """
        if not is_well_formed_secret(secret):
            raise UnauthenticatedError(
                "Malformed API key: expected 'Authorization: Bearer <key>' with a key issued "
                "by inferplane.",
                code=_INVALID_API_KEY,
            )
        secret_hash = self._hasher.hash(secret)
        key = self._cached(secret_hash)
        if key is _MISS:
            generation = self._generation
            found = await asyncio.to_thread(self._store.find_by_secret_hash, secret_hash)
            if generation == self._generation:
                self._remember(secret_hash, found)
            key = found
        if key is None:
            entry = self.peer_entry(secret_hash) if self.peer_entry is not None else None
            if entry is None:
                raise _incorrect(secret)
            return self._admit_peer(entry, secret)
        assert isinstance(key, ApiKey)
        return self._admit(key, secret_hash, secret)

    def _admit_peer(self, entry: kpb.KeyEntry, secret: str) -> Principal:
        """Another region's key, by its replicated entry: revoked, expired or a rotated secret
        past its grace are refused as at home; admitted with its inference scope only."""
        if entry.revoked:
            raise UnauthenticatedError(
                f"The API key {redact(secret)} has been revoked.", code=_INVALID_API_KEY
            )
        if entry.HasField("valid_until") and self._clock.now() >= entry.valid_until.ToDatetime(
            tzinfo=UTC
        ):
            raise UnauthenticatedError(
                "This API key was rotated and its old secret no longer works; use the new secret."
                if entry.previous_secret
                else f"The API key {redact(secret)} has expired.",
                code=_INVALID_API_KEY,
            )
        limits = entry.limits
        return Principal(
            entry.key_id,
            entry.tenant,
            tuple(s for s in entry.scopes if s == SCOPE_INFERENCE),
            tuple(entry.allowed_models),
            entry.tier,
            Limits(
                limits.requests_per_minute,
                limits.tokens_per_minute,
                limits.max_concurrent_requests,
                limits.monthly_token_budget,
            ),
        )

    def _admit(self, key: ApiKey, secret_hash: str, secret: str) -> Principal:
        now = self._clock.now()
        if SecretHasher.matches(key.secret_hash, secret_hash):
            pass
        elif SecretHasher.matches(key.previous_secret_hash, secret_hash):
            grace_end = key.previous_secret_expire_time
            if grace_end is None or now >= grace_end:
                raise UnauthenticatedError(
                    "This API key was rotated and its old secret no longer works; use the new "
                    "secret.",
                    code=_INVALID_API_KEY,
                )
        else:  # pragma: no cover - the store matched on one of the two hashes
            raise _incorrect(secret)
        state = key.state(now)
        if state is KeyState.REVOKED:
            raise UnauthenticatedError(
                f"The API key {redact(secret)} has been revoked.", code=_INVALID_API_KEY
            )
        if state is KeyState.EXPIRED:
            raise UnauthenticatedError(
                f"The API key {redact(secret)} has expired.", code=_INVALID_API_KEY
            )
        if self._last_used is not None:
            self._last_used.note(key.key_id)
        return Principal.of(key)

    def _cached(self, secret_hash: str) -> ApiKey | object | None:
        entry = self._cache.get(secret_hash)
        if entry is None:
            return _MISS
        if entry.expires_at <= self._clock.monotonic():
            del self._cache[secret_hash]
            return _MISS
        return entry.key

    def _remember(self, secret_hash: str, key: ApiKey | None) -> None:
        self._cache[secret_hash] = _Entry(key, self._clock.monotonic() + self._ttl)
        self._cache.move_to_end(secret_hash)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)

    def invalidate(self, key_id: str | None = None) -> None:
        """Forgets the cached entries of `key_id` (all entries when None)."""
        self._generation += 1
        if key_id is None:
            self._cache.clear()
            return
        stale = [h for h, e in self._cache.items() if e.key is not None and e.key.key_id == key_id]
        for h in stale:
            del self._cache[h]


_MISS = object()

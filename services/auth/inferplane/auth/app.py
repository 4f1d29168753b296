"""Composition root of the auth service: store, hasher, verifier, manager, servicers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import timedelta

import structlog
from envoy.service.auth.v3 import external_auth_pb2_grpc
from prometheus_client import CollectorRegistry

from inferplane.api.auth.v1 import auth_pb2_grpc, key_table_pb2_grpc, usage_pb2_grpc
from inferplane.api.inference.v1 import responses_pb2_grpc
from inferplane.auth.counters import CounterStore, MemoryCounterStore, SqlCounterStore
from inferplane.auth.domain import SecretHasher
from inferplane.auth.ext_authz import Authorization
from inferplane.auth.key_service import ApiKeyService
from inferplane.auth.key_table import KeyTableFeed, KeyTableMetrics, KeyTableSettings
from inferplane.auth.key_table_service import KeyTableService
from inferplane.auth.keys import BOOTSTRAP_KEY_FILE, ApiKeyManager
from inferplane.auth.ledger import SqlUsageLedger
from inferplane.auth.limits import RateLimiter
from inferplane.auth.peer_store import SqlPeerKeyStore
from inferplane.auth.peers import PeerKeyTable, PeerMetrics, PeerSettings, parse_peers
from inferplane.auth.responses_service import ResponsesService, ResponseStoreService
from inferplane.auth.responses_store import SqlResponseStore
from inferplane.auth.settings import AuthSettings, resolve_pepper
from inferplane.auth.shares import ShareMetrics
from inferplane.auth.sql_store import SqlApiKeyStore
from inferplane.auth.store import ApiKeyStore
from inferplane.auth.usage import UsageLedgerService, UsageMetrics, UsageService
from inferplane.auth.verifier import KeyVerifier, LastUsedRecorder
from inferplane.runtime import App, ConfigError, ServicerBinding
from inferplane.runtime.security.identity import (
    ADMIN,
    AUTH,
    EDGE,
    NODE_AGENT,
    ROUTER,
    PeerPolicy,
)
from inferplane.runtime.security.internal import InternalCallerGuard
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.auth")


@dataclasses.dataclass(slots=True)
class AuthComponents:
    """Everything `build_app` wires, exposed so tests can reach the store and flush hooks."""

    settings: AuthSettings
    clock: Clock
    store: ApiKeyStore
    verifier: KeyVerifier
    last_used: LastUsedRecorder
    manager: ApiKeyManager
    ledger: SqlUsageLedger
    counters: CounterStore | None = None
    limiter: RateLimiter | None = None
    registry: CollectorRegistry = dataclasses.field(default_factory=CollectorRegistry)
    # Stored responses of the Responses API (None: not served, e.g. in unit tests).
    responses: SqlResponseStore | None = None
    # The key table routers watch (None: not served); built by `build_components`.
    key_table: KeyTableFeed | None = None
    # The other regions' keys and month totals (None: no peers configured).
    peers: PeerKeyTable | None = None
    peer_store: SqlPeerKeyStore | None = None
    _usage: UsageService | None = None
    _flusher: asyncio.Task[None] | None = None
    _purger: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Creates the schema, ensures an admin key exists, starts the last-used flusher."""
        await asyncio.to_thread(self.store.create_schema)
        if self.counters is not None:
            await asyncio.to_thread(self.counters.create_schema)
        generated = await self.manager.bootstrap_admin(
            self.settings.bootstrap_admin_key, self.settings.resolved_data_dir
        )
        if generated is not None:
            # The path, never the secret: logs are collected, shipped and read by more people
            # than the operator (issue 18). The file is the operator's copy, mode 0600.
            log.warning(
                "bootstrap_admin_key_generated",
                file=str(self.settings.resolved_data_dir / BOOTSTRAP_KEY_FILE),
                note="readable by this user only; create named admin keys, then revoke it",
            )
        self._flusher = asyncio.create_task(self._flush_forever())
        if self.peers is not None:
            await self.peers.start()
        if self.responses is not None:
            await asyncio.to_thread(self.responses.create_schema)
            self._purger = asyncio.create_task(self._purge_forever())

    async def flush_last_used(self) -> None:
        """Writes pending last_used_time updates."""
        pending = self.last_used.take()
        if pending:
            await asyncio.to_thread(self.store.record_last_used, pending)

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.last_used_flush_seconds)
            try:
                await self.flush_last_used()
                if self.limiter is not None:
                    await self.limiter.purge()
            except Exception:  # a database hiccup must not kill the flusher
                log.exception("last_used_flush_failed")

    async def purge_responses(self) -> int:
        """Deletes the stored responses expired by now; returns how many."""
        if self.responses is None:
            return 0
        return await asyncio.to_thread(self.responses.purge, self.clock.now())

    async def _purge_forever(self) -> None:
        while True:
            try:
                purged = await self.purge_responses()
                if purged:
                    log.info("stored_responses_purged", count=purged)
            except Exception:  # a database hiccup must not kill the purge loop
                log.exception("stored_responses_purge_failed")
            await asyncio.sleep(self.settings.response_purge_seconds)

    async def drain(self) -> None:
        """Ends the routers' key table watches (they reconnect to another instance), so the
        server's grace period is not held by streams that never end on their own."""
        if self.key_table is not None:
            self.key_table.close_watchers()

    async def stop(self) -> None:
        """Stops the flusher, writes what is pending, closes the database."""
        if self.key_table is not None:
            await self.key_table.stop()
        if self.peers is not None:
            await self.peers.stop()
        for task in (self._flusher, self._purger):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        try:
            await self.flush_last_used()
        finally:
            await asyncio.to_thread(self.store.close)
            if self.counters is not None:
                await asyncio.to_thread(self.counters.close)
            await asyncio.to_thread(self.ledger.close)
            if self.responses is not None:
                await asyncio.to_thread(self.responses.close)
            if self.peer_store is not None:
                await asyncio.to_thread(self.peer_store.close)

    def usage_service(self) -> UsageService | None:
        """The UsageService servicer (one per components; None without a rate limiter)."""
        if self._usage is None and self.limiter is not None:
            self._usage = UsageService(
                self.limiter,
                InternalCallerGuard(self.settings.internal_token),
                UsageMetrics(self.registry),
                self.ledger,
                tenant_of=self._tenant_of,
                clock=self.clock,
                on_usage=self.key_table.usage_written if self.key_table is not None else None,
            )
        return self._usage

    def _tenant_of(self, key_id: str) -> str:
        key = self.store.get(key_id)
        if key is not None:
            return key.tenant
        # A key of another region this region served (its copy of the peers' keys).
        tenant: str = self.peers.tenant_of(key_id) if self.peers is not None else ""
        return tenant

    def app(self) -> App:
        """The runtime `App` serving ApiKeyService, Authorization and UsageService."""
        usage = self.usage_service()
        api_keys = ApiKeyService(
            self.manager,
            self.verifier,
            self.clock,
            trust_edge_headers=self.settings.trust_edge_headers,
        )
        return App(
            component="auth",
            registry=self.registry,
            peer_policy=PeerPolicy(
                {
                    # Envoy: Check, on the routes the endpoint picker does not serve.
                    "/envoy.service.auth.v3.Authorization/": [EDGE],
                    # Key admin: the edge's /v1/admin routes, or an operator's CLI.
                    "/inferplane.auth.v1.ApiKeyService/": [EDGE, ADMIN],
                    # Token usage from the routers, and the key table they authenticate with.
                    "/inferplane.auth.v1.UsageService/": [ROUTER],
                    # ... and the other regions' auths (their copy of this region's keys,
                    # its month totals: inferplane.auth.peers).
                    "/inferplane.auth.v1.KeyTableService/": [ROUTER, AUTH],
                    # The usage ledger: the edge's /v1/admin/usage, or an operator's CLI.
                    "/inferplane.auth.v1.UsageLedgerService/": [EDGE, ADMIN],
                    # Stored responses: the edge's /v1/responses/{id} routes; the replica
                    # processes (the node-agent's identity) save and load them.
                    "/inferplane.inference.v1.ResponsesService/": [EDGE],
                    "/inferplane.inference.v1.ResponseStoreService/": [NODE_AGENT],
                }
            ),
            servicers=[
                ServicerBinding(
                    "inferplane.auth.v1.ApiKeyService",
                    api_keys,
                    auth_pb2_grpc.add_ApiKeyServiceServicer_to_server,
                ),
                ServicerBinding(
                    "envoy.service.auth.v3.Authorization",
                    Authorization(self.verifier, self.limiter),
                    external_auth_pb2_grpc.add_AuthorizationServicer_to_server,
                ),
                ServicerBinding(
                    "inferplane.auth.v1.UsageLedgerService",
                    UsageLedgerService(self.ledger, api_keys.caller),
                    usage_pb2_grpc.add_UsageLedgerServiceServicer_to_server,
                ),
                *self._response_bindings(),
                *self._key_table_bindings(),
                *(
                    [
                        ServicerBinding(
                            "inferplane.auth.v1.UsageService",
                            usage,
                            usage_pb2_grpc.add_UsageServiceServicer_to_server,
                        )
                    ]
                    if usage is not None
                    else []
                ),
            ],
            start=self.start,
            drain=self.drain,
            stop=self.stop,
        )

    def _key_table_bindings(self) -> list[ServicerBinding]:
        if self.key_table is None:
            return []
        return [
            ServicerBinding(
                "inferplane.auth.v1.KeyTableService",
                KeyTableService(
                    self.key_table,
                    InternalCallerGuard(self.settings.internal_token),
                    self.key_table.metrics,
                    ledger=self.ledger,
                    clock=self.clock,
                    region=self.settings.region,
                ),
                key_table_pb2_grpc.add_KeyTableServiceServicer_to_server,
            )
        ]

    def _response_bindings(self) -> list[ServicerBinding]:
        if self.responses is None:
            return []
        retention = timedelta(days=self.settings.response_retention_days)
        return [
            ServicerBinding(
                "inferplane.inference.v1.ResponsesService",
                ResponsesService(
                    self.responses,
                    self.verifier,
                    self.clock,
                    trust_edge_headers=self.settings.trust_edge_headers,
                ),
                responses_pb2_grpc.add_ResponsesServiceServicer_to_server,
            ),
            ServicerBinding(
                "inferplane.inference.v1.ResponseStoreService",
                ResponseStoreService(self.responses, self.clock, retention),
                responses_pb2_grpc.add_ResponseStoreServiceServicer_to_server,
            ),
        ]


def build_components(
    settings: AuthSettings, *, clock: Clock | None = None, store: ApiKeyStore | None = None
) -> AuthComponents:
    """Builds the parts (no I/O beyond reading or creating the pepper file).

    Raises:
        ConfigError: a bad pepper, a `rate_window_seconds` below 1, a bad `region` or
            `peers` (or peers without a region).
    """
    if settings.rate_window_seconds < 1:
        raise ConfigError("setting 'rate_window_seconds' must be at least 1")
    clock = clock or SystemClock()
    store = store or SqlApiKeyStore(_database_url(settings))
    hasher = SecretHasher(resolve_pepper(settings))
    last_used = LastUsedRecorder(clock, timedelta(seconds=settings.last_used_interval_seconds))
    verifier = KeyVerifier(
        store,
        hasher,
        clock,
        ttl_seconds=settings.cache_ttl_seconds,
        max_entries=settings.cache_max_entries,
        last_used=last_used,
    )
    try:
        manager = ApiKeyManager(store, hasher, verifier, clock, region=settings.region)
        peer_addresses = parse_peers(f"{k}={v}" for k, v in settings.peers.items())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    counters = counter_store(settings)
    # The ledger lives in the auth database (its migrations are the store's).
    ledger = SqlUsageLedger(_database_url(settings))
    limiter = RateLimiter(
        counters,
        clock,
        window_seconds=settings.rate_window_seconds,
        lease_seconds=settings.concurrency_lease_seconds,
        monthly_tokens=ledger.month_tokens,
    )
    registry = CollectorRegistry()
    peers = peer_store = None
    if peer_addresses:
        if not settings.region:
            raise ConfigError("setting 'peers' needs 'region' (this auth's own region)")
        peer_store = SqlPeerKeyStore(_database_url(settings))
        try:
            peers = PeerKeyTable(
                settings.region,
                peer_addresses,
                peer_store,
                ledger,
                clock,
                PeerMetrics(registry),
                share_metrics=ShareMetrics(registry),
                security=settings.security("auth"),
                token=settings.internal_token,
                settings=PeerSettings(
                    budget_sync_seconds=settings.budget_sync_seconds,
                    local_budget_seconds=settings.key_table_budget_seconds,
                ),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if peers is not None:
        # ext_authz (admin API, /v1/models, stored responses) knows the peers' keys too.
        verifier.peer_entry = peers.entry_of
    # The key table routers watch: this instance's key writes are pushed at once.
    key_table = KeyTableFeed(
        store,
        ledger,
        clock,
        KeyTableMetrics(registry),
        KeyTableSettings(
            poll_seconds=settings.key_table_poll_seconds,
            resync_seconds=settings.key_table_resync_seconds,
            budget_seconds=settings.key_table_budget_seconds,
        ),
        peers=peers,
    )
    manager.on_change(key_table.key_changed, key_table.settled)
    return AuthComponents(
        settings,
        clock,
        store,
        verifier,
        last_used,
        manager,
        ledger,
        counters,
        limiter,
        registry,
        # Stored responses live in the auth database too (the same migrations).
        responses=SqlResponseStore(_database_url(settings)),
        key_table=key_table,
        peers=peers,
        peer_store=peer_store,
    )


def counter_store(settings: AuthSettings) -> CounterStore:
    """The rate-counter store named by `limits_store`.

    Raises:
        ConfigError: an unknown `limits_store`.
    """
    if settings.limits_store == "memory":
        return MemoryCounterStore()
    if settings.limits_store == "sql":
        return SqlCounterStore(_database_url(settings))
    raise ConfigError(f"unknown limits_store {settings.limits_store!r}; known: memory, sql")


def _database_url(settings: AuthSettings) -> str:
    if not settings.database_url:
        # 0700: the database holds hashes and tenant metadata; only the service reads it.
        settings.resolved_data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return settings.resolved_database_url


def build_app(settings: AuthSettings, *, clock: Clock | None = None) -> App:
    """Wires the auth service from its settings."""
    return build_components(settings, clock=clock).app()

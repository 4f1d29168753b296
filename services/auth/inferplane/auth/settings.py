"""Settings of the auth service (see `inferplane.runtime.load_settings` for precedence)."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from inferplane.auth.peers import parse_peers
from inferplane.regions import BUDGET_SYNC_SECONDS, validate_region
from inferplane.runtime import ConfigError, ServiceSettings, load_settings

BOOTSTRAP_ENV = "INFERPLANE_BOOTSTRAP_ADMIN_KEY"
PEPPER_FILE = "auth-pepper"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AuthSettings(ServiceSettings):
    """Settings of the auth service; defaults suit a local stack on loopback.

    Attributes:
        data_dir: where the SQLite database, the generated pepper and the bootstrap key file
            live (created when missing; `~` is expanded).
        database_url: SQLAlchemy URL; empty means `sqlite:///<data_dir>/auth.db`. PostgreSQL:
            `postgresql+psycopg://user:password@host:5432/dbname`.
        pepper: the server-side HMAC key for secret hashes (at least 16 bytes). Empty means a
            random one generated once into `<data_dir>/auth-pepper` (mode 0600). Every instance
            sharing a database must use the same pepper; changing it invalidates every key.
        cache_ttl_seconds: how long a verified key is served from memory; also the longest time
            another instance keeps accepting a key revoked elsewhere.
        cache_max_entries: bound on cached secrets (oldest evicted first).
        last_used_interval_seconds: last_used_time is written at most this often per key.
        last_used_flush_seconds: how often pending last_used_time updates are written.
        bootstrap_admin_key: an admin secret to install on start-up; also read from
            `INFERPLANE_BOOTSTRAP_ADMIN_KEY` by `load_auth_settings`.
        limits_store: where per-key rate counters live: "sql" (the database above, shared by
            every auth instance) or "memory" (this instance only).
        concurrency_lease_seconds: how long a concurrent-request slot stays taken when the
            usage report of its request never arrives (the router's request timeout).
        rate_window_seconds: the length of a rate-limit window (60: limits are per minute;
            shorter only for tests that must see a window reset).
        trust_edge_headers: accept `x-inferplane-scopes` metadata as the caller's scopes on
            ApiKeyService. Only safe when nothing but the edge (which strips client copies) and
            operators can reach this port; turn off to require a bearer admin key always.
        internal_token: shared secret internal callers (routers) present to UsageService in
            `x-inferplane-internal-token`. Empty: UsageService accepts loopback peers only
            (enough for a one-host stack; set it whenever routers run on other hosts).
        response_retention_days: how long a stored response of the Responses API is kept
            (`store`, `previous_response_id`; OpenAI keeps them 30 days).
        response_purge_seconds: how often expired stored responses are deleted (they read as
            absent from the moment they expire).
        key_table_poll_seconds: how often the key table routers watch reads the audit log
            for writes made by other auth instances (`inferplane.auth.key_table`); writes
            through this instance are pushed at once.
        key_table_resync_seconds: how often the key table is read whole again.
        key_table_budget_seconds: how often the monthly token totals of every key with a
            budget are read again (usage reported to other instances).
        region: this auth's region (`inferplane.regions`; docs/regions.md): keys created
            here are homed in it and their secrets carry its prefix. Empty: one cell, no
            regions (no peers, no pinning).
        peers: the other regions' auth gRPC addresses, region -> host:port (flag `--peer
            REGION=HOST:PORT`, repeatable, or `--peers R1=H:P,R2=H:P`): this auth follows
            their key tables and month totals (`inferplane.auth.peers`) as an internal
            caller (the `auth` identity under mutual TLS, `internal_token` when set).
        budget_sync_seconds: how often each peer's month totals are read
            (`regions.BUDGET_SYNC_SECONDS`).
    """

    port: int = 50051
    data_dir: Path = Path("~/.local/share/inferplane")
    database_url: str = ""
    pepper: str = dataclasses.field(default="", repr=False)
    cache_ttl_seconds: float = 2.0
    cache_max_entries: int = 10_000
    last_used_interval_seconds: float = 60.0
    last_used_flush_seconds: float = 5.0
    bootstrap_admin_key: str = dataclasses.field(default="", repr=False)
    trust_edge_headers: bool = True
    limits_store: str = "sql"
    concurrency_lease_seconds: float = 600.0
    rate_window_seconds: int = 60
    internal_token: str = dataclasses.field(default="", repr=False)
    response_retention_days: float = 30.0
    response_purge_seconds: float = 3600.0
    key_table_poll_seconds: float = 0.25
    key_table_resync_seconds: float = 30.0
    key_table_budget_seconds: float = 1.0
    region: str = ""
    peers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    budget_sync_seconds: float = BUDGET_SYNC_SECONDS

    @property
    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir).expanduser()

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.resolved_data_dir / 'auth.db'}"


def load_auth_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> AuthSettings:
    """`load_settings` for auth, plus `INFERPLANE_BOOTSTRAP_ADMIN_KEY` when the setting is unset.

    `--peer REGION=HOST:PORT` may repeat (`_join_peer_flags`).

    Raises:
        ConfigError: see `load_settings`; also a bad `region`, a malformed or self-naming
            peer, or peers without a region.
    """
    environ = os.environ if environ is None else environ
    try:
        settings = load_settings(
            AuthSettings, service="auth", argv=_join_peer_flags(argv or ()), environ=environ
        )
        if settings.region:
            validate_region(settings.region)
        peers = parse_peers(f"{k}={v}" for k, v in settings.peers.items())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if peers and not settings.region:
        raise ConfigError("setting 'peers' needs 'region' (this auth's own region)")
    if settings.region in peers:
        raise ConfigError(f"peer {settings.region!r} is this auth's own region")
    if not settings.bootstrap_admin_key and environ.get(BOOTSTRAP_ENV):
        settings = dataclasses.replace(settings, bootstrap_admin_key=environ[BOOTSTRAP_ENV])
    return settings


def _join_peer_flags(argv: Sequence[str]) -> list[str]:
    """`--peer A=H:P --peer B=H:P` (repeatable) as the one `--peers A=H:P,B=H:P` the loader
    reads; an explicit `--peers` joins them."""
    rest: list[str] = []
    peers: list[str] = []
    items = iter(argv)
    for arg in items:
        if arg in ("--peer", "--peers"):
            peers.extend(p for p in next(items, "").split(",") if p)
        elif arg.startswith(("--peer=", "--peers=")):
            peers.extend(p for p in arg.split("=", 1)[1].split(",") if p)
        else:
            rest.append(arg)
    parse_peers(peers)  # ValueError naming a malformed item before the generic parse
    return [*rest, "--peers", ",".join(peers)] if peers else rest


def resolve_pepper(settings: AuthSettings) -> bytes:
    """The pepper from settings, or from `<data_dir>/auth-pepper` (generated on first use).

    Raises:
        ConfigError: a configured pepper shorter than 16 bytes.
    """
    if settings.pepper:
        if len(settings.pepper.encode()) < 16:
            raise ConfigError("setting 'pepper' must be at least 16 bytes")
        return settings.pepper.encode()
    path = settings.resolved_data_dir / PEPPER_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another instance won the race; use its pepper
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
    pepper = path.read_text().strip()
    if len(pepper) < 16:
        raise ConfigError(f"{path} holds no usable pepper; delete it only if no key exists yet")
    return pepper.encode()

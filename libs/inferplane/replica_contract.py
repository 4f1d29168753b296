"""The contract between the node-agent's supervisor and the replica process (issue 26).

Two distributions meet here and nowhere else: `inferplane-node-agent` starts, health-checks,
drains and stops replica processes; `inferplane-replica` (`python -m inferplane.replica`) is
one: it serves `InferenceService`, `ReplicaProcessService` and gRPC health on one port. Neither
imports the other. What both must agree on is defined once, below:

- the replica tasks (`Task`, `ReplicaSpec.task`) and engine transports (`Transport`,
  `ReplicaSpec.transport`), which transports serve which task (`EMBED_TRANSPORTS`,
  `SPEECH_TRANSPORTS`), the default transport, and the check both sides run
  (`resolve_transport`, `check_transport_serves`);
- the pooling arguments an `embed` replica's engine gets (`pooling_args`);
- the module names the supervisor spawns (`REPLICA_MODULE`, `LAUNCHER_MODULE`: strings, so the
  node-agent never imports the replica's code) and the `--device auto` probe (`has_nvidia_gpu`).

The values are the strings stored in specs and on the wire (`Task.EMBED == "embed"`); a
`StrEnum` member compares equal to its string, so specs written before this module read the
same. The orchestrator's catalogue validation checks profiles against the same constants.
"""

from __future__ import annotations

import enum
from pathlib import Path

from inferplane.api.nodeagent.v1 import nodeagent_pb2

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
        ValueError: an `embed` spec on a transport outside `EMBED_TRANSPORTS`, or a
            `transcribe` spec outside `SPEECH_TRANSPORTS` (the message names the transport
            and the ones that work).
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


DEVICES: tuple[str, ...] = ("auto", "cpu", "gpu")
"""The replica's and the launcher's `--device` choices: `auto` probes `has_nvidia_gpu`."""


def has_nvidia_gpu() -> bool:
    """True when the NVIDIA kernel driver lists at least one GPU (no CUDA import needed)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())

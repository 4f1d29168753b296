"""What this replica runs (issue 30): `ReplicaArtifacts`, the compatibility matrix's key.

`replica_artifacts` computes them once the engine is ready; the replica process reports them in
`GetReplicaLoad` (the node-agent copies them into `Replica.artifacts`), in each conformance
report (`server/conformance.py`) and as the Prometheus info series `inferplane_replica_info`
(`ArtifactsInfo`).
"""

from __future__ import annotations

from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Gauge

from inferplane.api.nodeagent.v1 import nodeagent_pb2, replica_pb2
from inferplane.artifacts import (
    ArtifactError,
    chat_template_digest,
    engine_kind,
    engine_package_version,
    parser_of,
    weights_digest,
)

log = structlog.get_logger("inferplane.replica.artifacts")


def template_text(tokenizer: Any) -> str:
    """The chat template the renderer applies (`tokenizer.apply_chat_template` without a
    `chat_template` argument): the tokenizer's `chat_template`, or its "default" one when it
    has named templates; "" without one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default", "")
    return template if isinstance(template, str) else ""


def replica_artifacts(
    spec: nodeagent_pb2.ReplicaSpec, *, cpu: bool, chat_template: str
) -> replica_pb2.ReplicaArtifacts:
    """What a replica of `spec` runs in this interpreter (blocking: file reads; call it in a
    thread).

    - `engine`: the engine kind (`inferplane.artifacts.engine_kind`: "vllm-cpu" on CPU);
    - `engine_version`: the vLLM distribution's own version (package metadata of this
      interpreter, the engine's environment), not the spec's request;
    - `model_digest`: `weights_digest(spec.model_source)` ("" for a source that is not a local
      folder of weights, e.g. a hub id);
    - `chat_template_digest`: `chat_template_digest(chat_template)` (the template the renderer
      uses: `template_text(assets.tokenizer)`);
    - `parser`: "<tool_parser>/<reasoning_parser>" of the spec ("/" when it names none).
    """
    installed = engine_package_version()
    try:
        model_digest = weights_digest(spec.model_source)
    except ArtifactError as exc:
        log.warning("weights_digest_unavailable", model_source=spec.model_source, error=str(exc))
        model_digest = ""
    return replica_pb2.ReplicaArtifacts(
        engine=engine_kind(cpu),
        engine_version=installed[1] if installed else "",
        model_digest=model_digest,
        chat_template_digest=chat_template_digest(chat_template),
        parser=parser_of(spec.tool_parser, spec.reasoning_parser),
    )


class ArtifactsInfo:
    """The info series `inferplane_replica_info{engine, engine_version, revision} 1` of this
    replica (`revision`: its spec's profile revision), set once the artifacts are known."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._gauge = Gauge(
            "inferplane_replica_info",
            "What this replica runs (always 1): engine kind, engine version, profile revision.",
            ["engine", "engine_version", "revision"],
            registry=registry,
        )

    def set(self, artifacts: replica_pb2.ReplicaArtifacts, revision: str) -> None:
        self._gauge.clear()
        self._gauge.labels(artifacts.engine, artifacts.engine_version, revision).set(1)

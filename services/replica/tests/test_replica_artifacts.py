"""What a replica reports it runs (issue 30, `server/artifacts.py`): the engine's own version,
the digests of its weights and of the chat template its renderer uses, its parsers, and the
`inferplane_replica_info` series."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.artifacts import chat_template_digest, engine_package_version, weights_digest
from inferplane.replica.server.artifacts import ArtifactsInfo, replica_artifacts, template_text
from inferplane.replica.testing.pipeline import kimi_tiny_assets, kimi_tiny_spec


def test_the_artifacts_of_the_fixture_replica() -> None:
    spec = kimi_tiny_spec()
    tokenizer = kimi_tiny_assets().tokenizer
    template = template_text(tokenizer)
    assert template and template == tokenizer.chat_template
    artifacts = replica_artifacts(spec, cpu=True, chat_template=template)
    installed = engine_package_version()
    assert artifacts.engine == "vllm-cpu"
    assert artifacts.engine_version == (installed[1] if installed else "")
    assert artifacts.model_digest == weights_digest(spec.model_source)
    assert artifacts.chat_template_digest == chat_template_digest(template)
    assert artifacts.parser == f"{spec.tool_parser}/{spec.reasoning_parser}" == "kimi_k2/kimi_k2"
    assert replica_artifacts(spec, cpu=False, chat_template="").engine == "vllm"


def test_a_source_without_local_weights_has_no_model_digest(tmp_path: Path) -> None:
    spec = nodeagent_pb2.ReplicaSpec(model_source="org/some-hub-model")
    artifacts = replica_artifacts(spec, cpu=True, chat_template="{{ x }}")
    assert artifacts.model_digest == "" and artifacts.chat_template_digest.startswith("sha256:")
    assert artifacts.parser == "/"


def test_named_templates_use_the_default_one() -> None:
    tokenizer = SimpleNamespace(chat_template={"default": "{{ a }}", "tool_use": "{{ b }}"})
    assert template_text(tokenizer) == "{{ a }}"
    assert template_text(object()) == ""


def test_the_info_series_names_engine_version_and_revision() -> None:
    registry = CollectorRegistry()
    info = ArtifactsInfo(registry)
    artifacts = replica_artifacts(
        nodeagent_pb2.ReplicaSpec(model_source="x"), cpu=True, chat_template=""
    )
    info.set(artifacts, "rev-7")
    text = generate_latest(registry).decode()
    assert (
        f'inferplane_replica_info{{engine="vllm-cpu",engine_version="{artifacts.engine_version}",'
        'revision="rev-7"} 1.0'
    ) in text

"""`Client.deployments` and `Client.nodes` against a real orchestrator under mutual TLS."""

from __future__ import annotations

from typing import Any

import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.sdk import Client, NotFoundError


def test_catalogue_lifecycle(client: Client, pki: Any, orchestrator: str, fx: Any) -> None:
    fx.register_node(pki, orchestrator, gpus=2)
    preview = client.deployments.create("llama", fx.llama8b(replicas=2), validate_only=True)
    assert preview.name == "deployments/llama"
    with pytest.raises(NotFoundError):
        client.deployments.get("llama")  # the preview created nothing

    created = client.deployments.create(
        "llama", fx.llama8b(replicas=2, aliases=["meta-llama/Llama-3.1-8B-Instruct"])
    )
    assert created.status.phase == "Progressing"
    # An id, an alias (slashes included) or the name.
    assert client.deployments.get("meta-llama/Llama-3.1-8B-Instruct").name == created.name
    assert [d.name for d in client.deployments.list()] == ["deployments/llama"]

    placements = list(client.deployments.replicas("llama", page_size=1))
    assert [p.replica_id for p in placements] == ["llama-0", "llama-1"]
    assert all(p.node == "gpu-a" for p in placements)
    lines = client.deployments.explain("llama")
    assert lines[0].startswith("deployments/llama (revision ")

    scaled = client.deployments.update(
        orchestrator_pb2.Deployment(name="llama", replicas=1), ["replicas"]
    )
    assert scaled.replicas == 1
    assert scaled.status.current_revision == created.status.current_revision  # no new profile

    client.deployments.delete("llama")
    assert list(client.deployments.list()) == []


def test_nodes_list_get_drain_uncordon(
    client: Client, pki: Any, orchestrator: str, fx: Any
) -> None:
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        fx.register_node(pki, orchestrator, name=name, gpus=1)
    listing = client.nodes.list(page_size=2)
    assert [len(p.items) for p in listing.pages()] == [2, 1]
    assert sorted(n.name for n in listing) == ["nodes/gpu-a", "nodes/gpu-b", "nodes/gpu-c"]

    assert client.nodes.get("gpu-b").condition == "Ready"
    drained = client.nodes.drain("nodes/gpu-b")
    assert (drained.condition, drained.unschedulable) == ("Draining", True)
    assert client.nodes.drain("gpu-b").unschedulable  # again: still drained
    back = client.nodes.uncordon("gpu-b")
    assert (back.condition, back.unschedulable) == ("Ready", False)
    with pytest.raises(NotFoundError):
        client.nodes.get("gpu-z")

"""The LoRA rules every side shares (`inferplane.lora`, issue 29) and the engine arguments a
spec with `max_loras` gets (`inferplane.replica_contract.lora_args`): vLLM's ranks, the rank of
an adapter folder, a source resolved under the allow-listed root (symlinks and `..` included),
and LoRA refused on the gRPC transport."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferplane import lora
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica_contract import LORA_TRANSPORTS, Transport, lora_args, resolve_transport


def write_config(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lora.CONFIG_FILE).write_text(json.dumps(config))
    return folder


def test_allowed_ranks_are_vllms() -> None:
    """vLLM 0.32's `MaxLoRARanks` less 1 (no PEFT recipe uses rank 1)."""
    from typing import get_args

    pytest.importorskip("vllm")
    from vllm.config.lora import MaxLoRARanks

    assert set(lora.ALLOWED_RANKS) == set(get_args(MaxLoRARanks)) - {1}
    assert lora.DEFAULT_MAX_LORA_RANK in lora.ALLOWED_RANKS


def test_a_source_under_the_root_resolves(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    assert lora.source_under_root(str(root / "a" / "b"), str(root)) == (root / "a" / "b")
    assert lora.source_under_root(str(root / "a" / ".." / "a"), str(root)) == root / "a"
    (root / "link").symlink_to(root / "a")  # a link that stays inside is fine
    assert lora.source_under_root(str(root / "link"), str(root)) == root / "a"


@pytest.mark.parametrize("where", ["dotdot", "symlink", "sibling", "absolute", "empty"])
def test_a_source_outside_the_root_is_refused(tmp_path: Path, where: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "rootx").mkdir()  # shares the root's prefix as text, not as a folder
    (root / "out").symlink_to(tmp_path)
    source = {
        "dotdot": str(root / ".." / "elsewhere"),
        "symlink": str(root / "out" / "rootx"),
        "sibling": str(tmp_path / "rootx"),
        "absolute": "/etc",
        "empty": "",
    }[where]
    with pytest.raises(lora.AdapterError) as info:
        lora.source_under_root(source, str(root))
    assert info.value.code == lora.ADAPTER_SOURCE_NOT_ALLOWED


def test_no_root_allows_nothing(tmp_path: Path) -> None:
    with pytest.raises(lora.AdapterError, match="no allow-listed adapter root"):
        lora.source_under_root(str(tmp_path), "")


def test_adapter_rank_reads_r_and_rank_pattern(tmp_path: Path) -> None:
    assert lora.adapter_rank(write_config(tmp_path / "a", {"peft_type": "LORA", "r": 8})) == 8
    folder = write_config(tmp_path / "b", {"r": 8, "rank_pattern": {"q_proj": 32}})
    assert lora.adapter_rank(folder) == 32


@pytest.mark.parametrize(
    "config",
    [None, "not json", {"peft_type": "IA3", "r": 8}, {"r": 0}, {"r": "8"}, {"r": True}, []],
)
def test_an_unreadable_adapter_is_refused(tmp_path: Path, config: object) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    if config == "not json":
        (folder / lora.CONFIG_FILE).write_text("{")
    elif config is not None:
        write_config(folder, config)
    with pytest.raises(lora.AdapterError) as info:
        lora.adapter_rank(folder)
    assert info.value.code == lora.ADAPTER_UNREADABLE


def test_lora_args_from_the_spec() -> None:
    assert lora_args(nodeagent_pb2.ReplicaSpec()) == []
    spec = nodeagent_pb2.ReplicaSpec(max_loras=2, max_lora_rank=8)
    assert lora_args(spec) == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    spec = nodeagent_pb2.ReplicaSpec(max_loras=1)  # no rank: vLLM's default
    assert lora_args(spec)[-1] == str(lora.DEFAULT_MAX_LORA_RANK)
    with pytest.raises(ValueError, match="max_loras 9 is above 8"):
        lora_args(nodeagent_pb2.ReplicaSpec(max_loras=9))
    with pytest.raises(ValueError, match="max_lora_rank 12 is not one of vLLM's ranks"):
        lora_args(nodeagent_pb2.ReplicaSpec(max_loras=1, max_lora_rank=12))


def test_lora_is_refused_on_the_grpc_transport() -> None:
    assert Transport.GRPC not in LORA_TRANSPORTS
    spec = nodeagent_pb2.ReplicaSpec(max_loras=2, transport=Transport.GRPC)
    with pytest.raises(ValueError, match="cannot serve LoRA adapters"):
        resolve_transport(spec)
    for transport in LORA_TRANSPORTS:
        spec.transport = transport
        assert resolve_transport(spec) == transport

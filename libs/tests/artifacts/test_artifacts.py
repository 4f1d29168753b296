"""`inferplane.artifacts`: the weights digest reads names, sizes and safetensors headers only,
and the chat template digest normalises line endings."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from inferplane.artifacts import ArtifactError, chat_template_digest, weights_digest

KIMI_TINY = Path(__file__).resolve().parents[3] / "models" / "kimi-tiny"


def _safetensors(path: Path, tensors: dict[str, list[int]], data: bytes) -> None:
    header = json.dumps(
        {
            name: {"dtype": "F32", "shape": shape, "data_offsets": [0, len(data)]}
            for name, shape in tensors.items()
        }
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_weights_digest_follows_headers_names_and_sizes_not_tensor_values(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model.safetensors", {"w": [2]}, b"\0" * 8)
    (tmp_path / "config.json").write_text("{}")
    first = weights_digest(tmp_path)
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 64
    # Same header and size, other values: same digest (the data is never read).
    _safetensors(tmp_path / "model.safetensors", {"w": [2]}, b"\1" * 8)
    assert weights_digest(tmp_path) == first
    (tmp_path / "config.json").write_text('{"other": 1}')  # not a weight file
    assert weights_digest(tmp_path) == first
    _safetensors(tmp_path / "model.safetensors", {"v": [2]}, b"\0" * 8)  # a renamed tensor
    renamed = weights_digest(tmp_path)
    assert renamed != first
    (tmp_path / "extra.bin").write_bytes(b"x" * 3)
    assert weights_digest(tmp_path) not in (first, renamed)


def test_weights_digest_is_stable_and_fast_on_the_fixture_model() -> None:
    assert weights_digest(KIMI_TINY) == weights_digest(str(KIMI_TINY))


def test_weights_digest_refuses_a_folder_without_weights_and_a_broken_header(
    tmp_path: Path,
) -> None:
    with pytest.raises(ArtifactError, match="no weight files"):
        weights_digest(tmp_path)
    with pytest.raises(ArtifactError, match="not a directory"):
        weights_digest(tmp_path / "missing")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ArtifactError, match="header"):
        weights_digest(tmp_path)


def test_chat_template_digest_normalises_line_endings() -> None:
    digest = chat_template_digest("{{ a }}\n{{ b }}")
    assert digest == chat_template_digest("{{ a }}\r\n{{ b }}")
    assert digest != chat_template_digest("{{ a }}\n{{ c }}")
    assert digest.startswith("sha256:")
    assert chat_template_digest("") == ""

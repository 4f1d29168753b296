"""What the fixture-model build scripts (`models/build_*_tiny.py`) and their tests share.

A build writes the model into a staging folder, copies it into `models/<name>/` file by file
(`publish`), and records every file's sha256 (`folder_digests`) and the library versions that
made it (`library_versions`) in `MANIFEST.json` (`write_json`). Its test checks the committed
folder against the manifest and, with the same library versions, that the script rebuilds the
same bytes (`assert_rebuilds_identically`): other versions may legitimately write other bytes,
so comparing then would test the libraries, not the script.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MANIFEST = "MANIFEST.json"


def library_versions() -> dict[str, str]:
    """The `versions` a MANIFEST.json records: python, torch, transformers, tokenizers and
    safetensors as installed here (imports them)."""
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


def folder_files(folder: Path) -> list[Path]:
    """Every file of `folder` but MANIFEST.json, sorted by relative path."""
    return sorted(
        (p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST),
        key=lambda p: p.relative_to(folder).as_posix(),
    )


def folder_digests(folder: Path) -> dict[str, str]:
    """Relative path → sha256 hex of every file but MANIFEST.json, in `folder_files` order."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder_files(folder)
    }


def write_json(path: Path, value: Any) -> None:
    """`value` as indented JSON with a final newline (the manifests' format)."""
    path.write_text(json.dumps(value, indent=2) + "\n")


def publish(staging: Path, out: Path) -> None:
    """Replaces `out` with the files of `staging`, copied file by file (contents only: a
    temporary folder's 0700 mode must not come along)."""
    if out.exists():
        shutil.rmtree(out)
    for src in folder_files(staging):
        dst = out / src.relative_to(staging)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table: the byte-level BPE alphabet that ByteLevel
    pre-tokenization writes, in GPT-2's id order (printable Latin-1 bytes first, then the
    others mapped above U+0100). transformers 5 no longer exports it."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def assert_rebuilds_identically(script: Path, committed: Path, out: Path) -> None:
    """Runs `script --out out` and asserts it wrote exactly the committed folder's files,
    MANIFEST.json included. Skips (pytest) when the installed libraries differ from the
    manifest's `versions`: the comparison is only meaningful with the versions that built it."""
    import pytest

    manifest = json.loads((committed / MANIFEST).read_text())
    if library_versions() != manifest["versions"]:
        pytest.skip(f"committed with {manifest['versions']}; rebuild to compare")
    subprocess.run(
        [sys.executable, str(script), "--out", str(out)], check=True, capture_output=True
    )
    assert folder_digests(out) == manifest["sha256"]
    assert (out / MANIFEST).read_bytes() == (committed / MANIFEST).read_bytes()

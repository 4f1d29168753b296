"""Rewrite the files of ``models/kimi-tiny/`` that are not weights, as the build writes them
today, without training again.

    PYTHONPATH=libs python models/refresh_kimi_tiny.py [--out models/kimi-tiny]

Training kimi-tiny takes 6.5-20 minutes of 2 CPU cores (models/README.md); a change to its
configuration that leaves the weights as they are (the position limit
``inferplane.fixtures.kimi_tiny.MAX_POSITIONS``: plain RoPE has no weights, and the random
initialisation draws no number from it) needs no training. This script runs the build's own
steps up to the weights, with the arguments of the folder's ``MANIFEST.json`` ``build_command``:
the same synthetic corpus (fixed seed), the same BPE training, ``build_config``,
``write_folder_base``. It then

- loads the folder's trained weights into a model of today's configuration and saves it as the
  build does (``save_pretrained`` writes config.json and generation_config.json too);
- refuses (exit 1, nothing written) when the tokenizer it trains differs from the folder's
  ``tokenizer.json`` (the weights were trained on those ids) or the saved weights differ from
  the folder's ``model.safetensors`` by one byte: only a rebuild may change either;
- copies the files that changed over the folder and updates the manifest's ``sha256`` and
  ``size_bytes`` (its other fields are the training's and stay).

Running it on an up-to-date folder changes no byte (``libs/tests/fixture_model/
test_kimi_tiny_files.py`` checks that on a copy of the committed folder).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import build_kimi_tiny as build

WEIGHTS = "model.safetensors"
MANIFEST = "MANIFEST.json"


def build_args(manifest: dict) -> argparse.Namespace:
    """The build's arguments as the manifest's `build_command` gave them (defaults for the
    rest). Raises ValueError when the command does not run build_kimi_tiny.py."""
    words = shlex.split(manifest["build_command"])
    scripts = [i for i, w in enumerate(words) if w.endswith("build_kimi_tiny.py")]
    if not scripts:
        raise ValueError(f"not a kimi-tiny build command: {manifest['build_command']!r}")
    return build.arg_parser().parse_args(words[scripts[0] + 1 :])


def write_folder(args: argparse.Namespace, weights: Path, staging: Path) -> None:
    """The folder as `build.main` writes it, into `staging`: the files it writes before
    training, then the model saved over them (config.json and generation_config.json as
    `save_pretrained` writes them, and the weights), with the trained weights of `weights`
    loaded into a model built from today's `build_config`.

    Raises:
        SystemExit: `weights` does not fit the configured model (a parameter missing or extra).
    """
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    shape = {key: getattr(args, key) for key in build.SHAPE}
    train_set = build.samples(build.SEED, args.train_samples)
    corpus = [build.render_plain(s) for s in train_set[:4000]]
    trained = build.build_tokenizer(corpus, space_merges=not args.no_space_merges)
    config = build.build_config(trained, shape)
    build.write_folder_base(staging, trained, config)
    torch.manual_seed(build.SEED)
    model = Qwen2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # tied to the embeddings
        raise SystemExit(f"weights do not fit the model: missing {missing}, extra {unexpected}")
    model.save_pretrained(staging, safe_serialization=True)


def refresh(out: Path) -> list[str]:
    """Rewrites `out`'s non-weight files and its manifest's digests; returns the names of the
    files whose bytes changed (MANIFEST.json included when it did).

    Raises:
        SystemExit: the trained tokenizer differs from the folder's (the message says why).
    """
    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    staging = Path(tempfile.mkdtemp(prefix="kimi-tiny-files-"))
    try:
        write_folder(build_args(manifest), out / WEIGHTS, staging)
        for name in ("tokenizer.json", WEIGHTS):
            if (staging / name).read_bytes() != (out / name).read_bytes():
                raise SystemExit(
                    f"{name} would change: the weights were trained on the folder's tokenizer "
                    "and saved as they are, so rebuild (models/build_kimi_tiny.py) instead"
                )
        changed = []
        for src in sorted(staging.iterdir()):
            dst = out / src.name
            if dst.is_file() and dst.read_bytes() == src.read_bytes():
                continue
            shutil.copyfile(src, dst)
            changed.append(src.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = {p.name: build.sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    files.pop(MANIFEST, None)
    updated = {
        **manifest,
        "size_bytes": sum((out / f).stat().st_size for f in files),
        "sha256": files,
    }
    if updated != manifest:
        manifest_path.write_text(json.dumps(updated, indent=2) + "\n")
        changed.append(MANIFEST)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=build.REPO / "models" / "kimi-tiny")
    args = ap.parse_args(argv)
    changed = refresh(args.out)
    print("changed: " + (", ".join(changed) if changed else "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a fixture model lives: `<repo>/models/<name>`, or the folder an environment variable
names (for a checkout-less install or a rebuilt copy)."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[3] / "models"
"""`<repo>/models`, found relative to this file (libs/inferplane/testing/)."""


def fixture_model_path(name: str, env_var: str) -> Path:
    """`$env_var` if set, else `MODELS_DIR / name`.

    Raises:
        FileNotFoundError: the directory has no ``config.json`` (not a checkout, or the
            variable points elsewhere); the message names the variable and the build script.
    """
    override = os.environ.get(env_var)
    path = Path(override) if override else MODELS_DIR / name
    if not (path / "config.json").is_file():
        script = f"models/build_{name.replace('-', '_')}.py"
        raise FileNotFoundError(
            f"{name} not found at {path}; set {env_var} to the model directory (built by {script})"
        )
    return path

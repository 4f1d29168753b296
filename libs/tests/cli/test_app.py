"""The `inferplane` command: service CLIs plug in through entry points (libs/ never imports
services/)."""

from __future__ import annotations

import ast
from pathlib import Path

import typer
from typer.testing import CliRunner

from inferplane.cli._app import app, mount_service_clis

LIBS = Path(__file__).resolve().parents[2] / "inferplane"
SERVICES = ("auth", "router", "orchestrator", "node_agent", "telemetry")


def test_the_service_clis_are_mounted_from_their_entry_points() -> None:
    """`keys`, `deployments`, `top` and `usage` come from the services' entry points."""
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("keys", "deployments", "top", "usage", "up", "status", "parsers"):
        assert name in result.output
    assert mount_service_clis(typer.Typer()) == ["deployments", "keys", "top", "usage"]


def test_libs_never_import_services() -> None:
    """No module under libs/inferplane imports a service package (`inferplane.<service>`)."""
    offenders = []
    for path in LIBS.rglob("*.py"):
        if "api" in path.relative_to(LIBS).parts[:1]:
            continue  # generated stubs
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[0] == "inferplane" and parts[1] in SERVICES:
                    offenders.append(f"{path.relative_to(LIBS)}: {name}")
    assert offenders == []

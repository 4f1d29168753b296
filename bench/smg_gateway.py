"""SMG (Shepherd Model Gateway, PyPI `smg`: a Rust gateway behind a Python entry point) as the
anchor `bench/stack_vs_vllm.py` runs beside the platform: the gateway users would put in front of
plain vLLM instead of inferplane.

It lives in its own environment, `.venv-smg/` (`bench/smg.lock`, installed by
`scripts/setup.sh`), so the project's environment carries no 100 MB Rust binary it never uses.
Two ways it fronts vLLM:

- `http`: `smg launch --worker-urls http://…` in front of `vllm serve`'s own HTTP server (vLLM
  tokenizes, renders and parses; SMG routes and proxies the SSE);
- `grpc`: `smg launch --worker-urls grpc://…` in front of `vllm serve --grpc` (SMG tokenizes,
  renders the chat template and runs its own Kimi K2 parsers in Rust; vLLM's front process only
  runs the gRPC servicer).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.private_files import open_private_log

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-smg"
LOCK = REPO / "bench" / "smg.lock"


def smg_binary() -> tuple[Path | None, str]:
    """(the `smg` entry point, "") or (None, why it cannot run here)."""
    binary = VENV / "bin" / "smg"
    if not binary.exists():
        return None, (
            f"{binary.relative_to(REPO)} is missing: ./scripts/setup.sh installs "
            f"{LOCK.relative_to(REPO)} there"
        )
    return binary, ""


class Gateway:
    """One `smg launch` process in front of `worker_url` (`http://…` or `grpc://…`), in a
    process group of its own, its Prometheus listener on loopback (its default is 0.0.0.0)."""

    def __init__(
        self, binary: Path, worker_url: str, log_path: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open_private_log(log_path) as out:
            self.proc = subprocess.Popen(
                [
                    *(str(binary), "launch", "--host", "127.0.0.1", "--port", str(self.port)),
                    *("--worker-urls", worker_url),
                    *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
                    *("--log-level", "warn"),
                    *extra,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 90.0) -> float:
        """Seconds until the gateway answers `/v1/models` with its worker listed.

        Raises:
            RuntimeError: it exited or was not ready in time (the message holds its log tail).
        """
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                break
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as response,
            ):
                if response.status == 200 and b'"id"' in response.read():
                    return time.monotonic() - started
            time.sleep(0.5)
        state = (
            f"exited ({self.proc.returncode})"
            if self.proc.poll() is not None
            else f"not ready after {timeout:g} s"
        )
        raise RuntimeError(f"smg {state}; {self.log_path}:\n{self.log_tail()}")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        procguard.kill_group(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        procguard.kill_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

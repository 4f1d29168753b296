"""Child processes of the local stack: started in their own group, dying with `up`, stopped
gracefully (SIGTERM, then SIGKILL after a timeout); Envoy inside a `StackHost`'s namespace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inferplane.edge import EnvoyProcess
from inferplane.localstack._config import StackHost
from inferplane.runtime.processes import procguard
from inferplane.runtime.security.private_files import open_private_log


class ManagedProcess:
    """One component of the stack, logging to `log_path` (mode 0600: logs may hold what
    only the operator should read)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open_private_log(self.log_path)
        try:
            # The child gets SIGTERM if `up` dies, even by SIGKILL: services shut down
            # gracefully and the node-agent takes its engines down.
            self.proc = subprocess.Popen(
                procguard.guarded_argv(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def exited(self) -> int | None:
        """The exit code when the process ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process group, wait up to `timeout` s, then SIGKILL it. Returns the code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        # Whatever is left in the group (or the group itself, if it ignored SIGTERM) goes now.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.proc.poll()


class HostedEnvoy(EnvoyProcess):
    """Envoy started inside a `StackHost`'s network namespace."""

    def __init__(self, bootstrap: str, *, host: StackHost, **kwargs: Any) -> None:
        super().__init__(bootstrap, **kwargs)
        self.host = host

    def command(self) -> list[str]:
        return self.host.wrap(super().command())

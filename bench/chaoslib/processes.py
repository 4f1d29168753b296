"""The stack's processes the faults act on: vLLM's engine core below a replica, a supervisor's
restart of a killed service, Envoy's retry counter, and PostgreSQL, the database that goes
away."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.edge import REPLICAS_CLUSTER
from inferplane.localstack import Stack
from inferplane.node_agent.supervisor.process import tree_pids
from inferplane.runtime.security.identity import PeerSecurity

REPO = Path(__file__).resolve().parents[2]
Log = Callable[[str], None]


def engine_core_pid(replica_pid: int, timeout_s: float = 10.0) -> int:
    """The pid of vLLM's engine core (`VLLM::EngineCore`) below a replica process.

    Raises: RuntimeError when none shows up within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in tree_pids(replica_pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                    return int(pid)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no engine core below replica process {replica_pid}")
        time.sleep(0.1)


def wait_healthy(security: PeerSecurity, address: str, timeout_s: float) -> bool:
    """Whether the gRPC health service at `address` answered SERVING within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            time.sleep(0.1)
    return False


def restart_service(stack: Stack, name: str, log: Log, exit_timeout_s: float = 60.0) -> None:
    """Waits for service `name` to exit (SIGKILL it after `exit_timeout_s`), then starts it
    again with the same argv and log: a supervisor's restart. Call from a long-lived thread
    (the child's parent-death signal follows the starting thread)."""
    proc = stack.processes[name]
    assert proc.proc is not None
    try:
        proc.proc.wait(exit_timeout_s)
    except subprocess.TimeoutExpired:
        log(f"  {name} still runs {exit_timeout_s:.0f} s after the signal: SIGKILL")
        proc.proc.kill()
        proc.proc.wait(10)
    exited, code = time.monotonic(), proc.proc.returncode
    proc.start()
    healthy = wait_healthy(stack.config.security, stack.config.address(name), 60)
    state = "healthy" if healthy else "NOT healthy after 60 s"
    log(f"  {name} exited ({code}), restarted: {state} {time.monotonic() - exited:.1f} s later")


def envoy_retries(stack: Stack) -> int:
    """Envoy's `upstream_rq_retry` counter of the replicas cluster (0 when unreadable)."""
    if stack.edge is None:
        return 0
    name = f"cluster.{REPLICAS_CLUSTER}.upstream_rq_retry"
    with contextlib.suppress(httpx.HTTPError, ValueError):
        text = httpx.get(f"{stack.edge.admin_url}/stats?filter=^{name}$", timeout=5).text
        for line in text.splitlines():
            stat, _, value = line.partition(": ")
            if stat == name:
                return int(value)
    return 0


# -- PostgreSQL, the database that goes away ---------------------------------------------------


class Postgres:
    """A throw-away PostgreSQL (`scripts/postgres.sh`) that can be stopped and started again
    on its port: the database that goes away."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url = ""
        self._bin = ""
        self._port = 0

    def start(self) -> None:
        """Raises: RuntimeError when the script fails (no PostgreSQL and no way to install)."""
        self.directory.parent.chmod(0o755)
        done = subprocess.run(
            [str(REPO / "scripts" / "postgres.sh"), "start", str(self.directory)],
            capture_output=True,
            text=True,
            check=False,
        )
        match = re.search(r"INFERPLANE_TEST_POSTGRES_URL=(\S+)", done.stdout)
        if done.returncode != 0 or match is None:
            raise RuntimeError(f"scripts/postgres.sh start failed: {done.stderr.strip()[-500:]}")
        self.url = match.group(1)
        self._port = int(re.search(r":(\d+)/", self.url).group(1))  # type: ignore[union-attr]
        self._bin = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version)[-1].as_posix()

    def database(self, name: str) -> str:
        """Creates database `name`; returns its URL."""
        from sqlalchemy import create_engine

        engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        finally:
            engine.dispose()
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def _pg_ctl(self, *args: str) -> None:
        command = " ".join([f"{self._bin}/pg_ctl", "-D", f"'{self.directory}/data'", *args])
        subprocess.run(["su", "postgres", "-c", command], check=True, capture_output=True)

    def stop_now(self) -> None:
        """Stops the server at once (`-m immediate`: every connection drops, as in a crash)."""
        self._pg_ctl("-m", "immediate", "-w", "stop")

    def start_again(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self._port} -k '{self.directory}' -c fsync=off"
        )
        self._pg_ctl("-l", f"'{self.directory}/pg.log'", "-w", "-o", f'"{options}"', "start")

    def close(self) -> None:
        subprocess.run(
            [str(REPO / "scripts" / "postgres.sh"), "stop", str(self.directory)],
            capture_output=True,
            check=False,
        )


def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", path.parent.name))

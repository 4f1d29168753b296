"""What the local stack's fixture deployments cost to start and to hold: the wall time from
`Stack.start` to every replica routable, and each replica's memory (its process tree: the
replica process, vLLM's engine core and worker), once started and idle.

    .venv/bin/python bench/stack_start_cost.py [--max-model-len N[,M...]] [--qwen3]
        [--embeddings] [--speech] [--rounds R]

Each round starts one stack per `--max-model-len` value, in turn (alternating, so that the
machine's changing load falls on every value alike).

Prints one line per round and replica (model; `ready_s`: from the node-agent starting the
replica process to the replica ready, as the node-agent reports them; RSS and PSS of its tree
in MiB), then
`stack_start_seconds_<max_model_len>: X` per value (the median over its rounds; a round whose
stack failed to start counts nowhere). PSS splits shared pages (the Python and
torch libraries the processes of one tree share) between their users, so it is the figure to
add up across replicas; RSS counts them in every process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import Stack, StackConfig, StackError
from inferplane.runtime.processes.ports import free_port, free_port_run

MIB = 1024 * 1024


def tree_memory(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB of process `pid` and its descendants (0 for any that vanished)."""
    rss = pss = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss / MIB, pss / MIB


def one_round(args: argparse.Namespace, max_model_len: int, data_dir: Path) -> float:
    config = StackConfig(
        data_dir=data_dir,
        http_port=free_port(),
        grpc_base_port=free_port_run(5),
        metrics_base_port=free_port_run(5),
        envoy_admin_port=free_port(),
        max_model_len=max_model_len,
        qwen3=args.qwen3,
        embeddings=args.embeddings,
        speech=args.speech,
        plaintext=True,
    )
    stack = Stack(config)
    started = time.monotonic()
    try:
        stack.start(lambda _message: None)
        seconds = time.monotonic() - started
        time.sleep(args.settle_seconds)
        for model in stack.deployments():
            for endpoint in stack.serving_endpoints(model):
                replica = stack.replica(endpoint.replica_id)
                rss, pss = tree_memory(replica.engine_pid)
                ready = replica.ready_time.ToDatetime() - replica.start_time.ToDatetime()
                print(
                    f"  {model:12s} ready_s={ready.total_seconds():5.1f} "
                    f"rss_mib={rss:6.0f} pss_mib={pss:6.0f}",
                    flush=True,
                )
    finally:
        stack.stop()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--max-model-len",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[kimi_tiny.MAX_MODEL_LEN],
        help="the chat deployments' context length; comma-separated values alternate",
    )
    ap.add_argument("--qwen3", action="store_true", help="also serve qwen3-tiny")
    ap.add_argument("--embeddings", action="store_true", help="also serve embed-tiny")
    ap.add_argument("--speech", action="store_true", help="also serve whisper-tiny")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--settle-seconds", type=float, default=5.0)
    args = ap.parse_args()
    seconds: dict[int, list[float]] = {n: [] for n in args.max_model_len}
    for n in range(args.rounds):
        for max_model_len in args.max_model_len:
            print(f"round {n + 1}: max_model_len={max_model_len}", flush=True)
            print(f"  load_average_1min={os.getloadavg()[0]:.1f}", flush=True)
            with tempfile.TemporaryDirectory(prefix="stack-start-") as tmp:
                try:
                    took = one_round(args, max_model_len, Path(tmp))
                except StackError as exc:
                    print(f"  failed: {str(exc).splitlines()[0]}", flush=True)
                    continue
            seconds[max_model_len].append(took)
            print(f"  started in {took:.1f} s", flush=True)
    for max_model_len, took_all in seconds.items():
        median = f"{statistics.median(took_all):.1f}" if took_all else "none"
        print(f"stack_start_seconds_{max_model_len}: {median}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

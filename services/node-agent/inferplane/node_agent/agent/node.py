"""What this node has: GPUs (NVML through pynvml, else `nvidia-smi`), CPUs and memory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2

log = structlog.get_logger("inferplane.node_agent.node")

_SMI_FIELDS = "index,uuid,name,memory.total,memory.used"


@dataclasses.dataclass(frozen=True, slots=True)
class Inventory:
    """The node's hardware: `gpus` empty on a CPU node; memory in bytes."""

    gpus: tuple[nodeagent_pb2.Gpu, ...]
    cpu_count: int
    memory_bytes: int


def memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemTotal from /proc/meminfo in bytes (0 when unreadable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    return 0


def _gpus_nvml() -> tuple[nodeagent_pb2.Gpu, ...] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: a CPU node
        return ()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                nodeagent_pb2.Gpu(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    model=name.decode() if isinstance(name, bytes) else name,
                    memory_bytes=int(mem.total),
                    memory_used_bytes=int(mem.used),
                    healthy=True,
                )
            )
        return tuple(gpus)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def parse_nvidia_smi(csv_text: str) -> tuple[nodeagent_pb2.Gpu, ...]:
    """Parses `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used
    --format=csv,noheader,nounits` (memory in MiB)."""
    gpus = []
    for line in csv_text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        index, uuid, name, total, used = parts
        mib = 1024 * 1024
        healthy = "[" not in total  # "[N/A]" / "[Unknown Error]" mark an unhealthy device
        gpus.append(
            nodeagent_pb2.Gpu(
                index=int(index),
                uuid=uuid,
                model=name,
                memory_bytes=int(float(total)) * mib if healthy else 0,
                memory_used_bytes=int(float(used)) * mib if healthy and "[" not in used else 0,
                healthy=healthy,
            )
        )
    return tuple(gpus)


def _gpus_smi() -> tuple[nodeagent_pb2.Gpu, ...]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia_smi_failed", error=str(exc))
        return ()
    return parse_nvidia_smi(out)


def probe_inventory() -> Inventory:
    """GPUs via NVML (pynvml) when installed, else nvidia-smi when on PATH, else none."""
    gpus = _gpus_nvml()
    if gpus is None:
        gpus = _gpus_smi()
    return Inventory(gpus=gpus, cpu_count=os.cpu_count() or 0, memory_bytes=memory_bytes())

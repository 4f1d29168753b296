"""CPU scheduling priority of an engine's core process (CPU nodes).

vLLM runs a replica as three kinds of process: the API server (the HTTP or gRPC front: our
launcher's own process), the engine core (scheduler; process title `VLLM::EngineCore`) and one
model-runner worker per rank (`VLLM::Worker`, started by the engine core). The engine core
reads the workers' results through vLLM's shared-memory message queue, whose reader
busy-loops with `sched_yield()` for one second after each message (`SpinCondition.wait`,
`busy_loop_s=1`, vllm/distributed/device_communicators/shm_broadcast.py, vLLM 0.32), so under
load the engine core is always runnable. On a CPU node it shares the cores that are not the
workers' with the engine front and the platform's request path (node-agent, router, Envoy),
which then wait for its time slices: new requests stall for up to a second. At a higher
niceness its share of a contended core shrinks (CFS weight 15 at 19 against 1,024 at 0) and
the request path runs first. Measured on the 2-core box
(bench/README.md, 2026-11-25, c=8, A/B in one run): the stack's TTFT p99 went from 0.2–1.4 s
(niceness 0; 0.8–1.4 s in most runs) to 70–140 ms at 19 and 110–170 ms at 10, with 5 no
better than 0; plain vLLM's from 0.4–1.1 s to 37–38 ms (at 10), with more tokens/s for both.
The workers (which compute) did better left at the front's priority.

`renice_engine_cores` is applied once the replica is ready: the workers exist by then and keep
their priority (a child inherits its parent's niceness at fork, and without privilege a
niceness can only go up), threads the engine core starts later inherit its niceness.
"""

from __future__ import annotations

import os
from pathlib import Path

from inferplane.node_agent.engine.process import tree_pids

ENGINE_CORE_COMM = "VLLM::EngineCor"
"""`/proc/<pid>/comm` of vLLM's engine core: its `VLLM::EngineCore` process title, cut to the
kernel's 15 characters (vllm/utils/system_utils.py `set_process_title`)."""


def thread_ids(pid: int) -> list[int]:
    """The thread ids of `pid` (empty when it is gone)."""
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def comm(pid: int) -> str:
    """`pid`'s command name (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def renice_threads(pid: int, niceness: int) -> None:
    """Sets every thread of `pid` whose niceness is below `niceness` to `niceness` (Linux
    niceness is per thread); never lowers one. Threads that exit meanwhile are skipped.

    Raises:
        PermissionError: the thread is not ours to change (another user's process).
    """
    for tid in thread_ids(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # exited meanwhile
            continue


def renice_engine_cores(root: int, niceness: int) -> list[int]:
    """Gives the engine core processes below `root` (an engine launcher; one per data-parallel
    rank) `niceness` on every thread; returns their pids (empty when none was found).

    Raises:
        ValueError: `niceness` outside 1..19.
        PermissionError: an engine core is not ours to change.
    """
    if not 1 <= niceness <= 19:
        raise ValueError(f"engine niceness must be within 1..19, got {niceness}")
    cores = [pid for pid in tree_pids(root)[1:] if comm(pid) == ENGINE_CORE_COMM]
    for pid in cores:
        renice_threads(pid, niceness)
    return cores

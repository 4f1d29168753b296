"""CPU scheduling priority of a replica's engine processes (CPU nodes).

The process layout (issue 16 B): the node-agent's supervisor launches one replica process per
replica, which leads a session of its own (`supervisor/process.py`); the engine lives in its tree.
With the `inproc` transport the replica process is the engine's front itself (vLLM's
`AsyncLLM`), and vLLM starts the engine core (scheduler; process title `VLLM::EngineCore`)
below it, which starts one model-runner worker per rank (`VLLM::Worker`). With
`http-completions` / `grpc` the replica process spawns a child engine (our launcher running
`vllm serve`: its API server, then the engine core and workers below it), which leads a session
of its own. `session_leaders(replica_pid)` (`supervisor/process.py`) lists the replica process and
every such session of its tree.

Why the engine core: it reads the workers' results through vLLM's shared-memory message queue,
whose reader busy-loops with `sched_yield()` for one second after each message
(`SpinCondition.wait`, `busy_loop_s=1`, vllm/distributed/device_communicators/shm_broadcast.py,
vLLM 0.32), so under load it is always runnable. On a CPU node it shares the cores that are not
the workers' with the engine's front and the platform's request path (the replica front,
router, Envoy), which then wait for its time slices: new requests stall for up to a second. At
a higher niceness its share of a contended core shrinks (CFS weight 15 at 19 against 1,024 at
0) against the other threads of its scheduling group. The workers (which compute) do better
left at the front's priority.

Niceness orders threads only within one scheduler task group. On kernels with autogroups
(`CONFIG_SCHED_AUTOGROUP`, on by default in most distributions) every session is a task group
of its own, and the scheduler shares a contended core between groups before it looks at
niceness inside them (sched(7), "The autogroup feature"). So the engine core's niceness yields
the core only to its own session, not to the platform's other services (each leads a session
of its own). `set_autogroup_niceness` lowers each session of the replica's tree against
theirs: with `inproc` that session holds the replica's front too, so the front yields with its
engine. Both rules and the measurements behind them (taken on the v1 path, where the
node-agent was the front) are in bench/README.md; they stay until an A/B on the
replica-process path decides (issue 16).

Both are applied by the supervisor once the replica is ready (`renice_engine_cores` on the
replica process's pid, `set_autogroup_niceness` on each of its `session_leaders`): the workers
exist by then and keep their priority (a child inherits its parent's niceness at fork, and
without privilege a niceness can only go up), threads the engine core starts later inherit its
niceness.
"""

from __future__ import annotations

import os
from pathlib import Path

from inferplane.node_agent.supervisor.process import tree_pids

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
    """Gives the engine core processes anywhere below `root` (a replica process; one engine
    core per data-parallel rank) `niceness` on every thread; returns their pids (empty when none
    was found).

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


def autogroups_enabled() -> bool:
    """Whether the kernel schedules sessions as autogroups (`sched_autogroup_enabled`; a
    kernel without `CONFIG_SCHED_AUTOGROUP` has no such file)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def autogroup_niceness(pid: int) -> int | None:
    """The niceness of `pid`'s autogroup, from `/proc/<pid>/autogroup` ("/autogroup-N nice K");
    None when `pid` is in the root autogroup: no process of its session tree called `setsid()`
    since boot (PID 1's, and a container's whose runtime starts no session). The kernel prints
    nothing for that group (`proc_sched_autogroup_show_task`, kernel/sched/autogroup.c), and
    its weight, the root task group's, cannot be changed.

    Raises:
        OSError: `pid` is gone, or the kernel keeps no autogroups.
        ValueError: the file is not in that format (`parse_autogroup`).
    """
    return parse_autogroup(Path(f"/proc/{pid}/autogroup").read_text())


def parse_autogroup(text: str) -> int | None:
    """The niceness in a `/proc/<pid>/autogroup` text ("/autogroup-N nice K"); None for the
    root autogroup's empty text (`autogroup_niceness`).

    Raises:
        ValueError: `text` is neither.
    """
    fields = text.split()
    if not fields:
        return None
    if len(fields) != 3 or not fields[0].startswith("/autogroup-") or fields[1] != "nice":
        raise ValueError(f"not a /proc/<pid>/autogroup text: {text!r}")
    return int(fields[2])


def set_autogroup_niceness(leader: int, niceness: int) -> bool:
    """Gives the autogroup of the session `leader` leads the niceness `niceness`: every process
    of the session gets that share of a contended core against other sessions (a child
    engine's front, engine core and workers together; for the replica process's own session,
    its front and, with `inproc`, vLLM's engine core and workers). Returns False when there is
    nothing to set: autogroups are off (`autogroups_enabled`). A process in a CPU cgroup other
    than the root one is scheduled by its cgroup instead, and the setting has no effect
    (sched(7)).

    Raises:
        ValueError: `niceness` outside 1..19, or `leader` does not lead its session (its
            autogroup would be shared with processes that are not the engine's).
        BlockingIOError: an unprivileged write came within 100 ms of the last one on this node
            (EAGAIN: the kernel rate-limits them, kernel/sched/autogroup.c); retry.
        PermissionError: the session is not ours to change.
        ProcessLookupError: `leader` is gone.
    """
    if not 1 <= niceness <= 19:
        raise ValueError(f"autogroup niceness must be within 1..19, got {niceness}")
    if not autogroups_enabled():
        return False
    if os.getsid(leader) != leader:
        raise ValueError(f"process {leader} does not lead its session")
    with open(f"/proc/{leader}/autogroup", "w") as f:
        f.write(str(niceness))
    return True

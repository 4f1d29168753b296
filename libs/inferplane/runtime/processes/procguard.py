"""Keeps engine process trees from outliving the node-agent that started them.

Three layers, because each alone misses a case:
- the supervisor starts every engine as the leader of its own session / process group
  (`start_new_session=True`), so one `killpg` reaches the launcher and everything vLLM forked
  or spawned (API server, EngineCore, workers, the resource tracker);
- `guard_parent()` runs first thing inside the engine process: Linux `PR_SET_PDEATHSIG`
  (prctl(2)) makes the kernel signal it the moment its parent dies, even by SIGKILL, and a
  watchdog thread that polls `getppid()` kills the whole group if the signal was handled
  gracefully but the group did not go away (vLLM's own SIGTERM handler only shuts down the
  processes it knows about). It also starts a reaper (`start_reaper`): PDEATHSIG is not
  inherited by the engine's own children (vLLM spawns EngineCore and its workers), and when the
  engine dies *of* the signal — vLLM's HTTP server re-raises SIGTERM after its graceful
  shutdown — neither its atexit hooks nor the watchdog run; the reaper, a tiny process in the
  same group, outlives it, then stops what is left of the group;
- the supervisor kills every group it started on `close()` and from an `atexit` hook.

PR_SET_PDEATHSIG fires when the parent *thread* exits, so the supervisor must spawn engines
from a long-lived thread (the event loop's), never from a short-lived executor thread.

`spawn` starts those children (`Child`). Not with `asyncio.create_subprocess_exec`: on uvloop
(the services' default loop) that is libuv's `uv_spawn`, a real fork() that runs gRPC's
pthread_atfork handlers and then blocks the calling thread, the event loop's, reading a pipe
until the child has exec'd. A child that deadlocks between fork and exec on a lock another
thread held at the fork (the classic fork-in-a-threaded-process hazard: gRPC's threads) holds
the whole process: a node-agent stalled 63 s like that (no heartbeats, its node marked
NotReady). CPython's `subprocess` forks with vfork(2) instead (no atfork handlers; the child
runs only async-signal-safe code until exec), in ~1 ms rather than ~6.5 ms here; the exit is
awaited through a pidfd (pidfd_open(2), Linux 5.3) on whatever loop runs.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PARENT_PID_ENV = "INFERPLANE_ENGINE_PARENT_PID"
"""The node-agent's pid, as the engine process should see it as its parent."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Child:
    """A child process started by `spawn`: `pid`, `returncode` (None while it runs) and
    `wait()`, awaitable on any event loop (asyncio or uvloop)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal), else None."""
        return self._popen.poll()

    async def wait(self) -> int:
        """Waits for the child to exit without blocking the loop; returns its exit status."""
        if self._popen.poll() is not None:
            return self._popen.returncode
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(self._popen.pid)
        except ProcessLookupError:  # reaped meanwhile
            return self._popen.wait()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return self._popen.wait()  # exited: waitpid returns at once


def spawn(argv: Sequence[str], **popen: Any) -> Child:
    """Starts `argv` with `subprocess.Popen(argv, **popen)` (vfork: see the module docstring)
    from the calling thread, which must be a long-lived one (the event loop's) when the child
    relies on PR_SET_PDEATHSIG. Raises what Popen raises (OSError: not executable...)."""
    return Child(subprocess.Popen(argv, **popen))


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies (Linux only).

    Returns False where prctl is unavailable (not Linux), True otherwise.
    Raises OSError when prctl fails.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    prctl = getattr(libc, "prctl", None)
    if prctl is None:
        return False
    if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return True


def group_members(pgid: int) -> list[int]:
    """Pids of live processes whose process group is `pgid` (from /proc/<pid>/stat)."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 2 (comm) may contain spaces and parentheses; the rest follows the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        # fields[0] is state (3rd field), fields[2] is pgrp (5th field).
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signals every process of group `pgid`; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_group_except_self(sig: int = signal.SIGKILL) -> None:
    """Signals the other members of this process's group (stragglers vLLM left behind)."""
    me = os.getpid()
    for pid in group_members(os.getpgrp()):
        if pid != me:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def guard_parent(
    expected_parent: int | None = None,
    *,
    poll_seconds: float = 0.5,
    grace_seconds: float = 10.0,
) -> None:
    """Makes this process (and its process group) die with its parent.

    Sets PR_SET_PDEATHSIG to SIGTERM (a graceful shutdown first) and starts a daemon thread
    that, once the parent is gone, waits `grace_seconds` for that shutdown and then SIGKILLs
    the whole process group. If the parent died before this call (the pid in
    `$INFERPLANE_ENGINE_PARENT_PID` no longer being the parent), the group is killed at once.
    On a normal exit of this process (atexit), the rest of its group is SIGKILLed.

    Only call this in a process that leads its own group (the supervisor's engines), or it
    would take its parent's group down with it.
    """
    if expected_parent is None:
        env = os.environ.get(PARENT_PID_ENV)
        expected_parent = int(env) if env else os.getppid()
    if os.getpgrp() != os.getpid():
        raise RuntimeError("guard_parent() needs a process that leads its own process group")
    set_parent_death_signal(signal.SIGTERM)
    # A graceful exit of the leader must not leave what it forked behind either.
    atexit.register(kill_group_except_self)
    start_reaper()
    if os.getppid() != expected_parent:
        # The parent died between fork and prctl: the death signal will never come.
        kill_group(os.getpgrp(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == expected_parent:
            time.sleep(poll_seconds)
        # Still running after the grace: the shutdown hangs. (Exiting, it leaves the rest of
        # the group to the reaper.)
        time.sleep(grace_seconds)
        kill_group(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="inferplane-parent-guard", daemon=True).start()


def guarded_argv(argv: list[str]) -> list[str]:
    """`argv` wrapped so the program gets SIGTERM when the calling process dies (Linux).

    The wrapper is a fresh interpreter that sets PR_SET_PDEATHSIG and then execs `argv`. Not a
    `preexec_fn`: that runs Python after fork() in a process whose gRPC threads may hold locks,
    and gRPC's fork handlers then abort the child (seen with Envoy: SIGABRT, "epoll_wait error:
    Bad file descriptor"). PDEATHSIG follows the *thread* that started the child: start it from
    a long-lived thread. Elsewhere than Linux `argv` is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", "inferplane.runtime.processes.procguard", str(os.getpid()), *argv]


def start_reaper(grace_seconds: float = 5.0) -> subprocess.Popen[bytes] | None:
    """Starts the reaper of this process's group: a small process (stdlib only) that waits
    for this process to be gone — however it ended — then SIGTERMs whatever is left of the
    group and SIGKILLs it after `grace_seconds`. It ignores SIGTERM/SIGINT/SIGHUP (a
    group-wide stop must not end it before its leader). None elsewhere than Linux."""
    if not sys.platform.startswith("linux"):
        return None
    # -I: no PYTHONPATH, no user site, no script directory on sys.path: stdlib only.
    argv = [sys.executable, "-I", __file__, "reap", str(os.getpid()), str(grace_seconds)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def _reap(leader: int, grace_seconds: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    set_parent_death_signal(signal.SIGUSR1)
    while os.getppid() == leader:
        signal.sigtimedwait({signal.SIGUSR1}, 1.0)
    me, group = os.getpid(), os.getpgrp()

    def left() -> list[int]:
        return [pid for pid in group_members(group) if pid != me]

    if not (pids := left()):
        return
    print(
        f"procguard: process {leader} is gone; stopping its leftovers {pids}",
        file=sys.stderr,
        flush=True,
    )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_seconds
        while left() and time.monotonic() < deadline:
            time.sleep(0.05)


def _exec_guarded(args: list[str]) -> None:
    parent, program = int(args[0]), args[1:]
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        raise SystemExit(1)
    os.execvp(program[0], program)


if __name__ == "__main__":
    if sys.argv[1:2] == ["reap"]:
        _reap(int(sys.argv[2]), float(sys.argv[3]))
    else:
        _exec_guarded(sys.argv[1:])

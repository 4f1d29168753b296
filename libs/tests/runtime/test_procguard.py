"""`procguard.start_reaper`: once a process group's leader is gone — here SIGKILLed, so no
atexit hook or thread of its runs — what it spawned is stopped: SIGTERM, then SIGKILL after
the grace for a child that ignores SIGTERM; nothing of the group is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from inferplane.runtime import procguard

LEADER = textwrap.dedent(
    """
    import subprocess, sys, time
    from inferplane.runtime import procguard
    procguard.start_reaper(grace_seconds=1.0)
    child = (
        "import signal, time; "
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if sys.argv[1] == "stubborn" else "")
        + "time.sleep(60)"
    )
    subprocess.Popen([sys.executable, "-c", child])
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux")
@pytest.mark.parametrize("child", ["polite", "stubborn"])
def test_the_reaper_stops_the_group_once_its_leader_is_killed(child: str) -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, child],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline() == "ready\n"
        members = procguard.group_members(leader.pid)
        assert len(members) == 3, members  # the leader, its child and the reaper
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        deadline = time.monotonic() + 10
        while procguard.group_members(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procguard.group_members(leader.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()

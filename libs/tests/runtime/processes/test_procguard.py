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
from pathlib import Path

import pytest

from inferplane.runtime.processes import procguard

LEADER = textwrap.dedent(
    """
    import subprocess, sys, time
    from inferplane.runtime.processes import procguard
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


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_spawned_children_are_awaited_on_either_loop_without_fork_handlers(
    loop_name: str, tmp_path: Path
) -> None:
    """`spawn` starts a child without running pthread_atfork handlers (vfork: gRPC, which
    logs "skipping fork() handlers" when its threads are busy at a fork(), prints nothing), in
    its own session, and `Child.wait` returns its status on asyncio and on uvloop; a child
    killed by a signal reports it negated."""
    script = tmp_path / "spawner.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, os, signal, sys
            import grpc
            from grpc_health.v1 import health, health_pb2, health_pb2_grpc
            from inferplane.runtime.processes import procguard
            from inferplane.runtime.service._server import loop_factory

            async def main():
                server = grpc.aio.server()
                health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
                port = server.add_insecure_port("127.0.0.1:0")
                await server.start()
                stub = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(f"127.0.0.1:{{port}}"))

                async def busy():
                    while True:
                        await stub.Check(health_pb2.HealthCheckRequest())

                calls = [asyncio.create_task(busy()) for _ in range(4)]
                await asyncio.sleep(0.3)
                done = procguard.spawn([sys.executable, "-c", "import sys; sys.exit(3)"],
                                       start_new_session=True)
                assert await done.wait() == 3 and done.returncode == 3
                sleeper = procguard.spawn(["sleep", "30"], start_new_session=True)
                assert os.getsid(sleeper.pid) == sleeper.pid and sleeper.returncode is None
                waiting = asyncio.create_task(sleeper.wait())
                await asyncio.sleep(0.2)
                assert not waiting.done()
                os.kill(sleeper.pid, signal.SIGKILL)
                assert await asyncio.wait_for(waiting, 5) == -signal.SIGKILL
                for call in calls:
                    call.cancel()
                await server.stop(0)
                print("spawned ok")

            with asyncio.Runner(loop_factory=loop_factory({loop_name!r})) as runner:
                runner.run(main())
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "spawned ok" in out.stdout
    assert "fork() handlers" not in out.stderr, out.stderr

"""Where the replica's engine runs: in this process (`InprocHost`) or as a child engine server
(`ChildEngineHost`, for `http-completions` and `grpc`). Both answer three questions the
replica process asks: start it (ready when this returns), wait until it dies, shut it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog

from inferplane.replica.engines.base import EngineClient
from inferplane.replica.engines.child_state import ChildEngineState
from inferplane.replica.engines.http_client import HttpEngineClient
from inferplane.replica_contract import Transport
from inferplane.runtime.processes import procguard

log = structlog.get_logger("inferplane.replica")


class EngineHost(Protocol):
    """Starts, watches and stops the replica's engine."""

    async def start(self) -> EngineClient:
        """Starts the engine and returns its client once it answers.

        Raises:
            Exception: the engine could not start (the process exits non-zero).
        """
        ...

    async def wait_dead(self) -> str:
        """Returns (with a reason) once the started engine died; never returns while it
        lives."""
        ...

    def check_soon(self) -> None:
        """A request saw an engine error: look at the engine's health now."""
        ...

    async def shutdown(self) -> None:
        """Stops the engine (idempotent)."""
        ...


class InprocHost:
    """vLLM's AsyncLLM in this process (`engines/inproc.py`).

    Args:
        argv: engine arguments (`inproc.engine_argv(spec, cpu=...)`).
        poll_seconds: how often `AsyncLLM.errored` is read (a SIGKILLed engine core shows
            there within ~0.1 s; reading it costs nothing).
        kv_events: run the engine with its KV events to this process (`InprocEngine.start`).
    """

    def __init__(
        self, argv: Sequence[str], *, poll_seconds: float = 0.2, kv_events: bool = True
    ) -> None:
        self._argv = list(argv)
        self._kv_events = kv_events
        self._poll = poll_seconds
        self._engine: Any = None
        self._wake = asyncio.Event()

    async def start(self) -> EngineClient:
        from inferplane.replica.engines.inproc import InprocEngine

        self._engine = await InprocEngine.start(self._argv, kv_events=self._kv_events)
        return self._engine  # type: ignore[no-any-return]

    async def wait_dead(self) -> str:
        while not self._engine.dead:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll)
            self._wake.clear()
        return "the in-process engine core or a worker died"

    def check_soon(self) -> None:
        self._wake.set()

    async def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.close()


def client_for(transport: str, address: str) -> EngineClient:
    """The existing client of a child engine: HTTP `/v1/completions` or vLLM's gRPC."""
    if transport == Transport.HTTP_COMPLETIONS:
        return HttpEngineClient(f"http://{address}")
    from inferplane.replica.engines.grpc_client import GrpcEngineClient
    from inferplane.replica.pipeline.coalesce import CoalescingEngine

    # vLLM's gRPC stream is read one message per increment: merge what is already buffered.
    return CoalescingEngine(GrpcEngineClient(address))


class ChildEngineHost:
    """An engine server started as this process's child (`-- ENGINE ARGV`).

    The child leads its own process group and learns our pid (`procguard.PARENT_PID_ENV`), so
    our launcher makes it die with us, even by SIGKILL; `shutdown` stops its whole group.

    Args:
        argv: the engine command (today's launcher line).
        client: builds the engine client (`client_for(transport, address)`).
        poll_seconds: health-check interval while waiting for readiness.
        stop_seconds: SIGTERM → SIGKILL delay at shutdown.
        state: the engine's own state for `WatchReplicaState` (`engine_state`): its metrics
            polled, its KV events (their arguments appended to `argv`).
    """

    def __init__(
        self,
        argv: Sequence[str],
        client: Callable[[], EngineClient],
        *,
        poll_seconds: float = 0.5,
        stop_seconds: float = 10.0,
        state: ChildEngineState | None = None,
    ) -> None:
        self._argv = list(argv)
        self.engine_state = state
        self._client_factory = client
        self._poll = poll_seconds
        self._stop_seconds = stop_seconds
        self._proc: procguard.Child | None = None
        self._client: EngineClient | None = None

    async def start(self) -> EngineClient:
        env = {**os.environ, procguard.PARENT_PID_ENV: str(os.getpid())}
        argv = self._argv
        if self.engine_state is not None:
            argv = self.engine_state.engine_argv(argv)
        # From the loop's (long-lived) thread: PDEATHSIG follows the thread that forked.
        self._proc = procguard.spawn(
            argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL
        )
        log.info("engine_child_started", pid=self._proc.pid)
        if self.engine_state is not None:
            self.engine_state.start()
        client = self._client = self._client_factory()
        while not await client.healthy():
            if self._proc.returncode is not None:
                raise RuntimeError(f"the engine exited with {self._proc.returncode} at start-up")
            await asyncio.sleep(self._poll)
        return client

    async def wait_dead(self) -> str:
        assert self._proc is not None
        code = await self._proc.wait()
        return f"the engine process exited with {code}"

    def check_soon(self) -> None:
        return None  # the child's exit is what counts; a failed request alone is not death

    async def shutdown(self) -> None:
        if self.engine_state is not None:
            await self.engine_state.close()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        proc = self._proc
        if proc is None or proc.returncode is not None:
            if proc is not None:
                procguard.kill_group(proc.pid)
            return
        procguard.kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self._stop_seconds)
        except TimeoutError:
            log.warning("engine_child_stop_timeout", pid=proc.pid)
        procguard.kill_group(proc.pid, signal.SIGKILL)

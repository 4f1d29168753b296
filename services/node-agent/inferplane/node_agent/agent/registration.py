"""Registration with the orchestrator: `NodeService.RegisterNode`, then `StreamHeartbeats`
carrying the node's status; reconnects with exponential backoff, never crashes the agent.

An orchestrator that does not implement these yet answers UNIMPLEMENTED: that is logged once
and retried at the maximum backoff.

Several orchestrators on one database (one leads; a standby answers UNAVAILABLE, reason
NOT_LEADER: `inferplane.orchestrator.leadership`) are given comma-separated. After a failed
session the next attempt goes to the next one at once (`SWITCH_SECONDS` later), and the
exponential backoff applies only once every one of them failed in a row, so a node-agent
finds a new leader within one pass over the list rather than after a long backoff that could
outlast the orchestrator's heartbeat timeout.

`stop()` ends registration without cancelling an RPC in flight: the heartbeat stream ends by
the node-agent's half-close, which the orchestrator answers by ending the RPC, and a
`RegisterNode` already sent gets its answer. A cancelled grpc.aio call completes in gRPC core
later, after the task that made it has gone; if the event loop closes meanwhile, gRPC's
poller hands that completion to whichever event loop uses gRPC next (`RuntimeError: Event
loop is closed` there).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import structlog
from tenacity import wait_exponential

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from inferplane.runtime.time.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.node_agent.registration")

#: Wait before trying the next orchestrator of several after one failed.
SWITCH_SECONDS = 0.2


class Registrar:
    """Keeps this node registered and heartbeating while `run()` runs."""

    def __init__(
        self,
        address: str,
        node_status: Callable[[], nodeagent_pb2.NodeStatus],
        *,
        heartbeat_interval_seconds: float = 10.0,
        retry_max_seconds: float = 60.0,
        clock: Clock | None = None,
        channel_factory: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
    ) -> None:
        self._addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self._index = 0
        self._status = node_status
        self._interval = heartbeat_interval_seconds
        self._retry_max = retry_max_seconds
        self._clock = clock or SystemClock()
        self._channel_factory = channel_factory
        self._wait = wait_exponential(multiplier=1.0, max=retry_max_seconds)
        self._warned_unimplemented = False
        self.registered = False
        self.heartbeats_sent = 0
        self.attempts = 0
        self._stopping = asyncio.Event()

    @property
    def address(self) -> str:
        """The orchestrator this node registers with now (host:port)."""
        return self._addresses[self._index]

    def stop(self) -> None:
        """Makes `run()` return once its RPC in flight, if any, has ended (a heartbeat stream
        is half-closed at once); await the task that runs it, with a bound of your own."""
        self._stopping.set()

    async def run(self) -> None:
        """Registers and heartbeats until `stop()` (or until cancelled)."""
        failures = 0
        failed_here = 0  # sessions failed in a row since the last full pass over the list
        while not self._stopping.is_set():
            self.attempts += 1
            try:
                await self._session()
                failures = failed_here = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping.is_set():
                    return
                if self.registered:  # it was serving: a fresh failure, not one more in a row
                    failures = failed_here = 0
                self.registered = False
                failed, failed_here = self.address, failed_here + 1
                if len(self._addresses) > 1:
                    self._index = (self._index + 1) % len(self._addresses)
                    if failed_here < len(self._addresses):
                        log.warning(
                            "orchestrator_switch",
                            failed=failed,
                            next=self.address,
                            error=_describe(exc),
                        )
                        await self._pause(SWITCH_SECONDS)
                        continue
                failed_here, failures = 0, failures + 1
                await self._backoff(exc, failures, failed)

    async def _backoff(self, exc: Exception, failures: int, address: str) -> None:
        """Logs a failed session (at `address`) and waits before the next one."""
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                if not self._warned_unimplemented:
                    log.warning(
                        "orchestrator_registration_unimplemented",
                        address=address,
                        method=exc.details(),
                    )
                    self._warned_unimplemented = True
                delay = self._retry_max
            else:
                delay = self._delay(failures)
                log.warning(
                    "orchestrator_unreachable",
                    address=address,
                    code=exc.code().name,
                    retry_in_seconds=delay,
                )
        else:  # never crash the agent over reporting
            delay = self._delay(failures)
            log.error(
                "registration_error",
                address=address,
                error=_describe(exc),
                retry_in_seconds=delay,
                exc_info=exc,
            )
        await self._pause(delay)

    async def _pause(self, seconds: float) -> None:
        """Sleeps `seconds` on the clock, or until `stop()`."""
        sleep = asyncio.ensure_future(self._clock.sleep(seconds))
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({sleep, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            stopped.cancel()

    def _delay(self, failures: int) -> float:
        from tenacity import RetryCallState

        state = RetryCallState(None, None, (), {})
        state.attempt_number = failures
        return float(self._wait(state))

    async def _session(self) -> None:
        address = self.address
        channel = self._channel_factory(address)
        try:
            stub = orchestrator_pb2_grpc.NodeServiceStub(channel)
            response = await stub.RegisterNode(
                orchestrator_pb2.RegisterNodeRequest(status=self._status()), timeout=10
            )
            self.registered = True
            interval = float(response.heartbeat_interval_seconds or self._interval)
            log.info("node_registered", address=address, heartbeat_seconds=interval)
            if self._stopping.is_set():
                return

            async def beats() -> AsyncIterator[orchestrator_pb2.StreamHeartbeatsRequest]:
                # Ends at stop(): gRPC then half-closes the stream, and the orchestrator ends it.
                while not self._stopping.is_set():
                    self.heartbeats_sent += 1
                    yield orchestrator_pb2.StreamHeartbeatsRequest(status=self._status())
                    await self._pause(interval)

            call = stub.StreamHeartbeats(beats())
            async for answer in call:
                log.debug("heartbeat_ack", condition=answer.condition)
        finally:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)


def _describe(exc: BaseException) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)

"""Registration with the orchestrator: `NodeService.RegisterNode`, then `StreamHeartbeats`
carrying the node's status; reconnects with exponential backoff, never crashes the agent.

An orchestrator that does not implement these yet answers UNIMPLEMENTED: that is logged once
and retried at the maximum backoff.
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
from inferplane.runtime.clock import Clock, SystemClock

log = structlog.get_logger("inferplane.node_agent.registration")


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
        self._address = address
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

    async def run(self) -> None:
        """Registers and heartbeats until cancelled."""
        failures = 0
        while True:
            self.attempts += 1
            try:
                await self._session()
                failures = 0
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                failures += 1
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    if not self._warned_unimplemented:
                        log.warning(
                            "orchestrator_registration_unimplemented",
                            address=self._address,
                            method=exc.details(),
                        )
                        self._warned_unimplemented = True
                    delay = self._retry_max
                else:
                    delay = self._delay(failures)
                    log.warning(
                        "orchestrator_unreachable",
                        address=self._address,
                        code=exc.code().name,
                        retry_in_seconds=delay,
                    )
                self.registered = False
                await self._clock.sleep(delay)
            except Exception as exc:  # never crash the agent over reporting
                failures += 1
                delay = self._delay(failures)
                log.exception("registration_error", error=str(exc), retry_in_seconds=delay)
                self.registered = False
                await self._clock.sleep(delay)

    def _delay(self, failures: int) -> float:
        from tenacity import RetryCallState

        state = RetryCallState(None, None, (), {})
        state.attempt_number = failures
        return float(self._wait(state))

    async def _session(self) -> None:
        channel = self._channel_factory(self._address)
        try:
            stub = orchestrator_pb2_grpc.NodeServiceStub(channel)
            response = await stub.RegisterNode(
                orchestrator_pb2.RegisterNodeRequest(status=self._status()), timeout=10
            )
            self.registered = True
            interval = float(response.heartbeat_interval_seconds or self._interval)
            log.info("node_registered", address=self._address, heartbeat_seconds=interval)

            async def beats() -> AsyncIterator[orchestrator_pb2.StreamHeartbeatsRequest]:
                while True:
                    self.heartbeats_sent += 1
                    yield orchestrator_pb2.StreamHeartbeatsRequest(status=self._status())
                    await self._clock.sleep(interval)

            call = stub.StreamHeartbeats(beats())
            async for answer in call:
                log.debug("heartbeat_ack", condition=answer.condition)
        finally:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

"""The release gate: a new replica's error rate and TTFT p99 over a window, against the
deployment's rollout bounds (`max_error_rate`, `max_ttft_p99_seconds`, `gate_window_seconds`).

`Gate` is the port; `ProbeGate` measures with probe requests pinned to the replica through the
node-agent (works with nothing else running). `TelemetryLatency` is the platform's one reader of
a deployment's TTFT p99 and error counts from telemetry (`QueryLatency` over a window, what the
routers' request records show): the autoscaler's TTFT signal (issue 29) reads it, and the
release's canary (release/canary.py) reads it per revision, the canary's against the stable
one's (issue 30).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from inferplane.api.telemetry.v1 import telemetry_pb2, telemetry_pb2_grpc
from inferplane.orchestrator.catalog.model import RolloutStrategy
from inferplane.orchestrator.release.agents import NodeAgents
from inferplane.runtime.security.identity import TELEMETRY, PeerSecurity


@dataclasses.dataclass(frozen=True, slots=True)
class GateTarget:
    """The replica under test: its node-agent address, node-agent replica id and model name;
    `embed`: the deployment serves embeddings (probed with one); `speech`: it serves
    speech-to-text (probed with a transcription)."""

    deployment_id: str
    replica_id: str
    address: str
    model: str
    embed: bool = False
    speech: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class GateReading:
    """What a window showed: request and error counts, TTFT p99 in seconds (0 = no data),
    and tool-call validity (valid / emitted tool calls, 1.0 when none: telemetry's
    `tool_call_validity`; probes make no tool calls)."""

    requests: int
    errors: int
    ttft_p99_seconds: float
    detail: str = ""
    tool_call_validity: float = 1.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class Gate(Protocol):
    """Measures a replica over `window_seconds` (returns when the window has passed)."""

    async def measure(self, target: GateTarget, window_seconds: float) -> GateReading: ...


def gate_enabled(strategy: RolloutStrategy) -> bool:
    """A gate is set when either bound is (0 = no gate)."""
    return bool(strategy.max_error_rate > 0 or strategy.max_ttft_p99_seconds > 0)


def gate_verdict(strategy: RolloutStrategy, reading: GateReading) -> str:
    """ "" when the reading is within the strategy's bounds, else a sentence with the numbers."""
    if reading.requests == 0:
        return "no request completed in the gate window" + (
            f" ({reading.detail})" if reading.detail else ""
        )
    problems = []
    if strategy.max_error_rate > 0 and reading.error_rate > strategy.max_error_rate:
        problems.append(
            f"error rate {reading.error_rate:.3f} ({reading.errors}/{reading.requests}) > "
            f"{strategy.max_error_rate:g}"
        )
    if (
        strategy.max_ttft_p99_seconds > 0
        and reading.ttft_p99_seconds > strategy.max_ttft_p99_seconds
    ):
        problems.append(
            f"TTFT p99 {reading.ttft_p99_seconds:.3f} s > {strategy.max_ttft_p99_seconds:g} s"
        )
    text = "; ".join(problems)
    return f"{text} ({reading.detail})" if text and reading.detail else text


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class ProbeGate:
    """Sends one probe every `interval_seconds` for the window (at least `min_probes`) and
    reports their errors and TTFT p99. `sleep` is injectable for tests."""

    def __init__(
        self,
        agents: NodeAgents,
        *,
        interval_seconds: float = 1.0,
        min_probes: int = 3,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._agents = agents
        self._interval = interval_seconds
        self._min = min_probes
        self._sleep = sleep

    async def measure(self, target: GateTarget, window_seconds: float) -> GateReading:
        count = max(self._min, math.ceil(window_seconds / self._interval))
        ttfts: list[float] = []
        errors = 0
        last_error = ""
        for i in range(count):
            result = await self._agents.probe(
                target.address,
                target.replica_id,
                target.model,
                embed=target.embed,
                speech=target.speech,
            )
            if result.ok:
                ttfts.append(result.ttft_seconds)
            else:
                errors += 1
                last_error = result.error
            if i + 1 < count:
                await self._sleep(self._interval)
        return GateReading(
            count, errors, p99(ttfts), f"last error: {last_error}" if last_error else ""
        )


class LatencyReader(Protocol):
    """A deployment's requests, errors, TTFT p99 and tool-call validity over the last
    `window_seconds` (None when unknown: the source cannot be read); `revision`: only the
    requests that profile revision served ("": all; the canary's comparison, issue 30)."""

    async def read(
        self, deployment_id: str, window_seconds: float, *, revision: str = ""
    ) -> GateReading | None: ...


class TelemetryLatency:
    """`LatencyReader` over telemetry's `QueryLatency` (`address`, `host:port`), percentile 99
    of TTFT; a failed call is None (and logged by the caller), never an exception.
    `security`: the orchestrator's identity toward telemetry."""

    def __init__(
        self,
        address: str,
        *,
        security: PeerSecurity | None = None,
        timeout_seconds: float = 2.0,
    ) -> None:
        self._address = address
        self._security = security or PeerSecurity.plaintext()
        self._timeout = timeout_seconds
        self._channel: grpc.aio.Channel | None = None

    async def read(
        self, deployment_id: str, window_seconds: float, *, revision: str = ""
    ) -> GateReading | None:
        if self._channel is None:
            self._channel = self._security.aio_channel(
                self._address, self._security.server_options(TELEMETRY)
            )
        stub = telemetry_pb2_grpc.TelemetryServiceStub(self._channel)
        try:
            response = await stub.QueryLatency(
                telemetry_pb2.QueryLatencyRequest(
                    deployment=deployment_id,
                    window_seconds=max(1, round(window_seconds)),
                    percentiles=[99],
                    revision=revision,
                ),
                timeout=self._timeout,
            )
        except grpc.RpcError:
            return None
        ttft = next(
            (p.value for p in response.time_to_first_token_seconds if p.percentile == 99), 0.0
        )
        return GateReading(
            response.request_count,
            response.error_count,
            ttft,
            tool_call_validity=response.tool_call_validity,
        )

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(grace=None)

"""`RunConformance` (issue 30 §2): the replica checks itself before its revision takes traffic.

Two parts, bounded together by the request's `timeout_seconds` (0: 120):
1. replay: the public cases of the replica's parser family (`inferplane.conformance`) through
   the replica's own parser and renderer (its model's chat template), in a worker thread;
2. live: `live_requests` seeded requests with random tool schemas under `tool_choice` auto,
   required and named in turn, through this process's own InferenceService handler
   (`CreateChatCompletion`, in process: admission → render → engine → parse, as a client's
   request runs), scored as the K2 Vendor Verifier counts (`inferplane.conformance.LiveTally`).
   What has not finished when the bound is reached is cancelled and counted as a live error.

Who may call it is the process's peer policy (`app.py`): the orchestrator's release and
operators, never a tenant's path (the edge).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.nodeagent.v1 import replica_pb2
from inferplane.chat import render_chat
from inferplane.conformance import (
    DEFAULT_TIMEOUT_SECONDS,
    LiveRequest,
    LiveTally,
    family_markers,
    live_requests,
    public_cases,
    replay,
)
from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache, parser_name
from inferplane.replica.state import ReplicaState
from inferplane.replica_contract import Task, replica_task
from inferplane.runtime import FailedPreconditionError, InvalidArgumentError
from inferplane.wire import chat_completion_to_dict, chat_request_from_dict

log = structlog.get_logger("inferplane.replica.conformance")

MAX_LIVE_REQUESTS = 1000
"""Most live requests one run may ask for (`live_requests`)."""
LIVE_CONCURRENCY = 8
"""Live requests in flight at once (the fixture profiles' `max_num_seqs` is 16)."""

Chat = Callable[[pb.CreateChatCompletionRequest, Any], Awaitable[pb.CreateChatCompletionResponse]]
"""The InferenceService handler live requests go through (`InferenceServicer.
CreateChatCompletion`)."""
Artifacts = Callable[[], replica_pb2.ReplicaArtifacts | None]
"""What the replica runs (`ConformanceReport.artifacts`); None while not known."""


class _InProcessCall:
    """The servicer context of a request this process sends itself: no metadata in (no picker,
    no adapter, no trace), the response metadata kept (the summary trailers, for the logs)."""

    def __init__(self) -> None:
        self.initial: tuple[tuple[str, str], ...] = ()
        self.trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.initial = tuple(metadata)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)


def run_bounds(request: replica_pb2.RunConformanceRequest) -> float:
    """The run's bound in seconds (`timeout_seconds`, 0: `DEFAULT_TIMEOUT_SECONDS`).

    Raises:
        InvalidArgumentError: `live_requests` above `MAX_LIVE_REQUESTS`, or `timeout_seconds`
            negative or not finite (the field named).
    """
    if request.live_requests > MAX_LIVE_REQUESTS:
        raise InvalidArgumentError(
            f"live_requests must be at most {MAX_LIVE_REQUESTS}, got {request.live_requests}",
            param="live_requests",
        )
    timeout = request.timeout_seconds
    if not math.isfinite(timeout) or timeout < 0:
        raise InvalidArgumentError(
            f"timeout_seconds must be a finite number >= 0, got {timeout}",
            param="timeout_seconds",
        )
    return timeout or DEFAULT_TIMEOUT_SECONDS


class ConformanceRunner:
    """Runs the conformance checks on this process's replica.

    Args:
        state: the replica (its spec names the parser; it must be ready).
        assets: the model assets the InferenceService uses (the same parser and tokenizer).
        chat: the InferenceService handler live requests go through.
        artifacts: what the replica runs, for `report.artifacts` (None: left unset).
        clock: monotonic seconds (tests).
    """

    def __init__(
        self,
        state: ReplicaState,
        assets: ModelAssetsCache,
        chat: Chat,
        artifacts: Artifacts | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = state
        self._assets = assets
        self._chat = chat
        self._artifacts = artifacts
        self._clock = clock

    async def run(
        self, request: replica_pb2.RunConformanceRequest
    ) -> replica_pb2.ConformanceReport:
        """Replays the cases, sends the live requests, returns the report (`seconds`: the
        run's wall time).

        Raises:
            InvalidArgumentError: see `run_bounds`.
            FailedPreconditionError: the replica's engine is not ready (code
                `replica_not_ready`), or it does not serve chat (`task` other than generate,
                code `conformance_unsupported`).
        """
        bound = run_bounds(request)
        started = self._clock()
        deadline = started + bound
        spec = self._state.spec
        if not self._state.engine_ready:
            raise FailedPreconditionError(
                "the replica's engine is not ready: RunConformance runs on a serving replica",
                code="replica_not_ready",
            )
        if replica_task(spec) != Task.GENERATE:
            raise FailedPreconditionError(
                f"conformance checks chat replicas; this one serves '{replica_task(spec)}'",
                code="conformance_unsupported",
            )
        report = replica_pb2.ConformanceReport()
        if self._artifacts is not None:
            artifacts = self._artifacts()
            if artifacts is not None:
                report.artifacts.CopyFrom(artifacts)
        assets = await self._assets.get(spec)
        family = parser_name(spec) or ""
        remaining = max(0.0, deadline - self._clock())
        try:
            result = await asyncio.wait_for(
                asyncio.to_thread(_replay, family, assets), timeout=remaining
            )
        except TimeoutError:
            report.replay_failures.append(f"replay did not finish within {bound:g} s")
        else:
            report.replay_cases = result.cases
            report.replay_passed = result.passed
            report.replay_failures.extend(result.failures)
        markers, reasoning = (
            family_markers(assets.parser.config.terminals) if assets.parser else ([], [])
        )
        tally = LiveTally(markers=markers, reasoning_markers=reasoning)
        thinking_kwarg = assets.chat_family.thinking_kwarg
        drawn = live_requests(request.live_requests, request.seed, thinking_kwarg)
        await self._live(drawn, tally, deadline, spec)
        tally.fill(report)
        report.seconds = self._clock() - started
        log.info(
            "conformance_run",
            replica=self._state.replica_id,
            replay=f"{report.replay_passed}/{report.replay_cases}",
            live=report.live_requests,
            live_errors=report.live_errors,
            calls=f"{report.tool_calls_returned}/{report.tool_calls_expected}",
            schema_valid=f"{report.tool_calls_schema_valid}/{report.tool_calls}",
            leaked_markers=report.leaked_markers,
            seconds=round(report.seconds, 2),
            problems=tally.problems[:10],
        )
        return report

    async def _live(
        self, requests: list[LiveRequest], tally: LiveTally, deadline: float, spec: Any
    ) -> None:
        """Sends `requests` (at most `LIVE_CONCURRENCY` at once) until `deadline`; each is
        scored into `tally`, an error or one still running at the deadline as a live error."""
        if not requests:
            return
        gate = asyncio.Semaphore(LIVE_CONCURRENCY)
        model = spec.served_model_name

        async def one(live: LiveRequest) -> None:
            async with gate:
                body = {**live.body, "model": model}
                message = pb.CreateChatCompletionRequest(request=chat_request_from_dict(body))
                try:
                    response = await self._chat(message, _InProcessCall())
                except Exception as exc:  # the handler's error is the finding
                    tally.error(live, f"{type(exc).__name__}: {exc}")
                    return
                tally.add(live, chat_completion_to_dict(response))

        tasks = {asyncio.ensure_future(one(r)): r for r in requests}
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - self._clock()))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for task in pending:
            tally.error(tasks[task], "not finished within the run's bound")


def _replay(family: str, assets: ModelAssets) -> Any:
    """The family's public cases through `assets`' parser and chat template (blocking)."""
    tokenizer, chat_family = assets.tokenizer, assets.chat_family

    def render(request: Any) -> str:
        return render_chat(request, tokenizer, family=chat_family).text

    return replay(public_cases(family) if family else [], assets.parser, render)

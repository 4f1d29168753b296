"""One request's facts and the one classification of how it ended.

`RequestFacts` collects what the server learns while it serves one request (the replica, its
generation or its embeddings/speech counts, tool-call verdicts, GPU-seconds, messages written,
the failure if any). `RequestFacts.ending()` classifies the request's end once (`Ending`), and
every view of the request is derived from that one classification:

- the summary trailers (`summary()`, `inferplane.wire.ResponseSummary`), which the endpoint
  picker reads from Envoy;
- the report to the picker (`reported(key_id)`: the same summary plus the key, the model and
  the API, the usage the router hands to auth's ledger);
- the telemetry outcome (`outcome(...)`, a `RequestOutcome`, whose `to_record` is the
  `RequestRecord`).

How a request ends (`End`), and what every view says of it:

- COMPLETED: the body returned. finish_reason: the generation's ("stop", "length",
  "tool_calls"); "stop" for embeddings and speech. error_code: "".
- FAILED_BEFORE_OUTPUT: an error before the engine's first output (the router may retry it
  elsewhere). finish_reason "", error_code: the error's.
- FAILED_AFTER_OUTPUT: an error after it (an SSE error event, or an error status mid-stream).
  finish_reason "error", error_code: the error's.
- CANCELLED: the client went away or its deadline passed (`CancelledError`, `GeneratorExit`).
  finish_reason "abort", error_code "".

An engine that aborted the request (the replica shutting down, `TrackedEngine.abort_all`) is a
failure: the generation raises it as an error (code engine_failed). Anything else raised (a bug)
is a failure with code internal_error, as the runtime's ErrorInterceptor answers it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from inferplane.parsers import ToolCallVerdict
from inferplane.replica.engines.base import Admitted, EngineClient, LocalReplica
from inferplane.replica.engines.lora import Adapter
from inferplane.replica.pipeline.generate import Generation
from inferplane.replica.server.outcome import End, Ending, RequestOutcome
from inferplane.runtime import InferplaneError
from inferplane.wire import ResponseSummary


class RequestFacts:
    """What the server learns about one request while serving it.

    Args:
        api: the API's name (`inferplane.wire.apis`).
        stream: True for the streaming methods (and `stream=true` speech).
        model: the model the client asked for (replaced by the replica's served name).
        started: the request's arrival, on the server clock's `monotonic()` (seconds).

    The bodies fill it in: `gen` for a generation (choice 0), `choices` with every choice's
    generation when the request asked for several (`n` > 1: generated tokens are their sum);
    for embeddings and speech, which have no
    `Generation`, `request_id`, `prompt_tokens`, `completion_tokens` and `ttft_seconds` (the
    time to the engine's first result) directly. The template sets `replica`, `adapter` (the
    LoRA adapter the request's headers name, `engines/lora.py`), `admitted`, `messages` and,
    on a failure, `fail`.
    """

    __slots__ = (
        "_code",
        "_status",
        "adapter",
        "admitted",
        "api",
        "choices",
        "completion_tokens",
        "framing",
        "gen",
        "messages",
        "migrate",
        "model",
        "prompt_tokens",
        "replica",
        "request_id",
        "started",
        "stream",
        "ttft_seconds",
        "verdicts",
    )

    def __init__(self, api: str, stream: bool, model: str, started: float) -> None:
        self.api = api
        self.stream = stream
        self.framing = "typed" if stream else "unary"
        self.model = model
        self.started = started
        self.replica = ""
        self.messages = 0
        self.gen: Generation | None = None
        self.choices: tuple[Generation, ...] = ()
        self.request_id = ""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_seconds: float | None = None
        self.verdicts: tuple[ToolCallVerdict, ...] = ()
        self.admitted: Admitted | None = None  # its GPU-seconds once it left the replica
        self.adapter: Adapter | None = None  # the LoRA adapter the request names (headers)
        # Wraps the replica's engine for mid-stream migration when the pick named siblings
        # (`engines/migration.py`); None: the engine as it is.
        self.migrate: Callable[[EngineClient], EngineClient] | None = None
        self._status = "ok"
        self._code = ""

    def engine_of(self, replica: LocalReplica) -> EngineClient:
        """The engine the request's generations run on: the replica's, wrapped for mid-stream
        migration when its pick named siblings (`migrate`)."""
        return replica.engine if self.migrate is None else self.migrate(replica.engine)

    def fail(self, exc: BaseException) -> None:
        """Records the request's failure: an `InferplaneError` (its code), a cancellation
        (client gone, deadline) or anything else (code internal_error)."""
        if isinstance(exc, InferplaneError):
            self._status, self._code = "error", exc.code
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self._status, self._code = "cancelled", ""
        else:
            self._status, self._code = "error", "internal_error"

    @property
    def output_started(self) -> bool:
        """True once the engine produced output for it (a generation's first increment, an
        embedding's or a transcription's first result)."""
        gen = self.gen
        if gen is not None:
            return gen.started_output
        return self.ttft_seconds is not None

    def ending(self) -> Ending:
        """The one classification of how the request ended (the module's table)."""
        if self._status == "cancelled":
            return Ending(End.CANCELLED, "abort")
        if self._status == "error":
            if self.output_started:
                return Ending(End.FAILED_AFTER_OUTPUT, "error", self._code)
            return Ending(End.FAILED_BEFORE_OUTPUT, "", self._code)
        gen = self.gen
        if gen is not None:
            return Ending(End.COMPLETED, gen.finish_reason or "")
        return Ending(End.COMPLETED, "stop" if self.request_id else "")

    # -- token counts, whichever kind of request ----------------------------------------------

    def _tokens(self) -> tuple[int, int, int, int]:
        """(prompt, completion, cached, reasoning) tokens."""
        gen = self.gen
        if gen is None:
            return self.prompt_tokens, self.completion_tokens, 0, 0
        if self.choices:  # n > 1: the prompt once, every choice's output
            return (
                gen.prompt_tokens,
                sum(g.completion_tokens for g in self.choices),
                gen.cached_tokens,
                sum(g.session.reasoning_tokens for g in self.choices),
            )
        return (
            gen.prompt_tokens,
            gen.completion_tokens,
            gen.cached_tokens,
            gen.session.reasoning_tokens,
        )

    def _ttft(self) -> float | None:
        gen = self.gen
        return gen.ttft_seconds if gen is not None else self.ttft_seconds

    # -- the views -----------------------------------------------------------------------------

    def summary(self, ending: Ending | None = None) -> ResponseSummary:
        """The summary trailers: the replica, token counts, `ending`'s finish reason and
        error code (default: `ending()`), TTFT (seconds, 0 when there was no output) and the
        request's GPU-seconds (0 before admission)."""
        ending = ending or self.ending()
        prompt, completion, cached, reasoning = self._tokens()
        return ResponseSummary(
            replica_id=self.replica,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            reasoning_tokens=reasoning,
            finish_reason=ending.finish_reason,
            ttft_seconds=self._ttft() or 0.0,
            gpu_seconds=self.admitted.gpu_seconds if self.admitted is not None else 0.0,
            error_code=ending.error_code,
        )

    def reported(
        self, summary: ResponseSummary, key_id: str, *, duration_seconds: float
    ) -> ResponseSummary:
        """The picker report's summary: the trailers' `summary` plus the calling key's id, the
        model and the API (a restarted router accounts with them a request it never saw) and
        `duration_seconds` (arrival → end at this replica)."""
        return dataclasses.replace(
            summary,
            key_id=key_id,
            model=self.model,
            api=self.api,
            duration_seconds=duration_seconds,
        )

    def outcome(
        self, ending: Ending, *, e2e_seconds: float, request_header_id: str
    ) -> RequestOutcome:
        """The telemetry outcome, with `ending` (the classification the trailers carried),
        `e2e_seconds` (arrival → end) and the caller's `x-request-id` ("" when absent)."""
        prompt, completion, cached, reasoning = self._tokens()
        gen = self.gen
        session = gen.session if gen is not None else None
        return RequestOutcome(
            request_id=gen.request_id if gen is not None else self.request_id,
            model=self.model,
            replica_id=self.replica,
            api=self.api,
            stream=self.stream,
            ending=ending,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            reasoning_tokens=reasoning,
            ttft_seconds=self._ttft(),
            itl_seconds=tuple(gen.itl_seconds) if gen is not None else (),
            e2e_seconds=e2e_seconds,
            tool_call_verdicts=self.verdicts,
            marker_leaked=session.result().marker_leaked if session is not None else False,
            dropped_tool_calls=session.dropped_tool_calls if session is not None else 0,
            request_header_id=request_header_id,
        )

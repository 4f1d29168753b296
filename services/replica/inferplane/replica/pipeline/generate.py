"""One generation as a line of stages, each token passing each stage once:

    engine output → incremental detokenizer (`IncrementalDetokenizer`: text deltas, stop
    strings cut) → parser session → stream interval → `Step`

(the server turns steps into chunks, then SSE bytes). An engine failure leaves here as the
platform's error (`engine_error`): the server and the runtime's ErrorInterceptor answer it as
it is, with no frame of their own around each token. The parser session owns the assembled
response (`Generation.session`: `result()`, `reasoning_tokens`, `dropped_tool_calls`); nothing
here keeps a second copy. Costs are O(1) amortised per token (DecodeStream, a parser that never
rescans, appends only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Sequence

from inferplane.parsers import Delta, PlainSession, Session, ToolCallDelta
from inferplane.replica.engines.base import (
    EngineClient,
    EngineError,
    EngineOutput,
    SamplingParams,
    TokenLogprob,
    TracksRequests,
)
from inferplane.replica.pipeline.detokenize import IncrementalDetokenizer, Piece
from inferplane.replica.tracing import CURRENT as CURRENT_TRACE
from inferplane.runtime import InferplaneError, InvalidArgumentError, UnavailableError
from inferplane.runtime.time.clock import Clock

OutputSession = Session | PlainSession
"""A parser session (`Parser.start`), or `PlainSession` when output has no format."""


@dataclasses.dataclass(slots=True)
class Step:
    """What one engine increment made visible.

    Attributes:
        reasoning: new reasoning text.
        content: new content text.
        tool_calls: tool-call fragments (at most one per call index, in index order; a call's
            first fragment carries its id and name).
        finish_reason: set on the last step only: "stop", "length" or "tool_calls".
        logprobs: with `SamplingParams.logprobs`, the log probabilities of the tokens this
            step shows (a token whose text is not shown yet, e.g. held while it could begin a
            stop string, goes with the step that shows it; a hidden end-of-sequence token has
            none); None without.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def empty(self) -> bool:
        """True when the step shows nothing and finishes nothing."""
        return not (self.reasoning or self.content or self.tool_calls or self.finish_reason)


class Generation:
    """Runs one request on an engine and yields visible `Step`s (see `steps`).

    Args:
        engine: the replica's engine connection.
        request_id: the engine request id (also the completion id).
        prompt_ids: the prompt's token ids.
        params: sampling parameters (its `stop` strings are also matched here, so output is
            cut correctly whatever the engine does with them).
        backend: the fast tokenizer for incremental decoding.
        stop_token_ids: ids whose final occurrence ends output without being shown (eos and
            `params.stop_token_ids`).
        session: the response's parser session, started by the caller (thinking, history
            tool calls, `tool_calls=False` for `tool_choice: "none"`), or a `PlainSession`.
        clock: time source; `started` is the request's arrival on its `monotonic()`.

    After `steps` is exhausted, the attributes hold the request's facts (token counts,
    `finish_reason`, `ttft_seconds`, `itl_seconds`) and `session` the response itself; for the
    request's trace (`inferplane.replica.tracing`), `submitted` and `last_output` (the engine
    call and its last output, on the clock's `monotonic()`) and, when its trace is sampled,
    `parse_seconds` (the time spent detokenizing and parsing, all steps together).
    """

    def __init__(
        self,
        *,
        engine: EngineClient,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        backend: object,
        stop_token_ids: frozenset[int],
        session: OutputSession,
        clock: Clock,
        started: float,
    ) -> None:
        self.request_id = request_id
        self.session = session
        self._engine = engine
        # The replica's engine keeps requests in flight (told once per request, not per token).
        self._tracking = engine if isinstance(engine, TracksRequests) else None
        self._prompt_ids = prompt_ids
        self._params = params
        self._stop_ids = stop_token_ids | frozenset(params.stop_token_ids)
        self._detokenizer = IncrementalDetokenizer(
            backend,
            prompt_ids,
            params.stop,
            params.min_tokens or 0,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        self._held_logprob: TokenLogprob | None = None
        self._logprobs: Sequence[TokenLogprob] | None = None  # of the ids `_observe` passed
        self._logprobs_carry: list[TokenLogprob] = []
        self._clock = clock
        self._started = started
        self._last: float | None = None
        self._held_stop: int | None = None
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.ttft_seconds: float | None = None
        self.itl_seconds: list[float] = []
        self.started_output = False
        self.submitted: float | None = None
        self.parse_seconds = 0.0
        trace = CURRENT_TRACE.get()
        self._timed = trace is not None and trace.recording

    @property
    def last_output(self) -> float | None:
        """When the engine's last output came (monotonic seconds), None before the first."""
        return self._last

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, or None (Anthropic's `stop_sequence`)."""
        return self._detokenizer.stopped

    async def steps(self) -> AsyncGenerator[Step, None]:
        """Streams the visible steps: the first engine output always yields a step (maybe
        empty: the caller's cue for a role chunk), later outputs only when they show something,
        and the last step carries `finish_reason`. With `params.stream_interval` N > 1, later
        outputs are merged until N tokens have arrived since the last step (`StreamInterval`).

        Raises:
            InvalidArgumentError: the engine refused the request (its own validation; code
                invalid_request or invalid_value, `engine_error`).
            UnavailableError: the engine failed, aborted the request, or ended its stream
                without finishing (code engine_failed; before any output the router may retry
                it elsewhere, after output it ends the stream instead of truncating it).

        Whenever the iteration ends before the engine finished (client cancel, deadline, a
        matched stop string, an error), the engine request is aborted.
        """
        engine = self._engine
        self.submitted = self._clock.monotonic()
        stream = engine.generate(self.request_id, self._prompt_ids, self._params)
        timed = self._timed
        interval = StreamInterval(self._params.stream_interval or 1)
        detokenizer = self._detokenizer
        finished = False
        failed = False
        try:
            async for out in stream:
                ids, hide_last = self._observe(out)
                if timed:
                    parsing = time.perf_counter()
                    step = self._parse(detokenizer.push(ids, hide_last=hide_last))
                    self.parse_seconds += time.perf_counter() - parsing
                else:
                    step = self._parse(detokenizer.push(ids, hide_last=hide_last))
                if self._logprobs is not None:
                    self._attach_logprobs(step, out.finished, hide_last)
                # Progress so far (a cancelled or failed request still reports what it cost).
                self.completion_tokens = out.completion_tokens or detokenizer.tokens
                if detokenizer.stopped is not None or out.finished:
                    self._finish(step, out)
                    finished = True
                    yield interval.last(step)
                    return
                ready = interval.push(step, len(out.token_ids))
                if ready is not None:
                    yield ready
            raise EngineError(
                "the engine stream ended before the request finished",
                retryable=not self.started_output,
            )
        except EngineError as exc:
            failed = True
            held = interval.held()
            if held is not None:
                yield held  # what was generated before the failure still reaches the client
            raise engine_error(exc) from exc
        finally:
            try:
                if not finished or detokenizer.stopped is not None:
                    # The EngineClient contract aborts when its iterator is closed; the
                    # explicit abort also covers a stop string matched here while the engine
                    # runs on.
                    await _close(stream)
                    # shielded: a second cancellation must not skip the abort.
                    await asyncio.shield(engine.abort(self.request_id))
                else:
                    await _close(stream)
            finally:
                if self._tracking is not None:
                    self._tracking.release(self.request_id, failed=failed)

    # -- the stages ----------------------------------------------------------------------------

    def _observe(self, out: EngineOutput) -> tuple[Sequence[int], bool]:
        """Engine output → the ids to decode and whether the last one is hidden; records
        latencies and the engine's counts.

        Raises:
            EngineError: the engine ended the request other than by "stop" or "length", or
                the replica aborted it at shutdown (`TracksRequests.was_shut`: whatever the
                finish says, the response is cut short).
        """
        if out.finished and self._tracking is not None and self._tracking.was_shut(self.request_id):
            raise EngineError("the replica shut down before the request finished")
        now = self._clock.monotonic()
        if self._last is None:
            self.ttft_seconds = now - self._started
        else:
            # Per token: an increment of n tokens (the engine's stream interval, or events
            # merged in one read) stands for n gaps of a n-th of its wait.
            n = len(out.token_ids)
            if n <= 1:
                self.itl_seconds.append(now - self._last)
            else:
                self.itl_seconds.extend([(now - self._last) / n] * n)
        self._last = now
        first = not self.started_output
        self.started_output = True
        if out.prompt_tokens:
            self.prompt_tokens = out.prompt_tokens
        if out.cached_tokens:
            self.cached_tokens = out.cached_tokens
        if out.finished and out.finish_reason not in ("stop", "length"):
            raise EngineError(
                f"the engine ended the request ({out.finish_reason or 'no reason'})",
                retryable=first and not out.token_ids,
            )
        ids = out.token_ids
        lps = out.logprobs
        if lps is None and self._params.logprobs is not None:
            lps = ()  # an increment without ids may come without entries
        if self._held_stop is not None:
            ids = (self._held_stop, *ids)
            self._held_stop = None
            if lps is not None and self._held_logprob is not None:
                lps = (self._held_logprob, *lps)
            self._held_logprob = None
        self._logprobs = lps
        if not out.finished and ids and ids[-1] in self._stop_ids:
            if lps:
                self._held_logprob = lps[-1]
                self._logprobs = lps[:-1]
            # vLLM's gRPC stream sends the eos id in its last chunk and the finish in a
            # separate, empty message: hold the id until we know whether it ended the output
            # (hidden) or generation went on past it (ignore_eos: shown).
            self._held_stop = ids[-1]
            ids = ids[:-1]
        hide_last = (
            out.finished
            and out.finish_reason == "stop"
            and bool(ids)
            and ids[-1] in self._stop_ids
            and not isinstance(out.matched_stop, str)
        )
        return ids, hide_last

    def _attach_logprobs(self, step: Step, finished: bool, hide_last: bool) -> None:
        """The log probabilities of the ids `_observe` passed on (aligned there: a held stop
        id's entry first) go on `step`, a hidden last id's dropped; when `step` shows nothing
        yet they wait for the next step that does (the last step takes whatever is left)."""
        entries = self._logprobs or ()
        carry = self._logprobs_carry
        carry.extend(entries[:-1] if hide_last and entries else entries)
        if carry and (not step.empty or finished or self._detokenizer.stopped is not None):
            step.logprobs = carry
            self._logprobs_carry = []

    def _parse(self, pieces: list[Piece]) -> Step:
        """Detokenized pieces → the parser session → one step. One feed per piece: the session
        counts a feed's tokens as reasoning by the state it starts in."""
        step = Step()
        feed = self.session.feed
        for text, ids in pieces:
            _append(step, feed(text, ids))
        return step

    def _finish(self, step: Step, out: EngineOutput) -> None:
        """End of output: flushes the detokenizer and the session into `step` and sets the
        finish reason ("tool_calls" when a "stop" ended a response that called tools)."""
        if self._detokenizer.stopped is not None:
            reason = "stop"
            self.completion_tokens = self._detokenizer.tokens
        else:
            reason = out.finish_reason or "stop"
        _append(step, self._parse(self._detokenizer.finish()))
        _append(step, self.session.finish())
        if reason == "stop" and self.session.result().tool_calls:
            reason = "tool_calls"
        step.finish_reason = self.finish_reason = reason


def engine_error(exc: EngineError) -> InferplaneError:
    """An engine error as the client sees it (generations, embeddings and speech alike).

    The engine refusing the request is the client's fault: InvalidArgumentError (a 400, never
    retried, never a failure of the replica; code invalid_value naming `exc.param` when the
    engine said which field, else invalid_request). Anything else is UnavailableError (code
    engine_failed, reason ENGINE_FAILED): before any output the router may retry it on
    another replica (UNAVAILABLE is its retry signal); after output it ends the stream with
    this status instead of truncating it.
    """
    if exc.rejected:
        return InvalidArgumentError(
            f"the request was rejected by the engine: {exc}",
            code="invalid_request" if exc.param is None else "invalid_value",
            param=exc.param,
        )
    return UnavailableError(
        f"the engine failed: {exc}", reason="ENGINE_FAILED", code="engine_failed"
    )


class StreamInterval:
    """vLLM's `--stream-interval` rule, applied whatever the transport delivers: the first
    step goes at once, then one step per `n` generated tokens, and the last one carries
    whatever is held (`n` <= 1: every step that shows something)."""

    __slots__ = ("_first", "_n", "_pending", "_tokens")

    def __init__(self, n: int) -> None:
        self._n = n
        self._first = True
        self._pending: Step | None = None
        self._tokens = 0

    def push(self, step: Step, tokens: int) -> Step | None:
        """`step`, made of `tokens` generated tokens → the step to send now, or None."""
        if self._first:
            self._first = False
            return step  # even empty: the caller's cue for a role chunk
        if self._n <= 1:
            return None if step.empty else step
        self._tokens += tokens
        pending = self._pending
        if pending is None:
            pending = self._pending = step
        else:
            _append(pending, step)
        if self._tokens >= self._n and not pending.empty:
            self._pending, self._tokens = None, 0
            return pending
        return None

    def last(self, step: Step) -> Step:
        """The final step: what is held, then `step` (its finish_reason kept)."""
        pending = self._pending
        if pending is None:
            return step
        self._pending = None
        _append(pending, step)
        pending.finish_reason = step.finish_reason
        return pending

    def held(self) -> Step | None:
        """What is held back and shows something (a failed stream still delivers it)."""
        pending, self._pending = self._pending, None
        return pending if pending is not None and not pending.empty else None


def _append(step: Step, more: Step | Delta) -> None:
    """Appends `more`'s output to `step`, joining a call's fragments to the previous one of
    the same call (one entry per call index per chunk, as OpenAI streams them)."""
    if isinstance(more, Step) and more.logprobs:
        if step.logprobs is None:
            step.logprobs = []
        step.logprobs.extend(more.logprobs)
    if more.reasoning:
        step.reasoning += more.reasoning
    if more.content:
        step.content += more.content
    calls = step.tool_calls
    for tc in more.tool_calls:
        if calls and calls[-1].index == tc.index:
            prev = calls[-1]
            calls[-1] = ToolCallDelta(
                tc.index, prev.id or tc.id, prev.name or tc.name, prev.arguments + tc.arguments
            )
        else:
            calls.append(tc)


async def _close(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()

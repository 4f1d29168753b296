"""One generation: engine increments → text pieces → parser deltas → visible steps.

The protocol-free core shared by the four RPCs: the servicer turns `Step`s into OpenAI chunks
or a whole response. Costs are O(1) amortised per token (DecodeStream, a parser that never
rescans, appends only).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence

from inferplane.node_agent.engine.api import EngineClient, EngineError, SamplingParams
from inferplane.node_agent.pipeline.detokenize import Piece, TextStage
from inferplane.node_agent.pipeline.outcome import Clock
from inferplane.parsers import Delta, Parser, ParseResult, Sink, ToolCall, ToolCallDelta


@dataclasses.dataclass(slots=True)
class Step:
    """What one engine increment made visible.

    Attributes:
        reasoning: new reasoning text.
        content: new content text.
        tool_calls: tool-call fragments (at most one per call index, in index order; a call's
            first fragment carries its id and name).
        finish_reason: set on the last step only: "stop", "length" or "tool_calls".
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

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
        parser: the reasoning + tool-call parser, or None (all output is content).
        thinking: the prompt opened reasoning (the parser starts inside it).
        history_tool_calls: tool calls earlier in the conversation (id numbering).
        tool_calls_allowed: False drops tool calls from the output (`tool_choice: "none"`).
        clock: time source; `started` is the request's arrival on that clock.

    After `steps` is exhausted, the attributes hold the request's facts: token counts,
    `finish_reason`, `ttft_seconds`, `itl_seconds` and `result()`.
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
        parser: Parser | None,
        thinking: bool,
        history_tool_calls: int = 0,
        tool_calls_allowed: bool = True,
        clock: Clock,
        started: float,
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._prompt_ids = prompt_ids
        self._params = params
        self._stop_ids = stop_token_ids | frozenset(params.stop_token_ids)
        self._text = TextStage(backend, prompt_ids, params.stop, params.min_tokens or 0)
        self._parser = parser
        self._session = (
            parser.start(thinking, history_tool_calls=history_tool_calls) if parser else None
        )
        self._sinks = parser.config.sinks if parser else {}
        self._allow_calls = tool_calls_allowed
        self._clock = clock
        self._started = started
        self._last: float | None = None
        # The whole response, for unary answers, validation and the outcome record.
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, *argument fragments]
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.dropped_tool_calls = 0
        self.finish_reason: str | None = None
        self.ttft_seconds: float | None = None
        self.itl_seconds: list[float] = []
        self.started_output = False

    async def steps(self) -> AsyncGenerator[Step, None]:
        """Streams the visible steps: the first engine output always yields a step (maybe
        empty: the caller's cue for a role chunk), later outputs only when they show something,
        and the last step carries `finish_reason`. With `params.stream_interval` N > 1, later
        outputs are merged until N tokens have arrived since the last step (vLLM's
        `--stream-interval` rule, applied here whatever the transport delivers).

        Raises:
            EngineError: the engine failed, aborted the request, or ended its stream without
                finishing; `retryable` is True when no engine output had arrived.

        Whenever the iteration ends before the engine finished (client cancel, deadline, a
        matched stop string, an error), the engine request is aborted.
        """
        engine = self._engine
        stream = engine.generate(self.request_id, self._prompt_ids, self._params)
        finished = False
        held_stop: int | None = None
        interval = self._params.stream_interval or 1
        pending: Step | None = None  # output held back by the stream interval
        pending_tokens = 0
        try:
            async for out in stream:
                now = self._clock.monotonic()
                if self._last is None:
                    self.ttft_seconds = now - self._started
                else:
                    # Per token: an increment of n tokens (the engine's stream interval, or
                    # events merged in one read) stands for n gaps of a n-th of its wait.
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
                if held_stop is not None:
                    ids = (held_stop, *ids)
                    held_stop = None
                if not out.finished and ids and ids[-1] in self._stop_ids:
                    # vLLM's gRPC stream sends the eos id in its last chunk and the finish in a
                    # separate, empty message: hold the id until we know whether it ended the
                    # output (hidden) or generation went on past it (ignore_eos: shown).
                    held_stop = ids[-1]
                    ids = ids[:-1]
                hide_last = (
                    out.finished
                    and out.finish_reason == "stop"
                    and bool(ids)
                    and ids[-1] in self._stop_ids
                    and not isinstance(out.matched_stop, str)
                )
                step = self._feed(self._text.push(ids, hide_last=hide_last))
                # Progress so far (a cancelled or failed request still reports what it cost).
                self.completion_tokens = out.completion_tokens or self._text.tokens
                if self._text.stopped is not None or out.finished:
                    if self._text.stopped is not None:
                        reason = "stop"
                        self.completion_tokens = self._text.tokens
                    else:
                        reason = out.finish_reason or "stop"
                        self.completion_tokens = out.completion_tokens or self._text.tokens
                    _combine(step, self._feed(self._text.finish()))
                    if self._session is not None:
                        self._merge(step, self._session.finish())
                    if reason == "stop" and self._calls:
                        reason = "tool_calls"
                    step.finish_reason = self.finish_reason = reason
                    finished = True
                    if pending is not None:
                        _combine(pending, step)
                        pending.finish_reason = reason
                        step = pending
                    yield step
                    return
                if first or (interval <= 1 and not step.empty):
                    yield step
                    continue
                # vLLM's stream interval: the first token goes at once, then one step per
                # `interval` generated tokens, and the finish carries whatever is left.
                pending_tokens += len(out.token_ids)
                if pending is None:
                    pending = step
                else:
                    _combine(pending, step)
                if pending_tokens >= interval and not pending.empty:
                    yield pending
                    pending, pending_tokens = None, 0
            raise EngineError(
                "the engine stream ended before the request finished",
                retryable=not self.started_output,
            )
        except EngineError:
            if pending is not None and not pending.empty:
                yield pending  # what was generated before the failure still reaches the client
            raise
        finally:
            if not finished or self._text.stopped is not None:
                # The EngineClient contract aborts when its iterator is closed; the explicit
                # abort also covers a stop string matched here while the engine runs on.
                await _close(stream)
                # shielded: a second cancellation must not skip the abort.
                await asyncio.shield(engine.abort(self.request_id))
            else:
                await _close(stream)

    def result(self) -> ParseResult:
        """The whole response so far as one parse result."""
        calls = [
            ToolCall(parts[0], parts[1], "".join(parts[2:]))
            for _, parts in sorted(self._calls.items())
        ]
        reasoning = "".join(self._reasoning)
        content = "".join(self._content)
        leaked = self._parser.leaks(reasoning, content, calls) if self._parser else False
        return ParseResult(reasoning, content, calls, leaked)

    # -- internals -----------------------------------------------------------------------------

    def _feed(self, pieces: list[Piece]) -> Step:
        step = Step()
        if not pieces:
            return step
        session = self._session
        if session is None:
            text = pieces[0][0] if len(pieces) == 1 else "".join(p[0] for p in pieces)
            if text:
                step.content = text
                self._content.append(text)
            return step
        sinks = self._sinks
        for text, ids in pieces:
            if sinks[session.state] is Sink.REASONING:
                self.reasoning_tokens += len(ids)
            self._merge(step, session.feed(text, ids))
        return step

    def _merge(self, step: Step, more: Delta) -> None:
        """Appends a parser delta to `step` and to the whole response."""
        if more.reasoning:
            step.reasoning += more.reasoning
            self._reasoning.append(more.reasoning)
        if more.content:
            step.content += more.content
            self._content.append(more.content)
        for tc in more.tool_calls:
            if not self._allow_calls:
                if tc.id is not None:
                    self.dropped_tool_calls += 1
                continue
            parts = self._calls.get(tc.index)
            if parts is None:
                self._calls[tc.index] = [tc.id or "", tc.name or "", tc.arguments]
            else:
                parts.append(tc.arguments)
            _add_call(step.tool_calls, tc)


def _add_call(calls: list[ToolCallDelta], tc: ToolCallDelta) -> None:
    """Appends a fragment, joining it to the previous one of the same call (one entry per call
    index per chunk, as OpenAI streams them)."""
    if calls and calls[-1].index == tc.index:
        prev = calls[-1]
        calls[-1] = ToolCallDelta(
            tc.index, prev.id or tc.id, prev.name or tc.name, prev.arguments + tc.arguments
        )
    else:
        calls.append(tc)


def _combine(step: Step, more: Step) -> None:
    """Appends a later step's (already recorded) output to `step`."""
    step.reasoning += more.reasoning
    step.content += more.content
    for tc in more.tool_calls:
        _add_call(step.tool_calls, tc)


async def _close(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()

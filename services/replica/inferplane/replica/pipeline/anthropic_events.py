"""Steps → Anthropic's Messages API output: the whole `Message` object, or its server-sent
events, as exact bytes (the replica writes them; Envoy relays them as the `HttpBody` stream
of `CreateMessage`).

Events (https://docs.anthropic.com/en/docs/build-with-claude/streaming), each framed
`event: {type}\\ndata: {json}\\n\\n`:

    message_start → ping → (content_block_start → content_block_delta* → content_block_stop)*
    → message_delta (stop_reason, stop_sequence, usage) → message_stop

Blocks open in the order output arrives: `thinking` (`thinking_delta`s; with display
"omitted" none, the block's text stays empty), `text` (`text_delta`), one `tool_use` per call
(`input_json_delta` with the argument fragments as the parser releases them; `input` starts as
`{}`). The platform signs no thinking: `signature` is always "" and no `signature_delta` is
sent (the SDK's accumulator needs none; a history thinking block's signature is ignored).

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens NOT read from the
prefix cache, `cache_read_input_tokens` those that were, `cache_creation_input_tokens` 0 (the
prefix cache fills itself, nobody pays to write it); `output_tokens` counts every generated
token, thinking included.

A failure before the first byte is raised (the server answers a status Envoy may retry); after
it the stream ends with an `error` event (`{"type": "error", "error": {"type", "message"}}`)
and status OK, never a clean-looking truncated stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.api import httpbody_pb2

from inferplane.apis import anthropic
from inferplane.parsers import ParseResult
from inferplane.replica.pipeline.generate import Step
from inferplane.replica.pipeline.sse import framed_bodies
from inferplane.runtime import InferplaneError, InternalError

Event = dict[str, Any]


def dumps(payload: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def frame(event: Event) -> bytes:
    """One server-sent event: `event: {type}\\ndata: {json}\\n\\n`."""
    return b"event: " + event["type"].encode("ascii") + b"\ndata: " + dumps(event) + b"\n\n"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage object (the module docstring has the accounting)."""
    cached = min(cached_tokens, prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def tool_input(arguments: str, index: int) -> Any:
    """A call's `input`: its arguments as a JSON object.

    Raises:
        InternalError: the model wrote arguments that are not a JSON object (code
            invalid_tool_call: Anthropic's `input` is an object, and passing the text on as
            something else would hide the fault).
    """
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InternalError(
            f"the model produced tool call {index} with arguments that are not a JSON object",
            reason="INVALID_TOOL_CALL",
            code="invalid_tool_call",
        )
    return value


def message(
    message_id: str,
    model: str,
    result: ParseResult,
    *,
    show_thinking: bool,
    thinking: bool,
    stop_reason: str,
    stop_sequence: str | None,
    usage_: dict[str, int],
) -> dict[str, Any]:
    """The whole `Message`: a thinking block (when thinking was on and the model reasoned),
    the text, one `tool_use` block per call, in that order.

    Raises:
        InternalError: a call's arguments are not a JSON object (`tool_input`).
    """
    content: list[dict[str, Any]] = []
    if thinking and result.reasoning:
        text = result.reasoning if show_thinking else ""
        content.append({"type": "thinking", "thinking": text, "signature": ""})
    if result.content:
        content.append({"type": "text", "text": result.content})
    for index, call in enumerate(result.tool_calls):
        content.append(
            {
                "type": "tool_use",
                "id": anthropic.tool_use_id(call.id),
                "name": call.name,
                "input": tool_input(call.arguments, index),
            }
        )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_,
    }


class MessageEvents:
    """Builds the events of one streamed message from the generation's steps.

    Args:
        message_id: the `msg_…` id.
        model: the model that serves it.
        show_thinking: thinking text goes out as `thinking_delta`s (False: display "omitted").
        thinking: the request asked for thinking (without, reasoning the model writes anyway
            is not shown: Anthropic returns no thinking block then).
    """

    __slots__ = (
        "_blocks",
        "_calls",
        "_current",
        "_id",
        "_kind",
        "_model",
        "_show",
        "_thinking",
    )

    def __init__(
        self,
        message_id: str,
        model: str,
        *,
        show_thinking: bool,
        thinking: bool,
    ) -> None:
        self._id = message_id
        self._model = model
        self._show = show_thinking
        self._thinking = thinking
        self._blocks = 0  # blocks opened so far
        self._current: int | None = None  # the open block's index
        self._kind = ""  # the open block's type
        self._calls: dict[int, int] = {}  # tool-call index → block index

    def start(self, usage_: dict[str, int]) -> list[Event]:
        """`message_start` (empty content, the usage known so far) and a `ping`."""
        return [
            {
                "type": "message_start",
                "message": {
                    "id": self._id,
                    "type": "message",
                    "role": "assistant",
                    "model": self._model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage_,
                },
            },
            {"type": "ping"},
        ]

    def step(self, step: Step) -> list[Event]:
        """The events of one visible step (blocks opened and closed as its kind changes)."""
        events: list[Event] = []
        if step.reasoning and self._thinking:
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, events)
            if self._show:
                events.append(self._delta({"type": "thinking_delta", "thinking": step.reasoning}))
        if step.content:
            self._open("text", {"type": "text", "text": ""}, events)
            events.append(self._delta({"type": "text_delta", "text": step.content}))
        for call in step.tool_calls:
            block = self._calls.get(call.index)
            if block is None:
                self._close(events)
                block = self._calls[call.index] = self._begin(
                    "tool_use",
                    {
                        "type": "tool_use",
                        "id": anthropic.tool_use_id(call.id or ""),
                        "name": call.name or "",
                        "input": {},
                    },
                    events,
                )
            if call.arguments:
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": block,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                    }
                )
        return events

    def finish(
        self, stop_reason: str, stop_sequence: str | None, usage_: dict[str, int]
    ) -> list[Event]:
        """The open block's stop, `message_delta` (stop reason, stop sequence, final usage)
        and `message_stop`."""
        events: list[Event] = []
        self._close(events)
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage_,
            }
        )
        events.append({"type": "message_stop"})
        return events

    # -- blocks --------------------------------------------------------------------------------

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self._current, "delta": delta}

    def _open(self, kind: str, block: dict[str, Any], events: list[Event]) -> None:
        """Makes a block of `kind` the open one (closing another kind's)."""
        if self._current is not None and self._kind == kind:
            return
        self._close(events)
        self._begin(kind, block, events)

    def _begin(self, kind: str, block: dict[str, Any], events: list[Event]) -> int:
        index = self._blocks
        self._blocks += 1
        self._current, self._kind = index, kind
        events.append({"type": "content_block_start", "index": index, "content_block": block})
        return index

    def _close(self, events: list[Event]) -> None:
        if self._current is not None:
            events.append({"type": "content_block_stop", "index": self._current})
            self._current, self._kind = None, ""


def error_event(exc: InferplaneError) -> Event:
    """The `error` event that ends a stream which failed after its first byte (Anthropic's
    error type for the error's HTTP status: `overloaded_error` for an unavailable engine)."""
    return anthropic.error_body(exc.http_status, exc.message)


def sse_bodies(
    events: AsyncIterator[list[Event]],
    on_error: Callable[[InferplaneError], Any] = lambda _exc: None,
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """Frames batches of events as `HttpBody` messages (one per non-empty batch; the first
    carries `content_type: text/event-stream`), ending with Anthropic's `error` event on a
    failure after the first byte (`sse.framed_bodies`).

    Raises:
        InferplaneError: raised by `events` before any byte was written.
    """
    return framed_bodies(
        events,
        lambda batch: b"".join(frame(event) for event in batch),
        lambda exc: frame(error_event(exc)),
        on_error,
    )

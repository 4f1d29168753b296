"""Typed stream chunks → OpenAI's Server-Sent-Events bytes as `google.api.HttpBody` messages.

The one copy of the SSE framing on the data path (issue 16: the replica writes the bytes Envoy
relays). The first message carries `content_type: text/event-stream`; each chunk becomes
`data: {json}\\n\\n`; a finished stream ends with `data: [DONE]\\n\\n`. A failure before the
first byte is raised (the caller turns it into a gRPC status, which Envoy may retry on another
replica); after it, the status would reach a REST client as a truncated body, so the stream
ends with OpenAI's error event instead, and then ends OK.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from google.api import httpbody_pb2

from inferplane.runtime import InferplaneError
from inferplane.wire import SSE_DONE, sse_error, sse_event

SSE_CONTENT_TYPE = "text/event-stream"
#: The media type of a unary JSON body written as an `HttpBody` (Messages, Responses).
JSON_CONTENT_TYPE = "application/json"

Chunk = TypeVar("Chunk")


async def framed_bodies(
    frames: AsyncIterator[bytes],
    error_frame: Callable[[InferplaneError], bytes],
    on_error: Callable[[InferplaneError], Any] = lambda _exc: None,
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """Already-framed SSE bytes as `HttpBody` messages: the first non-empty one carries
    `content_type: text/event-stream`; empty frames are skipped. The one place that decides
    what a failure becomes (every API's writer frames through it: OpenAI's here, Anthropic's
    in `anthropic_events`).

    Args:
        frames: SSE bytes (one or more events each); closed when this iterator is.
        error_frame: the API's error event for a failure after the first byte.
        on_error: told about an `InferplaneError` that became an error event, before the
            event is written.

    Raises:
        InferplaneError: raised by `frames` before any byte was written (the caller's gRPC
            status, which Envoy may retry on another replica).
    """
    started = False
    try:
        async with aclosing(frames):  # type: ignore[type-var]
            async for data in frames:
                if not data:
                    continue
                if started:
                    yield httpbody_pb2.HttpBody(data=data)
                else:
                    started = True
                    yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=data)
    except InferplaneError as exc:
        if not started:
            raise
        on_error(exc)
        yield httpbody_pb2.HttpBody(data=error_frame(exc))


def _openai_error(exc: InferplaneError) -> bytes:
    return sse_error(exc.message, exc.openai_type, exc.code, exc.param)


async def sse_bodies(
    chunks: AsyncIterator[Chunk],
    to_json: Callable[[Chunk], bytes],
    on_error: Callable[[InferplaneError], Any] = lambda _exc: None,
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """Frames `chunks` as OpenAI's SSE `HttpBody` messages (see the module docstring).

    Args:
        chunks: typed stream messages; closed when this iterator is.
        to_json: a chunk's OpenAI JSON (`inferplane.wire.chunk_to_json`,
            `completion_chunk_to_json`).
        on_error: told about an `InferplaneError` that became an error event (after the first
            byte), before the event is written.

    Raises:
        InferplaneError: raised by `chunks` before any byte was written.
    """
    failed = False

    def note(exc: InferplaneError) -> None:
        nonlocal failed
        failed = True
        on_error(exc)

    async def frames() -> AsyncIterator[bytes]:
        async with aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                yield sse_event(to_json(chunk))

    started = False
    async with aclosing(framed_bodies(frames(), _openai_error, note)) as bodies:
        async for body in bodies:
            started = True
            yield body
    if failed:
        return
    if started:
        yield httpbody_pb2.HttpBody(data=SSE_DONE)
    else:
        yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=SSE_DONE)

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
Item = TypeVar("Item")


async def framed_bodies(
    items: AsyncIterator[Item],
    encode: Callable[[Item], bytes],
    error_frame: Callable[[InferplaneError], bytes],
    on_error: Callable[[InferplaneError], Any] = lambda _exc: None,
    done: bytes = b"",
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """`items` as SSE `HttpBody` messages, one per item (`encode`: its SSE bytes; an item that
    encodes to nothing is skipped); the first carries `content_type: text/event-stream`. The one
    place that decides what a failure becomes, for every API's writer (OpenAI's `sse_bodies`
    here, Anthropic's in `anthropic_events`); one generator per stream, the token path's only
    hop between the writer and grpc.

    Args:
        items: typed stream messages or event batches; closed when this iterator is.
        encode: an item's SSE bytes.
        error_frame: the API's error event for a failure after the first byte.
        on_error: told about an `InferplaneError` that became an error event, before the
            event is written.
        done: written after the last item when the stream ended cleanly (OpenAI's
            `data: [DONE]`); b"": nothing.

    Raises:
        InferplaneError: raised by `items` before any byte was written (the caller's gRPC
            status, which Envoy may retry on another replica).
    """
    started = False
    try:
        async with aclosing(items):  # type: ignore[type-var]
            async for item in items:
                data = encode(item)
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
        return
    if done:
        if started:
            yield httpbody_pb2.HttpBody(data=done)
        else:
            yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=done)


def _openai_error(exc: InferplaneError) -> bytes:
    return sse_error(exc.message, exc.openai_type, exc.code, exc.param)


def sse_bodies(
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
    return framed_bodies(
        chunks, lambda chunk: sse_event(to_json(chunk)), _openai_error, on_error, done=SSE_DONE
    )

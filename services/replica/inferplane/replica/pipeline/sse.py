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

Chunk = TypeVar("Chunk")


async def sse_bodies(
    chunks: AsyncIterator[Chunk],
    to_json: Callable[[Chunk], bytes],
    on_error: Callable[[InferplaneError], Any] = lambda _exc: None,
) -> AsyncIterator[httpbody_pb2.HttpBody]:
    """Frames `chunks` as SSE `HttpBody` messages (see the module docstring).

    Args:
        chunks: typed stream messages; closed when this iterator is.
        to_json: a chunk's OpenAI JSON (`inferplane.wire.chunk_to_json`,
            `completion_chunk_to_json`).
        on_error: told about an `InferplaneError` that became an error event (after the first
            byte), before the event is written.

    Raises:
        InferplaneError: raised by `chunks` before any byte was written.
    """
    started = False
    try:
        async with aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                data = sse_event(to_json(chunk))
                if started:
                    yield httpbody_pb2.HttpBody(data=data)
                else:
                    started = True
                    yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=data)
    except InferplaneError as exc:
        if not started:
            raise
        on_error(exc)
        yield httpbody_pb2.HttpBody(
            data=sse_error(exc.message, exc.openai_type, exc.code, exc.param)
        )
        return
    if started:
        yield httpbody_pb2.HttpBody(data=SSE_DONE)
    else:
        yield httpbody_pb2.HttpBody(content_type=SSE_CONTENT_TYPE, data=SSE_DONE)

"""How `bench/chaos.py` classifies a stream's end (`bench/chaoslib/streams.py`), on each API,
against canned responses (httpx's MockTransport, no stack): a finish is `completed`, the API's
error event after tokens is `ended_by_error_event`, a transport error after the HTTP 200 is
`reset_after_first_byte`, and a clean end without the API's finish is `cut_silently` (the
bench's `silent_truncations`, docs/architecture.md "Failure semantics")."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "chaoslib" / "streams.py"
    spec = importlib.util.spec_from_file_location("inferplane_bench_chaos_streams", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


streams = _load()


def _chat(delta: dict[str, Any], finish: str | None = None) -> str:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(chunk)}\n\n"


def _typed(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


CHAT_TOKENS = [_chat({"reasoning_content": "Hm"}), _chat({"content": "Paris"})]
CHAT_DONE = [_chat({}, "stop"), "data: [DONE]\n\n"]
MESSAGES_TOKENS = [
    _typed("message_start", message={}),
    _typed("content_block_delta", index=0, delta={"type": "text_delta", "text": "Paris"}),
]
MESSAGES_DONE = [_typed("message_delta", delta={"stop_reason": "end_turn"}), _typed("message_stop")]
RESPONSES_TOKENS = [_typed("response.created"), _typed("response.output_text.delta", delta="Pa")]
RESPONSES_DONE = [_typed("response.completed", response={"status": "completed"})]
ERROR = {"type": "server_error", "code": "engine_failed", "message": "the engine failed"}

CASES = [
    ("chat", [*CHAT_TOKENS, *CHAT_DONE], None, "completed", []),
    ("chat", CHAT_TOKENS, None, "cut_silently", []),
    ("chat", [*CHAT_TOKENS, _chat({}, "stop")], None, "cut_silently", []),
    (
        "chat",
        [*CHAT_TOKENS, f"data: {json.dumps({'error': ERROR})}\n\n"],
        None,
        "ended_by_error_event",
        ["data.error"],
    ),
    (
        "chat",
        CHAT_TOKENS,
        httpx.RemoteProtocolError("incomplete chunked read"),
        "reset_after_first_byte",
        [],
    ),
    ("messages", [*MESSAGES_TOKENS, *MESSAGES_DONE], None, "completed", []),
    (
        "messages",
        [*MESSAGES_TOKENS, MESSAGES_DONE[0], "data: [DONE]\n\n"],
        None,
        "cut_silently",
        [],
    ),
    (
        "messages",
        [*MESSAGES_TOKENS, _typed("error", error={"type": "overloaded_error"})],
        None,
        "ended_by_error_event",
        ["error"],
    ),
    ("responses", [*RESPONSES_TOKENS, *RESPONSES_DONE], None, "completed", []),
    ("responses", RESPONSES_TOKENS, None, "cut_silently", []),
    (
        "responses",
        [
            *RESPONSES_TOKENS,
            _typed("response.failed", response={}),
            _typed("error", code="engine_failed", error=ERROR),
        ],
        None,
        "ended_by_error_event",
        ["response.failed", "error"],
    ),
    (
        "responses",
        RESPONSES_TOKENS,
        httpx.RemoteProtocolError("stream reset"),
        "reset_after_first_byte",
        [],
    ),
]


class _Body(httpx.SyncByteStream):
    """The events, then `error` raised (a transport error after the first byte) or a clean end."""

    def __init__(self, events: list[str], error: Exception | None) -> None:
        self._events, self._error = events, error

    def __iter__(self) -> Iterator[bytes]:
        for event in self._events:
            yield event.encode()
        if self._error is not None:
            raise self._error


def _stream(api: str, response: httpx.Response) -> Any:
    http = httpx.Client(transport=httpx.MockTransport(lambda _request: response))
    request = streams.Request("test", 16, api=api)
    with http:
        return streams.stream(http, "http://edge/v1", "key", streams.body(api, 16, "s"), request)


@pytest.mark.parametrize(("api", "events", "error", "outcome", "error_events"), CASES)
def test_a_stream_ends_as_one_outcome(
    api: str, events: list[str], error: Exception | None, outcome: str, error_events: list[str]
) -> None:
    response = httpx.Response(200, headers={"x-request-id": "r1"}, stream=_Body(events, error))
    request = _stream(api, response)
    assert (request.outcome, request.error_events) == (outcome, error_events), request.describe()
    assert request.request_id == "r1" and request.tokens > 0


def test_a_refusal_before_the_first_token_carries_its_code() -> None:
    response = httpx.Response(
        503, json={"error": {"code": "no_ready_replica", "message": "no replica"}}
    )
    request = _stream("chat", response)
    assert request.outcome == streams.FAILED_BEFORE_FIRST_TOKEN
    assert request.error_code == "no_ready_replica"

"""A capturing stand-in for an LLM endpoint: records every request a client sends and answers
the three chat APIs (OpenAI chat completions, OpenAI Responses, Anthropic Messages) with a short,
well-formed reply ("ok"), streamed or not as asked, so a coding agent completes its turn and
sends every request a turn holds (a capture server that only answered errors would see the
agent's retries instead of its later requests).

Scripted tool round trip: when a request declares a tool whose name ends with `get_weather`
(the agent's name for `inferplane.testing.weather_mcp`'s tool: Claude Code's
`mcp__weather__get_weather`, OpenCode's `weather_get_weather`, Codex's `get_weather` inside the
`mcp__weather` namespace) and its conversation holds no tool result yet, the answer is a call of
it (`WEATHER_ARGUMENTS`); the agent then runs the tool and sends the result in its next request.

Used by `tests/agents/capture.py` to record what each pinned agent sends
(`tests/data/agents/`). Not a model: the answer never depends on the request.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ANSWER = "ok"
WEATHER_TOOL = "get_weather"
WEATHER_ARGUMENTS = '{"city": "Tokyo", "unit": "celsius"}'


@dataclass(frozen=True)
class CapturedRequest:
    """One request as received: `path` includes the query string; `body` is the parsed JSON
    body (None when the body was empty or not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class CaptureServer:
    """A ThreadingHTTPServer on 127.0.0.1 (a free port) serving `CaptureHandler`; `requests`
    holds what it received, in order. Use as a context manager."""

    model: str = "captured-model"
    requests: list[CapturedRequest] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return int(self._server.server_address[1])

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self, request: CapturedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def __enter__(self) -> CaptureServer:
        owner = self

        class Handler(CaptureHandler):
            server_owner = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class CaptureHandler(BaseHTTPRequestHandler):
    server_owner: CaptureServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def _record(self, body: Any) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server_owner.record(CapturedRequest(self.command, self.path, headers, body))

    def do_GET(self) -> None:
        self._record(None)
        route = self.path.split("?", 1)[0].rstrip("/")
        if route.endswith("/models"):
            model = self.server_owner.model
            self._json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found"}})

    def do_POST(self) -> None:
        body = self._read_body()
        self._record(body)
        route = self.path.split("?", 1)[0].rstrip("/")
        request = body if isinstance(body, dict) else {}
        stream = bool(request.get("stream"))
        if route.endswith("/messages/count_tokens"):
            self._json(200, {"input_tokens": 1})
        elif route.endswith("/messages"):
            self._events(messages_events(request)) if stream else self._json(
                200, messages_reply(request)
            )
        elif route.endswith("/responses"):
            self._events(responses_events(request)) if stream else self._json(
                200, responses_reply(request)
            )
        elif route.endswith("/chat/completions"):
            self._events(chat_events(request)) if stream else self._json(200, chat_reply(request))
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found"}})

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _events(self, events: Iterator[tuple[str | None, Any]]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        for name, payload in events:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            chunk = (f"event: {name}\n" if name else "") + f"data: {data}\n\n"
            self.wfile.write(chunk.encode())
            self.wfile.flush()
        self.close_connection = True


def _model(request: dict[str, Any]) -> str:
    return str(request.get("model") or "captured-model")


def weather_tool(request: dict[str, Any]) -> tuple[str, str | None] | None:
    """(name, namespace) of the declared weather tool, if the conversation has no tool result
    yet (a second request of the round trip is answered with text)."""
    if _has_tool_result(request):
        return None
    for tool in request.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        nested = tool.get("function") if isinstance(tool.get("function"), dict) else None
        name = str((nested or tool).get("name") or "")
        if name.endswith(WEATHER_TOOL):
            return name, None
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                if str(inner.get("name") or "").endswith(WEATHER_TOOL):
                    return str(inner["name"]), name
    return None


def _has_tool_result(request: dict[str, Any]) -> bool:
    for message in request.get("messages") or []:  # chat and Anthropic Messages
        if message.get("role") == "tool":
            return True
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") == "tool_result" for block in content
        ):
            return True
    items = request.get("input")  # Responses
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" for item in items
    )


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- Anthropic Messages ----------------------------------------------------------------------


def messages_reply(request: dict[str, Any]) -> dict[str, Any]:
    tool = weather_tool(request)
    block: dict[str, Any] = {"type": "text", "text": ANSWER}
    if tool:
        tool_id = f"toolu_{uuid.uuid4().hex[:24]}"
        block = {
            "type": "tool_use",
            "id": tool_id,
            "name": tool[0],
            "input": json.loads(WEATHER_ARGUMENTS),
        }
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": _model(request),
        "content": [block],
        "stop_reason": "tool_use" if tool else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }


def messages_events(request: dict[str, Any]) -> Iterator[tuple[str | None, Any]]:
    reply = messages_reply(request)
    start = {**reply, "content": [], "stop_reason": None}
    yield "message_start", {"type": "message_start", "message": start}
    block = dict(reply["content"][0])
    if block["type"] == "tool_use":
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block.pop("input"))}
        block["input"] = {}
    else:
        delta = {"type": "text_delta", "text": block.pop("text")}
        block["text"] = ""
    yield "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": 1},
        },
    )
    yield "message_stop", {"type": "message_stop"}


# -- OpenAI Responses ------------------------------------------------------------------------


def responses_reply(request: dict[str, Any]) -> dict[str, Any]:
    tool = weather_tool(request)
    item: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": ANSWER, "annotations": []}],
    }
    if tool:
        item = {
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "type": "function_call",
            "status": "completed",
            "call_id": _call_id(),
            "name": tool[0],
            "arguments": WEATHER_ARGUMENTS,
        }
        if tool[1]:
            item["namespace"] = tool[1]
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": _model(request),
        "output": [item],
        "usage": {
            "input_tokens": 1,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 2,
        },
    }


def responses_events(request: dict[str, Any]) -> Iterator[tuple[str | None, Any]]:
    done = responses_reply(request)
    item = done["output"][0]
    created = {**done, "status": "in_progress", "output": [], "usage": None}
    head: list[dict[str, Any]] = [
        {"type": "response.created", "response": created},
        {"type": "response.in_progress", "response": created},
    ]
    if item["type"] == "function_call":
        call_events = [
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "status": "in_progress", "arguments": ""},
            },
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": 0,
                "delta": item["arguments"],
            },
            {
                "type": "response.function_call_arguments.done",
                "item_id": item["id"],
                "output_index": 0,
                "arguments": item["arguments"],
            },
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": done},
        ]
        for number, event in enumerate(head + call_events):
            yield event["type"], {**event, "sequence_number": number}
        return
    part = {"type": "output_text", "text": "", "annotations": []}
    events: list[dict[str, Any]] = [
        *head,
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {
            "type": "response.content_part.added",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "part": part,
        },
        {
            "type": "response.output_text.delta",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "delta": ANSWER,
        },
        {
            "type": "response.output_text.done",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "text": ANSWER,
        },
        {
            "type": "response.content_part.done",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "part": item["content"][0],
        },
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": done},
    ]
    for number, event in enumerate(events):
        yield event["type"], {**event, "sequence_number": number}


# -- OpenAI chat completions -----------------------------------------------------------------


def _chat_call(request: dict[str, Any]) -> dict[str, Any] | None:
    tool = weather_tool(request)
    if not tool:
        return None
    function = {"name": tool[0], "arguments": WEATHER_ARGUMENTS}
    return {"id": _call_id(), "type": "function", "function": function}


def chat_reply(request: dict[str, Any]) -> dict[str, Any]:
    call = _chat_call(request)
    message: dict[str, Any] = {"role": "assistant", "content": ANSWER}
    if call:
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": _model(request),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if call else "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def chat_events(request: dict[str, Any]) -> Iterator[tuple[str | None, Any]]:
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": _model(request),
    }
    call = _chat_call(request)
    deltas: list[tuple[dict[str, Any], str | None]] = [
        ({"role": "assistant", "content": ""}, None),
        ({"content": ANSWER}, None),
        ({}, "stop"),
    ]
    if call:
        deltas = [
            ({"role": "assistant", "content": None}, None),
            ({"tool_calls": [{"index": 0, **call}]}, None),
            ({}, "tool_calls"),
        ]
    for delta, finish in deltas:
        yield None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    yield None, {**base, "choices": [], "usage": usage}
    yield None, "[DONE]"

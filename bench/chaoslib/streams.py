"""One streamed request through the edge and how it ended, on each API and either protocol.

APIs (`API_PATHS`): "chat" (OpenAI chat completions), "messages" (Anthropic Messages) and
"responses" (OpenAI Responses). `client(http2=...)` opens an httpx client on HTTP/1.1, or on
HTTP/2 with prior knowledge (h2c: the edge's listener detects the protocol, `codec_type: AUTO`).

How each API's stream ends (what `Request` records from the server-sent events):

    API        finished                                        error event after the first byte
    chat       a `finish_reason`, then `data: [DONE]` last     `data: {"error": {...}}`
    messages   `message_delta` with a `stop_reason`, then      `event: error`,
               `message_stop`                                  `{"type": "error", "error": {...}}`
    responses  `response.completed` / `response.incomplete`    `response.failed`, then `error`

Each request ends as exactly one outcome (`Request.outcome`):

- `completed`: HTTP 200, finished as above, no error event, no transport error;
- `failed_before_first_token`: no generated token and an explicit refusal (an HTTP error
  status, an error event, or no response at all: `conn`);
- `ended_by_error_event`: generated tokens, then the API's error event;
- `reset_after_first_byte`: an HTTP 200 stream that ended with a transport-level error and
  no error event (HTTP/1.1: the chunked body ends without its terminating chunk; HTTP/2: the
  stream is reset). Visible to every client (the SDKs raise), accepted when the process that
  writes the stream dies (docs/architecture.md, "Failure semantics");
- `cut_silently`: an HTTP 200 stream that ended cleanly without finishing and without an error
  event: a client takes it for a whole answer (goal 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any

import httpx

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME

COMPLETED = "completed"
FAILED_BEFORE_FIRST_TOKEN = "failed_before_first_token"
ENDED_BY_ERROR_EVENT = "ended_by_error_event"
RESET_AFTER_FIRST_BYTE = "reset_after_first_byte"
CUT_SILENTLY = "cut_silently"

#: The outcomes of a stream that got its HTTP 200 and then failed (`failed_after_first_byte`).
AFTER_FIRST_BYTE = (ENDED_BY_ERROR_EVENT, RESET_AFTER_FIRST_BYTE, CUT_SILENTLY)

#: API → path below the edge's `/v1`.
API_PATHS = {"chat": "/chat/completions", "messages": "/messages", "responses": "/responses"}


def client(*, http2: bool, read_timeout_s: float = 60.0, connections: int = 8) -> httpx.Client:
    """An httpx client on HTTP/1.1, or on HTTP/2 only (prior knowledge over cleartext).

    Raises: ImportError when `http2` and the `h2` package is missing.
    """
    return httpx.Client(
        http1=not http2,
        http2=http2,
        timeout=httpx.Timeout(read_timeout_s, connect=5.0),
        limits=httpx.Limits(max_connections=connections),
    )


@dataclasses.dataclass
class Request:
    """What one streamed request through the edge got (filled while it streams)."""

    client: str  # who sent it, e.g. "load", "probe", "messages/h2"
    max_tokens: int
    api: str = "chat"  # a key of API_PATHS
    started_at: float = 0.0  # monotonic
    status: int = 0  # HTTP status; 0 = no response
    http_version: str = ""  # "HTTP/1.1" or "HTTP/2"
    request_id: str = ""  # the edge's x-request-id
    tokens: int = 0  # events that carried generated text (reasoning, content or tool calls)
    first_token_at: float | None = None
    finish_reason: str = ""  # chat's finish_reason, Messages' stop_reason, Responses' status
    error: dict[str, Any] | None = None  # the error event's `error`, or the error body's
    error_events: list[str] = dataclasses.field(default_factory=list)  # their event types
    done: bool = False  # the API's last event came last ([DONE], message_stop, completed)
    transport_error: str = ""
    ended_at: float = 0.0
    last_events: list[str] = dataclasses.field(default_factory=list)

    @property
    def outcome(self) -> str:
        """One of the module docstring's outcomes."""
        if (
            self.status == 200
            and self.done
            and self.finish_reason
            and self.error is None
            and not self.transport_error
        ):
            return COMPLETED
        if self.tokens == 0 and (self.status != 200 or self.error is not None):
            return FAILED_BEFORE_FIRST_TOKEN
        if self.error is not None and self.status == 200:
            return ENDED_BY_ERROR_EVENT
        if self.transport_error:
            return RESET_AFTER_FIRST_BYTE
        return CUT_SILENTLY

    @property
    def error_code(self) -> str:
        """The error code a refusal carried, else its status (`conn`: no response)."""
        if self.error is not None:
            code = str(self.error.get("code") or self.error.get("type") or "error")
            # The edge shapes an auth outage and an unusable upstream alike; tell them apart.
            if "authentication" in str(self.error.get("message", "")):
                code += " (auth)"
            return code
        return str(self.status) if self.status else "conn"

    def describe(self, origin: float = 0.0) -> str:
        """One line for a report; times in seconds from `origin` (e.g. the fault)."""
        ended = f"{self.ended_at - origin:+.1f}" if self.ended_at else "-"
        return (
            f"{self.client} {self.api} {self.http_version or '-'} {self.request_id or '-'} "
            f"({self.started_at - origin:+.1f} s → {ended} s): status {self.status}, "
            f"{self.tokens} token events, finish {self.finish_reason or '-'}, done {self.done}, "
            f"error {self.error} via {self.error_events or '-'}, "
            f"transport {self.transport_error or '-'}, last events {self.last_events}"
        )


def body(api: str, max_tokens: int, salt: str) -> dict[str, Any]:
    """A streamed request of `api` for kimi-tiny; `salt` makes prompts differ (no shared
    prefix-cache blocks between clients). Chat runs exactly `max_tokens` (`ignore_eos`); the
    other APIs have no such field and run until the model stops or `max_tokens` (thinking on:
    kimi-tiny's reasoning mostly runs to the limit)."""
    messages = [dict(m) for m in kimi_tiny.NO_TOOL.messages]
    messages[-1]["content"] = f"{messages[-1]['content']} ({salt})"
    if api == "chat":
        return {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    if api == "messages":
        return {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "stream": True,
            "thinking": {"type": "adaptive"},
        }
    if api == "responses":
        return {
            "model": MODEL_NAME,
            "input": messages[-1]["content"],
            "max_output_tokens": max_tokens,
            "temperature": 1.0,
            "stream": True,
            "store": False,
            "reasoning": {"effort": "high"},
        }
    raise ValueError(f"unknown API {api!r}; known: {', '.join(API_PATHS)}")


def stream(
    http: httpx.Client, base_url: str, key: str, payload: dict[str, Any], request: Request
) -> Request:
    """Sends `payload` to `request.api`'s path below `base_url` (the edge's `.../v1`) and fills
    `request` as the events arrive; never raises for HTTP or transport errors."""
    request.started_at = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    if request.api == "messages":
        headers["anthropic-version"] = "2023-06-01"
    try:
        with http.stream(
            "POST", f"{base_url}{API_PATHS[request.api]}", json=payload, headers=headers
        ) as response:
            request.status = response.status_code
            request.http_version = response.http_version
            request.request_id = response.headers.get("x-request-id", "")
            if response.status_code != 200:
                text = response.read().decode(errors="replace")
                with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                    request.error = dict(json.loads(text)["error"])
                if request.error is None:
                    request.error = {"code": f"http_{response.status_code}", "body": text[:200]}
                return request
            for line in response.iter_lines():
                if line.startswith("data: "):
                    on_event(request, line[6:])
    except httpx.HTTPError as exc:
        request.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        request.ended_at = time.monotonic()
    return request


def on_event(request: Request, data: str) -> None:
    """Records one SSE `data:` payload of `request.api`'s stream."""
    request.last_events = [*request.last_events[-2:], data[-120:]]
    if data == "[DONE]":
        request.done = request.api == "chat"
        return
    request.done = False  # anything after the last event breaks the stream's contract
    try:
        chunk = json.loads(data)
    except ValueError:
        return
    if not isinstance(chunk, dict):
        return
    if request.api == "chat":
        _chat_event(request, chunk)
    elif request.api == "messages":
        _messages_event(request, chunk)
    else:
        _responses_event(request, chunk)


def _token(request: Request) -> None:
    request.tokens += 1
    if request.first_token_at is None:
        request.first_token_at = time.monotonic()


def _error(request: Request, kind: str, error: Any) -> None:
    request.error_events.append(kind)
    request.error = dict(error) if isinstance(error, dict) else {"message": str(error)}


def _chat_event(request: Request, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        _error(request, "data.error", chunk["error"])
        return
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            _token(request)
        if choice.get("finish_reason"):
            request.finish_reason = str(choice["finish_reason"])


def _messages_event(request: Request, chunk: dict[str, Any]) -> None:
    kind = chunk.get("type")
    if kind == "error":
        _error(request, "error", chunk.get("error"))
    elif kind == "content_block_delta":
        _token(request)
    elif kind == "message_delta":
        request.finish_reason = str((chunk.get("delta") or {}).get("stop_reason") or "")
    elif kind == "message_stop":
        request.done = True


def _responses_event(request: Request, chunk: dict[str, Any]) -> None:
    kind = str(chunk.get("type") or "")
    if kind == "response.failed":
        request.error_events.append(kind)
    elif kind == "error":
        _error(request, "error", chunk.get("error") or chunk)
    elif kind.endswith(".delta"):
        _token(request)
    elif kind in ("response.completed", "response.incomplete"):
        request.finish_reason = str((chunk.get("response") or {}).get("status") or kind)
        request.done = True

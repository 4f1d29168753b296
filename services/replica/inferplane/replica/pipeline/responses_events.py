"""The OpenAI Responses API's output: the Response object and its streamed events, built from
a generation's `Step`s (`pipeline/generate.py`).

`ResponseWriter` turns each step into the events OpenAI documents, each with its
`sequence_number`, and keeps the output items, so the unary answer and the last streamed event
carry the same Response object:

    response.created, response.in_progress
    per output item, in order:
      reasoning:      output_item.added, content_part.added (reasoning_text),
                      reasoning_text.delta…, reasoning_text.done, content_part.done,
                      output_item.done
      message:        output_item.added, content_part.added (output_text),
                      output_text.delta…, output_text.done, content_part.done, output_item.done
      function_call:  output_item.added, function_call_arguments.delta…,
                      function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

A step's reasoning, content and tool-call fragments open items as they come: a kind that differs
from the open item's closes it first (the model reasons, then answers or calls). Ids: `rs_`,
`msg_`, `fc_` + hex; a function call's `call_id` is the parser's tool-call id (Kimi's
`functions.NAME:IDX`), which the next turn's `function_call_output.call_id` names. A call of a
namespaced function (offered flattened, `mcp__weather__get_weather`:
`inferplane.apis.responses.flat_name`) is written as OpenAI writes it: `name` the function's
own name (`get_weather`), `namespace` its namespace (`mcp__weather`); the arguments' `done`
event's `name` is the same inner name.

Reasoning items carry their text in `content` (`reasoning_text` parts); `summary` holds the same
text as one `summary_text` part when the request asked for a summary (`reasoning.summary`: the
model writes no separate summary), else is empty; `encrypted_content` is
`inferplane.apis.responses.encode_reasoning` of the text when `include` asks for it (readable,
not encrypted: Codex replays it and the next turn reads it back).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from inferplane.apis.responses import encode_reasoning
from inferplane.parsers import ToolCallDelta
from inferplane.replica.pipeline.generate import Step

Event = dict[str, Any]

FINISH_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
"""A generation's finish reason → the Response's status."""


def usage(
    prompt_tokens: int, cached_tokens: int, completion_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    """The Responses API's usage object (counts of tokens). `cache_write_tokens` are the prompt
    tokens computed for this request (not read from the prefix cache), which the engine's
    prefix cache then holds."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": max(prompt_tokens - cached_tokens, 0),
        },
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(event: Mapping[str, Any]) -> bytes:
    """One event as SSE bytes: `event: <type>` then `data: <json>`."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseWriter:
    """Builds one response's events and its Response object.

    Args:
        head: the Response object's fields other than `id`, `status`, `output`, `usage`,
            `error`, `incomplete_details` (the request's settings echoed: `model`,
            `instructions`, `tools`, ...; `created_at`).
        response_id: `resp_…`.
        new_id: a fresh hex id for output items.
        summary: reasoning items get a `summary_text` part (`reasoning.summary` was asked).
        encrypted_reasoning: reasoning items get `encrypted_content`.
        namespaced: the flat name of each namespaced function the model was offered →
            `(namespace, name)` (`inferplane.apis.responses.Converted.namespaced`); a call of
            another name is written as the model named it.
    """

    def __init__(
        self,
        head: Mapping[str, Any],
        response_id: str,
        new_id: Callable[[], str],
        *,
        summary: bool,
        encrypted_reasoning: bool,
        namespaced: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self._head = dict(head)
        self.response_id = response_id
        self._new_id = new_id
        self._summary = summary
        self._encrypted = encrypted_reasoning
        self._namespaced = dict(namespaced or {})
        self._sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._open_kind = ""  # "reasoning", "message" or "function_call"
        self._call_index = -1  # the parser's index of the open function call

    # -- events --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[Event]:
        """`response.created` and `response.in_progress`."""
        snapshot = self.response("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def step(self, step: Step) -> list[Event]:
        """The events of one step's output (its finish is `finish`'s)."""
        events: list[Event] = []
        if step.reasoning:
            events += self._text("reasoning", step.reasoning)
        if step.content:
            events += self._text("message", step.content)
        for call in step.tool_calls:
            events += self._call(call)
        return events

    def finish(self, finish_reason: str, usage_: Mapping[str, Any]) -> list[Event]:
        """Closes the open item; then `response.completed`, or `response.incomplete` when the
        output hit `max_output_tokens` (finish reason "length")."""
        events = self._close()
        status = FINISH_STATUS.get(finish_reason, "completed")
        final = self.response(status, usage_)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=final))
        return events

    def fail(self, code: str, message: str, param: str | None) -> list[Event]:
        """After a failure past the first byte: `response.failed` (the error in the Response
        object), then an `error` event (OpenAI's fields, and the error object under `error`,
        which makes the OpenAI SDKs raise instead of ending the stream quietly)."""
        error = {"code": code, "message": message}
        failed = self.response("failed")
        failed["error"] = error
        return [
            self._event("response.failed", response=failed),
            self._event(
                "error",
                code=code,
                message=message,
                param=param,
                error={"type": "server_error", "code": code, "message": message, "param": param},
            ),
        ]

    # -- the Response object -------------------------------------------------------------------

    def response(self, status: str, usage_: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The Response object now (`output` as written so far)."""
        out = {"id": self.response_id, "object": "response", **self._head}
        out.update(
            status=status,
            error=None,
            incomplete_details=(
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            output=[dict(item) for item in self.output],
            usage=dict(usage_) if usage_ is not None else None,
        )
        return out

    # -- items ---------------------------------------------------------------------------------

    def _text(self, kind: str, delta: str) -> list[Event]:
        events: list[Event] = []
        if self._open_kind != kind:
            events += self._close()
            events += self._open_text(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += delta
        index = len(self.output) - 1
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(
            self._event(
                name, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra
            )
        )
        return events

    def _open_text(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item: dict[str, Any] = {
                "id": "rs_" + self._new_id(),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": "msg_" + self._new_id(),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        self._open, self._open_kind = item, kind
        index = len(self.output) - 1
        added = self._event("response.output_item.added", output_index=index, item=_copy(item))
        item["content"].append(part)
        return [
            added,
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
        ]

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if self._open_kind != "function_call" or call.index != self._call_index:
            events += self._close()
            new: dict[str, Any] = {
                "id": "fc_" + self._new_id(),
                "type": "function_call",
                "call_id": call.id or "call_" + self._new_id(),
                "name": "",
                "arguments": "",
                "status": "in_progress",
            }
            self._name(new, call.name)
            self.output.append(new)
            self._open, self._open_kind, self._call_index = new, "function_call", call.index
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item=dict(new),
                )
            )
        item = self._open
        assert item is not None
        if not item["name"]:
            self._name(item, call.name)
        if call.arguments:
            item["arguments"] += call.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    delta=call.arguments,
                )
            )
        return events

    def _name(self, item: dict[str, Any], name: str | None) -> None:
        """Names a function-call item: a namespaced function's flat name as `name` +
        `namespace`, any other as it is."""
        if not name:
            return
        pair = self._namespaced.get(name)
        if pair is None:
            item["name"] = name
        else:
            item["namespace"], item["name"] = pair

    def _close(self) -> list[Event]:
        item, kind = self._open, self._open_kind
        if item is None:
            return []
        self._open, self._open_kind = None, ""
        index = len(self.output) - 1
        item["status"] = "completed"
        events: list[Event] = []
        if kind == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.reasoning_text.done"
                if kind == "reasoning"
                else "response.output_text.done"
            )
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(
                self._event(
                    done,
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    **extra,
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
            if kind == "reasoning":
                if self._summary:
                    item["summary"] = [{"type": "summary_text", "text": part["text"]}]
                if self._encrypted:
                    item["encrypted_content"] = encode_reasoning(part["text"])
        events.append(
            self._event("response.output_item.done", output_index=index, item=_copy(item))
        )
        return events


def _copy(item: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out

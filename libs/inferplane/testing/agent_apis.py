"""The three APIs' clients of a scripted agent session (`inferplane.testing.agent_session`),
each on its official SDK, streamed, keeping the history in the API's own shape and sending back
exactly what the API returned:

- `ChatSession` (`openai`, `POST /v1/chat/completions`): the assistant message assembled from
  the deltas (`content`, `reasoning_content`, `tool_calls` with their ids and argument text),
  then one `tool` message per call;
- `MessagesSession` (`anthropic`, `POST /v1/messages`, thinking `adaptive`): the final
  message's content blocks as returned (`thinking`, `text`, `tool_use`), then a user message of
  `tool_result` blocks;
- `ResponsesSession` (`openai`, `POST /v1/responses`, `store: false`): the response's output
  items as returned (`reasoning`, `message`, `function_call`), then `function_call_output`
  items.

Each groups its history by task, so that `drop_oldest_task` compacts it as an agent would.
TTFT is measured to the first streamed event that carries content, reasoning or a tool call.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from inferplane.parsers import ToolCall
from inferplane.testing.agent_session import Answer, ApiSession, session_tools


class _TaskHistory:
    """A history grouped by task: each `add_user` opens a group."""

    def __init__(self) -> None:
        self.tasks: list[list[Any]] = []

    def open(self, item: Any) -> None:
        self.tasks.append([item])

    def add(self, *items: Any) -> None:
        self.tasks[-1].extend(items)

    def items(self) -> list[Any]:
        return [item for task in self.tasks for item in task]

    def drop_oldest(self) -> bool:
        if len(self.tasks) < 2:
            return False
        del self.tasks[0]
        return True


class ChatSession:
    """Chat completions through the `openai` SDK (`client` is an `openai.OpenAI`)."""

    api = "chat"

    def __init__(self, client: Any, model: str) -> None:
        self._client = client
        self._model = model
        self._tools = session_tools()
        self._history = _TaskHistory()

    def add_user(self, text: str) -> None:
        self._history.open({"role": "user", "content": text})

    def add_tool_results(self, results: Sequence[tuple[ToolCall, str]]) -> None:
        self._history.add(
            *({"role": "tool", "tool_call_id": c.id, "content": text} for c, text in results)
        )

    def drop_oldest_task(self) -> bool:
        return self._history.drop_oldest()

    def turn(self, max_tokens: int) -> Answer:
        started = time.perf_counter()
        ttft = math.nan
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, list[str]] = {}
        finish = ""
        usage = None
        stream = self._client.chat.completions.create(
            model=self._model,
            messages=self._history.items(),
            tools=self._tools,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                extra = delta.model_extra or {}
                text = extra.get("reasoning_content") or extra.get("reasoning") or ""
                if math.isnan(ttft) and (delta.content or text or delta.tool_calls):
                    ttft = time.perf_counter() - started
                content.append(delta.content or "")
                reasoning.append(text)
                for tc in delta.tool_calls or ():
                    call = calls.setdefault(tc.index, ["", "", ""])
                    call[0] = call[0] or tc.id or ""
                    if tc.function is not None:
                        call[1] += tc.function.name or ""
                        call[2] += tc.function.arguments or ""
                finish = choice.finish_reason or finish
        tool_calls = [ToolCall(calls[i][0], calls[i][1], calls[i][2]) for i in sorted(calls)]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if "".join(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in tool_calls
            ]
        self._history.add(message)
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return Answer(
            content="".join(content),
            reasoning="".join(reasoning),
            calls=tool_calls,
            finish=finish,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            ttft=ttft,
            e2e=time.perf_counter() - started,
        )


class MessagesSession:
    """Anthropic Messages through the `anthropic` SDK (`client` is an `anthropic.Anthropic`)."""

    api = "messages"

    def __init__(self, client: Any, model: str) -> None:
        self._client = client
        self._model = model
        self._tools = [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in session_tools()
        ]
        self._history = _TaskHistory()

    def add_user(self, text: str) -> None:
        self._history.open({"role": "user", "content": text})

    def add_tool_results(self, results: Sequence[tuple[ToolCall, str]]) -> None:
        blocks = [
            {"type": "tool_result", "tool_use_id": c.id, "content": text} for c, text in results
        ]
        self._history.add({"role": "user", "content": blocks})

    def drop_oldest_task(self) -> bool:
        return self._history.drop_oldest()

    def turn(self, max_tokens: int) -> Answer:
        started = time.perf_counter()
        ttft = math.nan
        with self._client.messages.stream(
            model=self._model,
            messages=self._history.items(),
            tools=self._tools,
            max_tokens=max_tokens,
            thinking={"type": "adaptive"},
            # Greedy, as the other two APIs: the anthropic SDK 2.12 has no `temperature`
            # argument any more, the API still defines the field.
            extra_body={"temperature": 0},
        ) as stream:
            for event in stream:
                if math.isnan(ttft) and event.type in (
                    "content_block_delta",
                    "content_block_start",
                ):
                    block = getattr(event, "content_block", None)
                    if event.type == "content_block_delta" or (
                        block is not None and block.type == "tool_use"
                    ):
                        ttft = time.perf_counter() - started
            message = stream.get_final_message()
        # The SDK's own blocks go back as they came (its documented way to continue a turn).
        self._history.add({"role": "assistant", "content": list(message.content)})
        texts, thoughts, calls = [], [], []
        for block in message.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "thinking":
                thoughts.append(block.thinking)
            elif block.type == "tool_use":
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(ToolCall(block.id, block.name, arguments))
        usage = message.usage
        cached = usage.cache_read_input_tokens or 0
        return Answer(
            content="".join(texts),
            reasoning="".join(thoughts),
            calls=calls,
            finish=message.stop_reason or "",
            prompt_tokens=usage.input_tokens + cached + (usage.cache_creation_input_tokens or 0),
            cached_tokens=cached,
            completion_tokens=usage.output_tokens,
            ttft=ttft,
            e2e=time.perf_counter() - started,
        )


_RESPONSES_FIRST_OUTPUT = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)


class ResponsesSession:
    """OpenAI Responses through the `openai` SDK (`client` is an `openai.OpenAI`), stateless
    (`store: false`, the whole history sent every turn)."""

    api = "responses"

    def __init__(self, client: Any, model: str) -> None:
        self._client = client
        self._model = model
        self._tools = [
            {
                "type": "function",
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "parameters": t["function"]["parameters"],
            }
            for t in session_tools()
        ]
        self._history = _TaskHistory()

    def add_user(self, text: str) -> None:
        self._history.open({"role": "user", "content": text})

    def add_tool_results(self, results: Sequence[tuple[ToolCall, str]]) -> None:
        self._history.add(
            *(
                {"type": "function_call_output", "call_id": c.id, "output": text}
                for c, text in results
            )
        )

    def drop_oldest_task(self) -> bool:
        return self._history.drop_oldest()

    def turn(self, max_tokens: int) -> Answer:
        started = time.perf_counter()
        ttft = math.nan
        response = None
        stream = self._client.responses.create(
            model=self._model,
            input=self._history.items(),
            tools=self._tools,
            max_output_tokens=max_tokens,
            temperature=0,
            store=False,
            stream=True,
        )
        for event in stream:
            if math.isnan(ttft) and event.type in _RESPONSES_FIRST_OUTPUT:
                ttft = time.perf_counter() - started
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                response = event.response
        if response is None:
            raise RuntimeError("the stream ended without response.completed")
        if response.status == "failed":
            raise RuntimeError(f"response.failed: {response.error}")
        self._history.add(*(item.model_dump(exclude_none=True) for item in response.output))
        texts, thoughts, calls = [], [], []
        for item in response.output:
            if item.type == "message":
                texts += [p.text for p in item.content if p.type == "output_text"]
            elif item.type == "reasoning":
                thoughts += [p.text for p in item.content or () if p.type == "reasoning_text"]
            elif item.type == "function_call":
                calls.append(ToolCall(item.call_id, item.name, item.arguments))
        usage = response.usage
        details = usage.input_tokens_details if usage else None
        return Answer(
            content="".join(texts),
            reasoning="".join(thoughts),
            calls=calls,
            finish="incomplete" if response.status == "incomplete" else response.status or "",
            prompt_tokens=usage.input_tokens if usage else 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
            completion_tokens=usage.output_tokens if usage else 0,
            ttft=ttft,
            e2e=time.perf_counter() - started,
        )


SESSIONS: dict[str, Callable[[Any, str], ApiSession]] = {
    "chat": ChatSession,
    "messages": MessagesSession,
    "responses": ResponsesSession,
}
"""The session class of each API name (`--api` of bench/agent_session.py)."""

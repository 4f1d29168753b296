"""Anthropic Messages → chat: the conversation (`system`, `messages` and their content blocks).
The mapping and its reasons: `inferplane.apis.anthropic` and docs/api-messages.md.

Every refusal is an `InvalidArgumentError` whose `param` is the JSON path of the fault
(`messages[1].content[0].type`); a block key Anthropic does not define is refused in the edge
field guard's wording ("Unrecognized request argument supplied: messages[0].content[1].foo").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from google.protobuf import json_format, struct_pb2

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.apis._anthropic_ids import call_id_of
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import restore_ints

ERROR_PREFIX: Final = "Error: "
"""Prepended to a `tool_result` with `is_error: true` (chat has no error flag on a tool
message; the model reads the failure in the text)."""
TOOL_LOADED: Final = "Tool loaded: "
"""The text a `tool_reference` block renders as (followed by the tool's name): the model is
told the tool it searched for is now declared (Anthropic does not publish its own wording)."""

_UNRECOGNIZED = "Unrecognized request argument supplied: "
#: A block's keys, per type, as Anthropic defines them for the blocks a text model can take.
_BLOCK_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "tool_reference": frozenset({"type", "tool_name", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}
#: Blocks Anthropic defines that a text-only model cannot serve.
_UNSERVED_BLOCKS: Final = frozenset(
    {
        "image",
        "document",
        "search_result",
        "browser_state",
        "container_upload",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "tool_search_tool_result",
    }
)


def bad(message: str, param: str, code: str = "invalid_value") -> InvalidArgumentError:
    """A 400 naming `param`."""
    return InvalidArgumentError(message, param=param, code=code)


def check_keys(block: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    """A key outside `allowed` is a 400 naming its path (null asks for nothing and passes,
    as at the edge's field guard)."""
    for key, value in block.items():
        if key not in allowed and value is not None:
            param = f"{where}.{key}"
            raise InvalidArgumentError(_UNRECOGNIZED + param, param=param, code="unknown_parameter")


def value(message: struct_pb2.Value | struct_pb2.Struct) -> Any:
    """A `Value` / `Struct` as JSON, integers restored (a Struct holds every number as a
    double)."""
    return restore_ints(json_format.MessageToDict(message))


@dataclasses.dataclass(slots=True)
class References:
    """The `tool_reference` blocks of the conversation: tool name → the path of the first one
    (a deferred tool they name is declared to the model, `_anthropic_tools.declared`)."""

    paths: dict[str, str] = dataclasses.field(default_factory=dict)


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text must be a string", f"{where}.text")
    return text


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """A content value as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content blocks", where)
    for k, block in enumerate(content):
        if not isinstance(block, Mapping):
            raise bad(f"{where}[{k}] must be a content block object", f"{where}[{k}]")
    return content


def _block_type(block: Mapping[str, Any], where: str, allowed: Sequence[str]) -> str:
    kind = block.get("type")
    if isinstance(kind, str) and kind in _UNSERVED_BLOCKS:
        raise bad(
            f"{where}: '{kind}' blocks are not supported: this model takes text only",
            f"{where}.type",
            code="unsupported_content",
        )
    if not isinstance(kind, str) or kind not in allowed:
        raise bad(
            f"{where}.type must be one of {', '.join(allowed)}; got {kind!r}", f"{where}.type"
        )
    check_keys(block, _BLOCK_KEYS[kind], where)
    return kind


def text_parts(
    content: Any, where: str, references: References | None = None
) -> list[dict[str, str]]:
    """Text blocks (a `system` prompt, a system message, a `tool_result`'s content, which
    may also hold `tool_reference` blocks: `references`) → chat text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    allowed = ("text",) if references is None else ("text", "tool_reference")
    parts = []
    for k, block in enumerate(_blocks(content, where)):
        at = f"{where}[{k}]"
        if _block_type(block, at, allowed) == "tool_reference":
            name = block.get("tool_name")
            if not isinstance(name, str) or not name:
                raise bad(f"{at}.tool_name must be a non-empty string", f"{at}.tool_name")
            assert references is not None
            references.paths.setdefault(name, f"{at}.tool_name")
            parts.append({"type": "text", "text": TOOL_LOADED + name})
        else:
            parts.append({"type": "text", "text": _text(block, at)})
    return parts


def system(request: apb.MessagesRequest) -> list[dict[str, Any]]:
    """The `system` prompt as one system message (none when absent or empty)."""
    if not request.HasField("system"):
        return []
    prompt = value(request.system)
    if prompt is None or prompt == "" or prompt == []:
        return []
    return [{"role": "system", "content": text_parts(prompt, "system")}]


def _tool_result(block: Mapping[str, Any], where: str, references: References) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise bad(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
    content = block.get("content")
    parts = [] if content is None else text_parts(content, f"{where}.content", references)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"{where}.is_error must be a boolean", f"{where}.is_error")
    if is_error:
        parts = [{"type": "text", "text": ERROR_PREFIX}, *parts]
    return {"role": "tool", "tool_call_id": call_id_of(tool_use_id), "content": parts}


def _user(content: Any, where: str, references: References) -> list[dict[str, Any]]:
    """A user message → chat messages in order: runs of text → one user message each, every
    `tool_result` → one tool message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for k, block in enumerate(_blocks(content, where)):
        at = f"{where}[{k}]"
        kind = _block_type(block, at, ("text", "tool_result"))
        if kind == "text":
            texts.append({"type": "text", "text": _text(block, at)})
            continue
        if texts:
            out.append({"role": "user", "content": texts})
            texts = []
        out.append(_tool_result(block, at, references))
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


KeyOrders = Mapping[str, Sequence[str]]
"""Tool name → the order its `input` keys are written in (`key_orders`)."""


def key_orders(tools: Sequence[Any]) -> dict[str, list[str]]:
    """For each declared tool (`_anthropic_tools.Tool`), the order of its arguments: the
    `required` list first (a JSON array: its order survives the proto), then the other
    declared properties.

    Why: the transcoder parses a `tool_use.input` object into a `google.protobuf.Struct`, which
    keeps no key order (a map), so the history's arguments would render in protobuf's hash
    order, unlike what the model wrote. Models write arguments in the schema's declared order,
    which `required` lists in the common case, so the rendered history matches the model's own
    output there (and is deterministic everywhere)."""
    return {tool.name: tool.argument_order() for tool in tools}


def _ordered(arguments: Mapping[str, Any], order: Sequence[str]) -> dict[str, Any]:
    known = {k: arguments[k] for k in order if k in arguments}
    return {**known, **{k: v for k, v in arguments.items() if k not in known}}


def _tool_call(block: Mapping[str, Any], where: str, orders: KeyOrders) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.id must be a non-empty string", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
    if not isinstance(arguments, Mapping):
        raise bad(f"{where}.input must be an object", f"{where}.input")
    return {
        "id": call_id_of(call_id),
        "type": "function",
        "function": {
            "name": name,
            "arguments": json.dumps(_ordered(arguments, orders.get(name, ())), ensure_ascii=False),
        },
    }


def _assistant(content: Any, where: str, orders: KeyOrders) -> dict[str, Any]:
    """An assistant message → one chat message: its text, `tool_use` blocks as tool calls,
    `thinking` as reasoning."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(_blocks(content, where)):
        at = f"{where}[{k}]"
        kind = _block_type(block, at, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise bad(f"{at}.thinking must be a string", f"{at}.thinking")
            reasoning.append(thinking)
        elif kind == "tool_use":
            calls.append(_tool_call(block, at, orders))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def messages(
    request: apb.MessagesRequest, orders: KeyOrders, references: References
) -> list[dict[str, Any]]:
    """`messages` → chat messages: `user` (text runs and tool results), `assistant` (text,
    tool calls, reasoning), `system` (a system message in place: Claude Code sends its
    environment so); `tool_reference` blocks are collected into `references`.

    Raises:
        InvalidArgumentError: no messages, a role or block the API does not define or the
            model cannot serve, a malformed block, or prefill (a last assistant message).
    """
    if not request.messages:
        raise bad("messages: at least one message is required", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        content = value(message.content) if message.HasField("content") else None
        if content is None:
            raise bad(f"{where}.content is required", f"{where}.content")
        if message.role == "user":
            out.extend(_user(content, f"{where}.content", references))
        elif message.role == "assistant":
            out.append(_assistant(content, f"{where}.content", orders))
        elif message.role == "system":
            out.append({"role": "system", "content": text_parts(content, f"{where}.content")})
        else:
            raise bad(
                f"{where}.role must be 'user', 'assistant' or 'system'; got {message.role!r}",
                f"{where}.role",
            )
    if request.messages[-1].role == "assistant":
        raise bad(
            "a last message from the assistant (prefill) is not supported: the conversation "
            "must end with a user message",
            f"messages[{len(request.messages) - 1}].role",
            code="unsupported_parameter",
        )
    return out

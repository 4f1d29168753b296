"""Anthropic's Messages API ⇄ the platform's chat request: the request conversion the endpoint
picker and the replica share, the ids, the stop reasons and the error shape.

`to_chat(request)` turns a `MessagesRequest` (proto/inferplane/inference/v1/anthropic.proto) into
the `ChatCompletionRequest` the chat pipeline validates, renders and generates from:

- `system` (a string or text blocks) → one system message (blocks joined as text parts);
- `text` blocks → text; `tool_use` → the assistant's `tool_calls` (its `toolu_…` id kept: the
  renderer maps history ids onto the family's own form, Kimi's `functions.NAME:IDX`);
  `tool_result` (a string or text blocks; `is_error` prefixes the text with `ERROR_PREFIX`)
  → a `tool` message; `thinking` in history → the assistant's `reasoning_content`;
  `redacted_thinking` → dropped (its data is Anthropic's encryption, no text);
- `tools` (custom tools: `name`, `description`, `input_schema`) → functions; server tools
  (a `type` other than "custom") → 400;
- `tool_choice` auto / any / tool / none → "auto" / "required" / the named function / "none";
  `disable_parallel_tool_use` → `parallel_tool_calls: false`;
- `thinking` enabled or adaptive → thinking on, disabled or absent → off (as Anthropic: no
  `thinking`, no thinking blocks), through `reasoning_effort` ("high" / "none"), which the
  replica maps onto the model family's template keyword;
- `max_tokens` → `max_completion_tokens` (thinking included, as Anthropic counts it),
  `stop_sequences` → `stop`, `temperature` (0..1), `top_p`, `top_k`;
  `metadata.user_id` → `user` (session affinity; an opaque string: Claude Code sends JSON);
  `output_config.format` (`json_schema`) → `response_format`.

Accepted and ignored (docs/api-messages.md says why): `cache_control` (top level, or on any
block or tool), `output_config.effort`, `context_management`, `service_tier`, `speed`,
`diagnostics`, `thinking.budget_tokens` (checked as Anthropic checks it), a block's
`citations: null`. Refused with a 400 naming the key's path
(`InvalidArgumentError`, which the edge answers as Anthropic's `invalid_request_error`):
`image`, `document` and other non-text blocks, server tools, a block key Anthropic does not
define ("Unrecognized request argument supplied: messages[0].content[1].foo", the edge's own
wording for the keys it checks), prefill (a last message from the assistant).

Source of the request and response shapes: Anthropic's Messages API reference
(https://docs.anthropic.com/en/api/messages) and streaming guide
(https://docs.anthropic.com/en/docs/build-with-claude/streaming).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Final

from google.protobuf import json_format, struct_pb2

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.runtime import InvalidArgumentError
from inferplane.wire import apis, restore_ints

MESSAGE_ID_PREFIX: Final = "msg_"
TOOL_USE_ID_PREFIX: Final = "toolu_"
ERROR_PREFIX: Final = "Error: "
"""Prepended to a `tool_result` with `is_error: true` (chat has no error flag on a tool
message; the model reads the failure in the text)."""

STOP_REASONS: Final[Mapping[str, str]] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}
"""The chat pipeline's finish reason → Anthropic's `stop_reason` (a matched stop sequence is
`stop_sequence`: `stop_reason`)."""
STOP_SEQUENCE: Final = "stop_sequence"

#: Server tools run by Anthropic itself (web search, code execution, computer use, ...): the
#: platform runs no tools. Every tool `type` but this one is a server tool.
CUSTOM_TOOL: Final = "custom"
THINKING_TYPES: Final = ("enabled", "disabled", "adaptive")
THINKING_DISPLAYS: Final = ("summarized", "omitted")
EFFORTS: Final = ("low", "medium", "high", "max")
SERVICE_TIERS: Final = ("auto", "standard_only")
SPEEDS: Final = ("standard", "fast")
CACHE_CONTROL_TYPES: Final = ("ephemeral",)
MIN_THINKING_BUDGET: Final = 1024  # Anthropic refuses a smaller budget_tokens

_UNRECOGNIZED = "Unrecognized request argument supplied: "
#: A block's keys, per type, as Anthropic defines them for the blocks a text model can take.
_BLOCK_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}
#: Blocks Anthropic defines that a text-only model cannot serve.
_UNSERVED_BLOCKS: Final = frozenset(
    {
        "image",
        "document",
        "search_result",
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
_TOOL_KEYS: Final = frozenset(
    {"type", "name", "description", "input_schema", "cache_control", "strict"}
)
#: Tool keys that change only how a call is streamed, not what the model sees.
_TOOL_TRANSPORT_KEYS: Final = frozenset({"eager_input_streaming"})


def new_message_id() -> str:
    """A fresh `msg_…` id (24 random hex digits)."""
    return MESSAGE_ID_PREFIX + secrets.token_hex(12)


def new_tool_use_id() -> str:
    """A fresh `toolu_…` id (24 random hex digits), for one tool call the model made. The
    client sends it back in `tool_use.id` and `tool_result.tool_use_id`; the renderer maps it
    onto the call's place in the history (Kimi: `functions.NAME:IDX`, counted over the
    conversation as the model numbered it), so the id needs to carry nothing."""
    return TOOL_USE_ID_PREFIX + secrets.token_hex(12)


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    """Anthropic's `stop_reason` for the chat pipeline's `finish_reason` ("stop", "length",
    "tool_calls"), `stop_sequence` when a stop sequence ended the output."""
    if stop_sequence is not None and finish_reason == "stop":
        return STOP_SEQUENCE
    return STOP_REASONS.get(finish_reason, "end_turn")


# -- errors ------------------------------------------------------------------------------------

ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""HTTP status → Anthropic's error `type` (https://docs.anthropic.com/en/api/errors); any
other 4xx is `invalid_request_error`, any other 5xx `api_error`."""
OVERLOADED_STATUS: Final = 529
"""Anthropic's status for `overloaded_error`, where OpenAI's shape says 503."""


def is_anthropic_path(path: str) -> bool:
    """Whether a REST path (query string allowed) is Anthropic's: `apis.ANTHROPIC_PATH_PREFIX`
    itself or below it (`/v1/messages`, `/v1/messages/count_tokens`, not `/v1/messagesx`)."""
    base = path.split("?", 1)[0].split("#", 1)[0]
    prefix = apis.ANTHROPIC_PATH_PREFIX
    return base == prefix or base.startswith(prefix + "/")


def error_status(http_status: int) -> int:
    """The HTTP status of an error on an Anthropic path: 529 for 503, else unchanged."""
    return OVERLOADED_STATUS if http_status == 503 else http_status


def error_type(http_status: int) -> str:
    """Anthropic's error `type` for an HTTP status (`ERROR_TYPES`)."""
    known = ERROR_TYPES.get(http_status)
    if known is not None:
        return known
    return "api_error" if http_status >= 500 else "invalid_request_error"


def error_body(http_status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": error_type(http_status), "message": message}}


# -- the request ---------------------------------------------------------------------------------


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidArgumentError:
    return InvalidArgumentError(message, param=param, code=code)


def _unrecognized(param: str) -> InvalidArgumentError:
    return InvalidArgumentError(_UNRECOGNIZED + param, param=param, code="unknown_parameter")


def _value(value: struct_pb2.Value) -> Any:
    return restore_ints(json_format.MessageToDict(value))


def _check_keys(block: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    """A key outside `allowed` is a 400 naming its path (null asks for nothing and passes,
    as at the edge's field guard)."""
    for key, value in block.items():
        if key not in allowed and value is not None:
            raise _unrecognized(f"{where}.{key}")


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text must be a string", f"{where}.text")
    return text


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """A content value as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content blocks", where)
    for k, block in enumerate(content):
        if not isinstance(block, Mapping):
            raise _bad(f"{where}[{k}] must be a content block object", f"{where}[{k}]")
    return content


def _block_type(block: Mapping[str, Any], where: str, allowed: Sequence[str]) -> str:
    kind = block.get("type")
    if isinstance(kind, str) and kind in _UNSERVED_BLOCKS:
        raise _bad(
            f"{where}: '{kind}' blocks are not supported: this model takes text only",
            f"{where}.type",
            code="unsupported_content",
        )
    if not isinstance(kind, str) or kind not in allowed:
        raise _bad(
            f"{where}.type must be one of {', '.join(allowed)}; got {kind!r}", f"{where}.type"
        )
    _check_keys(block, _BLOCK_KEYS[kind], where)
    return kind


def _text_only(content: Any, where: str) -> list[dict[str, str]]:
    """Text blocks (a `system` prompt, a `tool_result`'s content) → chat text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for k, block in enumerate(_blocks(content, where)):
        at = f"{where}[{k}]"
        _block_type(block, at, ("text",))
        parts.append({"type": "text", "text": _text(block, at)})
    return parts


def _system(request: apb.MessagesRequest) -> list[dict[str, Any]]:
    if not request.HasField("system"):
        return []
    system = _value(request.system)
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text_only(system, "system")}]


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _bad(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
    content = block.get("content")
    parts = [] if content is None else _text_only(content, f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _bad(f"{where}.is_error must be a boolean", f"{where}.is_error")
    if is_error:
        parts = [{"type": "text", "text": ERROR_PREFIX}, *parts]
    return {"role": "tool", "tool_call_id": tool_use_id, "content": parts}


def _user(content: Any, where: str) -> list[dict[str, Any]]:
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
        out.append(_tool_result(block, at))
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(content: Any, where: str, orders: _KeyOrders) -> dict[str, Any]:
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
                raise _bad(f"{at}.thinking must be a string", f"{at}.thinking")
            reasoning.append(thinking)
        elif kind == "tool_use":
            calls.append(_tool_call(block, at, orders))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning and any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


_KeyOrders = Mapping[str, Sequence[str]]
"""Tool name → the order its `input` keys are written in (`_key_orders`)."""


def _key_orders(tools: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """For each declared tool, the order of its arguments: the `required` list first (a JSON
    array: its order survives the proto), then the other declared properties.

    Why: the transcoder parses a `tool_use.input` object into a `google.protobuf.Struct`, which
    keeps no key order (a map), so the history's arguments would render in protobuf's hash
    order, unlike what the model wrote. Models write arguments in the schema's declared order,
    which `required` lists in the common case, so the rendered history matches the model's own
    output there (and is deterministic everywhere)."""
    orders: dict[str, list[str]] = {}
    for tool in tools:
        function = tool["function"]
        schema = function.get("parameters") or {}
        required = [k for k in schema.get("required") or () if isinstance(k, str)]
        rest = [k for k in schema.get("properties") or {} if k not in required]
        orders[function["name"]] = required + rest
    return orders


def _ordered(arguments: Mapping[str, Any], order: Sequence[str]) -> dict[str, Any]:
    known = {k: arguments[k] for k in order if k in arguments}
    return {**known, **{k: v for k, v in arguments.items() if k not in known}}


def _tool_call(block: Mapping[str, Any], where: str, orders: _KeyOrders) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.id must be a non-empty string", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name must be a non-empty string", f"{where}.name")
    if not isinstance(arguments, Mapping):
        raise _bad(f"{where}.input must be an object", f"{where}.input")
    return {
        "id": call_id,
        "type": "function",
        "function": {
            "name": name,
            "arguments": json.dumps(_ordered(arguments, orders.get(name, ())), ensure_ascii=False),
        },
    }


def _messages(request: apb.MessagesRequest, orders: _KeyOrders) -> list[dict[str, Any]]:
    if not request.messages:
        raise _bad("messages: at least one message is required", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        content = _value(message.content) if message.HasField("content") else None
        if content is None:
            raise _bad(f"{where}.content is required", f"{where}.content")
        if message.role == "user":
            out.extend(_user(content, f"{where}.content"))
        elif message.role == "assistant":
            out.append(_assistant(content, f"{where}.content", orders))
        else:
            raise _bad(
                f"{where}.role must be 'user' or 'assistant'; got {message.role!r}",
                f"{where}.role",
            )
    if request.messages[-1].role == "assistant":
        raise _bad(
            "a last message from the assistant (prefill) is not supported: the conversation "
            "must end with a user message",
            f"messages[{len(request.messages) - 1}].role",
            code="unsupported_parameter",
        )
    return out


def _tools(request: apb.MessagesRequest) -> list[dict[str, Any]]:
    tools = []
    for i, struct in enumerate(request.tools):
        where = f"tools[{i}]"
        tool = restore_ints(json_format.MessageToDict(struct))
        kind = tool.get("type")
        if kind is not None and kind != CUSTOM_TOOL:
            raise _bad(
                f"{where}.type: server tool {kind!r} is not supported: the platform runs no "
                "tools; declare a custom tool (name, description, input_schema) and run it "
                "in the client",
                f"{where}.type",
                code="unsupported_tool",
            )
        _check_keys(tool, _TOOL_KEYS | _TOOL_TRANSPORT_KEYS, where)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name must be a non-empty string", f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise _bad(
                f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema"
            )
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _bad(f"{where}.description must be a string", f"{where}.description")
            function["description"] = description
        strict = tool.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise _bad(f"{where}.strict must be a boolean", f"{where}.strict")
            function["strict"] = strict
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: apb.AnthropicToolChoice, body: dict[str, Any]) -> None:
    kind = choice.type
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool":
        if not choice.name:
            raise _bad("tool_choice.name is required with type 'tool'", "tool_choice.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        raise _bad(
            f"tool_choice.type must be one of auto, any, tool, none; got {kind!r}",
            "tool_choice.type",
        )
    if kind != "tool" and choice.HasField("name"):
        raise _bad("tool_choice.name is only allowed with type 'tool'", "tool_choice.name")
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False


def thinking_on(request: apb.MessagesRequest) -> bool:
    """Whether the request asks for thinking: `thinking.type` "enabled" or "adaptive"."""
    return request.HasField("thinking") and request.thinking.type in ("enabled", "adaptive")


def thinking_shown(request: apb.MessagesRequest) -> bool:
    """Whether thinking text is returned: not with `thinking.display: "omitted"` (the
    thinking blocks then come with empty text)."""
    return not (request.HasField("thinking") and request.thinking.display == "omitted")


def _thinking(request: apb.MessagesRequest, max_tokens: int | None) -> str:
    """`reasoning_effort` for the request's `thinking` ("high": on, "none": off)."""
    if not request.HasField("thinking"):
        return "none"
    thinking = request.thinking
    if thinking.type not in THINKING_TYPES:
        raise _bad(
            f"thinking.type must be one of {', '.join(THINKING_TYPES)}; got {thinking.type!r}",
            "thinking.type",
        )
    if thinking.HasField("display") and thinking.display not in THINKING_DISPLAYS:
        raise _bad(
            f"thinking.display must be one of {', '.join(THINKING_DISPLAYS)}", "thinking.display"
        )
    if thinking.type == "enabled":
        if not thinking.HasField("budget_tokens"):
            raise _bad(
                "thinking.budget_tokens is required with type 'enabled'", "thinking.budget_tokens"
            )
        budget = thinking.budget_tokens
        if budget < MIN_THINKING_BUDGET or (max_tokens is not None and budget >= max_tokens):
            raise _bad(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than "
                "max_tokens",
                "thinking.budget_tokens",
            )
    elif thinking.HasField("budget_tokens"):
        raise _bad(
            "thinking.budget_tokens is only allowed with type 'enabled'", "thinking.budget_tokens"
        )
    return "none" if thinking.type == "disabled" else "high"


def _output_config(config: apb.AnthropicOutputConfig, body: dict[str, Any]) -> None:
    if config.HasField("effort") and config.effort not in EFFORTS:
        raise _bad(
            f"output_config.effort must be one of {', '.join(EFFORTS)}", "output_config.effort"
        )
    if not config.HasField("format"):
        return
    fmt = restore_ints(json_format.MessageToDict(config.format))
    _check_keys(fmt, frozenset({"type", "schema"}), "output_config.format")
    if fmt.get("type") != "json_schema":
        raise _bad("output_config.format.type must be 'json_schema'", "output_config.format.type")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise _bad(
            "output_config.format.schema must be a JSON schema object",
            "output_config.format.schema",
        )
    body["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


def to_chat(request: apb.MessagesRequest, *, count_only: bool = False) -> pb.ChatCompletionRequest:
    """The chat request the replica renders and generates for an Anthropic Messages request
    (the mapping: the module docstring). `count_only` (count_tokens) does not need
    `max_tokens`.

    Raises:
        InvalidArgumentError: a field Anthropic requires is missing, has a wrong value, or
            asks for something the platform does not serve; `param` is the field's path
            (`messages[1].content[0].type`, `tools[2].type`).
    """
    if not request.model:
        raise _bad("model: field required", "model", code="missing_required_parameter")
    max_tokens: int | None = request.max_tokens if request.HasField("max_tokens") else None
    if max_tokens is None and not count_only:
        raise _bad("max_tokens: field required", "max_tokens", code="missing_required_parameter")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens must be at least 1", "max_tokens")
    tools = _tools(request)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": _system(request) + _messages(request, _key_orders(tools)),
        "reasoning_effort": _thinking(request, max_tokens),
    }
    if max_tokens is not None and not count_only:
        body["max_completion_tokens"] = max_tokens
    if tools:
        body["tools"] = tools
    if request.HasField("tool_choice"):
        _tool_choice(request.tool_choice, body)
    if request.stop_sequences:
        for k, stop in enumerate(request.stop_sequences):
            if not stop:
                raise _bad("stop_sequences must not hold an empty string", f"stop_sequences[{k}]")
        body["stop"] = list(request.stop_sequences)
    if request.HasField("temperature"):
        if not 0.0 <= request.temperature <= 1.0:
            raise _bad("temperature must be between 0 and 1", "temperature")
        body["temperature"] = request.temperature
    if request.HasField("top_p"):
        body["top_p"] = request.top_p
    if request.HasField("top_k"):
        body["top_k"] = request.top_k
    if request.metadata.HasField("user_id"):
        body["user"] = request.metadata.user_id
    if request.HasField("output_config"):
        _output_config(request.output_config, body)
    if request.HasField("service_tier") and request.service_tier not in SERVICE_TIERS:
        raise _bad(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
    if request.HasField("speed") and request.speed not in SPEEDS:
        raise _bad(f"speed must be one of {', '.join(SPEEDS)}", "speed")
    if request.HasField("cache_control"):
        cache = json_format.MessageToDict(request.cache_control)
        _check_keys(cache, frozenset({"type", "ttl"}), "cache_control")
        if cache.get("type") not in CACHE_CONTROL_TYPES:
            raise _bad("cache_control.type must be 'ephemeral'", "cache_control.type")
    if request.stream:
        body["stream"] = True
    chat = pb.ChatCompletionRequest()
    try:
        json_format.ParseDict(body, chat)
    except json_format.ParseError as exc:  # a value of the wrong type inside a block
        raise _bad(f"invalid request: {exc}", "messages") from exc
    return chat


def count_to_chat(request: apb.MessagesRequest) -> pb.ChatCompletionRequest:
    """`to_chat` for `/v1/messages/count_tokens` (no `max_tokens`)."""
    return to_chat(request, count_only=True)

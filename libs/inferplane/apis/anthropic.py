"""Anthropic's Messages API ⇄ the platform's chat request: the request conversion the endpoint
picker and the replica share, the ids, the stop reasons and the error shape.

`to_chat(request)` turns a `MessagesRequest` (proto/inferplane/inference/v1/anthropic.proto) into
the `ChatCompletionRequest` the chat pipeline validates, renders and generates from:

- `system` (a string or text blocks) → one system message (blocks joined as text parts); a
  `system` message in `messages` → a system message in place;
- `text` blocks → text; `tool_use` → the assistant's `tool_calls` (the model's own call id,
  Kimi's `functions.NAME:IDX`, read back out of the `toolu_…` id this platform gave the call,
  `_anthropic_ids`; another id is kept and the renderer numbers it in the family's form);
  `tool_result` (a string or text blocks; `is_error` prefixes the text with `ERROR_PREFIX`)
  → a `tool` message; `thinking` in history → the assistant's `reasoning_content`;
  `redacted_thinking` → dropped (its data is Anthropic's encryption, no text);
- `tools` (custom tools: `name`, `description`, `input_schema`) → functions; server tools
  (a `type` other than "custom") → 400; deferred tools (`defer_loading`) declared once a
  `tool_reference` names them (`_anthropic_tools`);
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

The conversation's blocks are `_anthropic_content`'s, the tools `_anthropic_tools`'. Source of
the request and response shapes: Anthropic's Messages API reference
(https://docs.anthropic.com/en/api/messages) and streaming guide
(https://docs.anthropic.com/en/docs/build-with-claude/streaming).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from google.protobuf import json_format

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.apis import _anthropic_content as _content
from inferplane.apis import _anthropic_tools as _tools
from inferplane.apis._anthropic_content import ERROR_PREFIX, TOOL_LOADED, bad, check_keys, value
from inferplane.apis._anthropic_ids import (
    CARRIED,
    MAX_CARRIED_ID,
    TOOL_USE_ID_PREFIX,
    call_id_of,
    tool_use_id,
)
from inferplane.apis._anthropic_tools import CUSTOM_TOOL, EXAMPLES_HEADING
from inferplane.wire import apis

__all__ = [
    "CACHE_CONTROL_TYPES",
    "CARRIED",
    "CUSTOM_TOOL",
    "EFFORTS",
    "ERROR_PREFIX",
    "ERROR_TYPES",
    "EXAMPLES_HEADING",
    "MAX_CARRIED_ID",
    "MESSAGE_ID_PREFIX",
    "MIN_THINKING_BUDGET",
    "OVERLOADED_STATUS",
    "SERVICE_TIERS",
    "SPEEDS",
    "STOP_REASONS",
    "STOP_SEQUENCE",
    "THINKING_DISPLAYS",
    "THINKING_TYPES",
    "TOOL_LOADED",
    "TOOL_USE_ID_PREFIX",
    "call_id_of",
    "count_to_chat",
    "error_body",
    "error_status",
    "error_type",
    "is_anthropic_path",
    "stop_reason",
    "thinking_on",
    "thinking_shown",
    "to_chat",
    "tool_use_id",
]

MESSAGE_ID_PREFIX: Final = "msg_"
"""A message's id is this and the replica's request id (hex)."""

STOP_REASONS: Final[Mapping[str, str]] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}
"""The chat pipeline's finish reason → Anthropic's `stop_reason` (a matched stop sequence is
`stop_sequence`: `stop_reason`)."""
STOP_SEQUENCE: Final = "stop_sequence"

THINKING_TYPES: Final = ("enabled", "disabled", "adaptive")
THINKING_DISPLAYS: Final = ("summarized", "omitted")
EFFORTS: Final = ("low", "medium", "high", "max")
SERVICE_TIERS: Final = ("auto", "standard_only")
SPEEDS: Final = ("standard", "fast")
CACHE_CONTROL_TYPES: Final = ("ephemeral",)
MIN_THINKING_BUDGET: Final = 1024  # Anthropic refuses a smaller budget_tokens


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
        raise bad(
            f"thinking.type must be one of {', '.join(THINKING_TYPES)}; got {thinking.type!r}",
            "thinking.type",
        )
    if thinking.HasField("display") and thinking.display not in THINKING_DISPLAYS:
        raise bad(
            f"thinking.display must be one of {', '.join(THINKING_DISPLAYS)}", "thinking.display"
        )
    if thinking.type == "enabled":
        if not thinking.HasField("budget_tokens"):
            raise bad(
                "thinking.budget_tokens is required with type 'enabled'", "thinking.budget_tokens"
            )
        budget = thinking.budget_tokens
        if budget < MIN_THINKING_BUDGET or (max_tokens is not None and budget >= max_tokens):
            raise bad(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than "
                "max_tokens",
                "thinking.budget_tokens",
            )
    elif thinking.HasField("budget_tokens"):
        raise bad(
            "thinking.budget_tokens is only allowed with type 'enabled'", "thinking.budget_tokens"
        )
    return "none" if thinking.type == "disabled" else "high"


def _output_config(config: apb.AnthropicOutputConfig, body: dict[str, Any]) -> None:
    if config.HasField("effort") and config.effort not in EFFORTS:
        raise bad(
            f"output_config.effort must be one of {', '.join(EFFORTS)}", "output_config.effort"
        )
    if not config.HasField("format"):
        return
    fmt = value(config.format)
    check_keys(fmt, frozenset({"type", "schema"}), "output_config.format")
    if fmt.get("type") != "json_schema":
        raise bad("output_config.format.type must be 'json_schema'", "output_config.format.type")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise bad(
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
        raise bad("model: field required", "model", code="missing_required_parameter")
    max_tokens: int | None = request.max_tokens if request.HasField("max_tokens") else None
    if max_tokens is None and not count_only:
        raise bad("max_tokens: field required", "max_tokens", code="missing_required_parameter")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens must be at least 1", "max_tokens")
    all_tools = _tools.tools(request)
    references = _content.References()
    orders = _content.key_orders(all_tools)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": _content.system(request) + _content.messages(request, orders, references),
        "reasoning_effort": _thinking(request, max_tokens),
    }
    if max_tokens is not None and not count_only:
        body["max_completion_tokens"] = max_tokens
    if request.HasField("tool_choice"):
        _tools.tool_choice(request.tool_choice, body)
    if request.stop_sequences:
        for k, stop in enumerate(request.stop_sequences):
            if not stop:
                raise bad("stop_sequences must not hold an empty string", f"stop_sequences[{k}]")
        body["stop"] = list(request.stop_sequences)
    if request.HasField("temperature"):
        if not 0.0 <= request.temperature <= 1.0:
            raise bad("temperature must be between 0 and 1", "temperature")
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
        raise bad(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
    if request.HasField("speed") and request.speed not in SPEEDS:
        raise bad(f"speed must be one of {', '.join(SPEEDS)}", "speed")
    if request.HasField("cache_control"):
        cache = json_format.MessageToDict(request.cache_control)
        check_keys(cache, frozenset({"type", "ttl"}), "cache_control")
        if cache.get("type") not in CACHE_CONTROL_TYPES:
            raise bad("cache_control.type must be 'ephemeral'", "cache_control.type")
    if request.stream:
        body["stream"] = True
    chat = pb.ChatCompletionRequest()
    try:
        json_format.ParseDict(body, chat)
        chat.tools.extend(_tools.declared(all_tools, references))
    except json_format.ParseError as exc:  # a value of the wrong type inside a block
        raise bad(f"invalid request: {exc}", "messages") from exc
    return chat


def count_to_chat(request: apb.MessagesRequest) -> pb.ChatCompletionRequest:
    """`to_chat` for `/v1/messages/count_tokens` (no `max_tokens`)."""
    return to_chat(request, count_only=True)

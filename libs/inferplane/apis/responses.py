"""OpenAI Responses request (+ the stored conversation it continues) → the chat request the
replica's chat pipeline renders: the one conversion the endpoint picker and the replica share.

    from inferplane.apis import responses
    converted = responses.convert(request)                  # ResponseRequest (proto)
    converted.chat                                          # inference_pb2.ChatCompletionRequest
    converted.items                                         # the turn's input items, normalised

Input items (OpenAI's `ResponseInputItem`s; a string `input` is one user message):

- `message` (roles `user`, `system`, `developer`, `assistant`; content a string or parts
  `input_text` / `output_text` / `text`, an assistant's `refusal`) → a chat message;
- `reasoning` → the next assistant message's `reasoning_content`: its `content`
  (`reasoning_text` parts), else its `summary` (`summary_text` parts), else the
  `encrypted_content` this platform wrote (`REASONING_PREFIX` + base64 of the text: readable,
  NOT encrypted; an open model has no secret reasoning to hide). Another provider's encrypted
  reasoning cannot be read: a 400 naming it, never a silently shorter history;
- `function_call` (`call_id`, `name`, `arguments`, optional `namespace`) → the assistant
  message's `tool_calls` (the call id is the chat tool call's id, so it round-trips; a call
  with a `namespace` is named `flat_name(namespace, name)`, as the model wrote it);
  consecutive reasoning, assistant message and function call items form ONE assistant turn,
  as the model produced them;
- `function_call_output` (`call_id`, `output`: a string or `input_text` parts) → a `tool`
  message.

Tools: function tools are flat (`{type, name, description, parameters, strict}`) → chat's
nested form. A `namespace` tool (`{type: namespace, name, description, tools: [...]}`: Codex
CLI puts each MCP server's tools in one, `mcp__weather` holding `get_weather`, and its
sub-agent tools in `multi_agent_v1`) offers each of its function tools flattened, named
`flat_name(namespace, name)` = `mcp__weather__get_weather`, with its own description and
parameters; `Converted.namespaced` maps the flat name back, and the replica answers the
model's call of it as a `function_call` item with `name` = the inner name and `namespace` =
the namespace (as OpenAI does; Codex routes the call by it). Non-function entries of a
namespace (`custom` tools) are left out, as the whole namespace was before. Accepted and
ignored, because Codex CLI sends it by default and refusing it would refuse Codex:
`web_search` / `web_search_preview` (the platform runs no search, so the model is not offered
one and never calls it). Every other built-in tool is a 400 naming `tools[i].type`.

Other fields: `instructions` → a first `system` message; `tool_choice` (`none`, `auto`,
`required`, `{type: function, name}`, `{type: function, name, namespace}` for a namespaced
tool, which its flat name also names); `parallel_tool_calls`; `max_output_tokens` →
`max_completion_tokens`; `temperature`; `top_p`; `reasoning.effort` → `reasoning_effort`
(thinking on or off, `pipeline/requests.py`); `text.format` `json_schema` / `json_object` →
`response_format`; `prompt_cache_key`, else `user`, else `safety_identifier` → chat's `user`
(session affinity); `metadata`. The refusals, the accepted-and-ignored fields and why are in
docs/api-responses.md; each refusal is an `InvalidArgumentError` whose `param` is the path.

The picker converts without the stored conversation (`previous_response_id` is loaded by the
replica, which alone talks to the store): it decides on the new turn's messages.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from google.protobuf import json_format

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import responses_pb2 as rpb
from inferplane.apis import _responses_tools as _tools
from inferplane.apis._responses_tools import NAMESPACE_SEPARATOR, flat_name
from inferplane.wire import chat_request_from_dict, restore_ints

__all__ = [
    "INCLUDE_ENCRYPTED_REASONING",
    "NAMESPACE_SEPARATOR",
    "REASONING_PREFIX",
    "Converted",
    "convert",
    "decode_reasoning",
    "encode_reasoning",
    "flat_name",
    "request_to_dict",
    "settings_json",
    "to_chat",
]

REASONING_PREFIX: Final = "inferplane.reasoning.v1:"
"""How this platform's `encrypted_content` of a reasoning item starts: then base64 of the
reasoning text (UTF-8). Readable by anyone: not encrypted, only opaque to the client."""
INCLUDE_ENCRYPTED_REASONING: Final = "reasoning.encrypted_content"
"""The `include` value that asks for reasoning items' `encrypted_content`."""

_ROLES: Final = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
_EFFORTS: Final = {
    "none": "none",
    "minimal": "minimal",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",  # the model has no finer budget: thinking stays on
}
_SUMMARIES: Final = frozenset({"auto", "concise", "detailed"})
_VERBOSITY: Final = frozenset({"low", "medium", "high"})
#: `include` values about tools or inputs the platform never runs or accepts: nothing to add.
_INCLUDE_IGNORED: Final = frozenset(
    {
        "web_search_call.action.sources",
        "web_search_call.results",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
_SERVICE_TIERS: Final = frozenset({"auto", "default", "flex", "scale", "priority"})
_CACHE_RETENTION: Final = frozenset({"in_memory", "24h"})


_bad = _tools.bad
_unsupported = _tools.unsupported


@dataclasses.dataclass(frozen=True, slots=True)
class Converted:
    """A Responses request as the chat pipeline sees it.

    Attributes:
        chat: the chat request to plan and render (`stream` as the Responses request's).
        items: the request's input items, normalised (a string `input` as one user
            `message` item; each item with its `type`).
        encrypted_reasoning: `include` asked for `reasoning.encrypted_content`.
        body: the Responses request as JSON (ints restored), for echoing its settings
            (`instructions`, `tools`, `metadata`, ...) in the Response object.
        history_messages: how many of `chat`'s messages come before the new turn's
            (the `instructions` system message and the stored conversation's).
        namespaced: each namespaced function's flat name (the name `chat` offers and the
            model calls) → `(namespace, name)`, for writing the model's calls back as
            OpenAI's namespaced `function_call` items.
    """

    chat: pb.ChatCompletionRequest
    items: tuple[dict[str, Any], ...]
    encrypted_reasoning: bool
    body: dict[str, Any]
    history_messages: int = 0
    namespaced: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)


def request_to_dict(request: rpb.ResponseRequest) -> dict[str, Any]:
    """The request as OpenAI JSON: the fields that were set, integral numbers as ints (a
    `google.protobuf.Value` holds every number as a double)."""
    out = json_format.MessageToDict(request, preserving_proto_field_name=True)
    return restore_ints(out)  # type: ignore[no-any-return]


def encode_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content` as this platform writes it (see
    `REASONING_PREFIX`)."""
    return REASONING_PREFIX + base64.b64encode(text.encode()).decode("ascii")


def decode_reasoning(value: str, param: str) -> str:
    """The reasoning text inside `encode_reasoning`'s output.

    Raises:
        InvalidArgumentError: not written by this platform (another provider's encrypted
            reasoning cannot be read), `param` naming it.
    """
    if not value.startswith(REASONING_PREFIX):
        raise _unsupported(
            "this reasoning item's encrypted_content was not produced by this platform and "
            "cannot be read; send its text in 'content' or 'summary', or leave the item out",
            param,
        )
    try:
        return base64.b64decode(value[len(REASONING_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise _bad("encrypted_content is damaged", param) from None


def convert(request: rpb.ResponseRequest, history: Sequence[Mapping[str, Any]] = ()) -> Converted:
    """Converts a Responses request, after `history` (the items of the stored conversation
    behind `previous_response_id`: its input items, then its output items), into a chat
    request.

    Raises:
        InvalidArgumentError: a field the platform refuses or a malformed value, `param` the
            JSON path (`input[2].content[0].type`, `tools[1].type`, `text.format.schema`).
    """
    body = request_to_dict(request)
    _check_refused(body)
    items = _input_items(body.get("input"))
    if not items and not history:
        raise _bad("'input' must not be empty", "input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    # History and the new turn convert apart: the new turn's first message starts where the
    # stored conversation ends (the replica splices the stored token ids there).
    messages += _messages(history, "previous_response_id:item")
    history_messages = len(messages)
    messages += _messages(items, "input")
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages}
    tools, namespaced = _tools.tools(body.get("tools") or [])
    if tools:
        chat["tools"] = tools
    if "tool_choice" in body:
        chat["tool_choice"] = _tools.tool_choice(body["tool_choice"])
    for src, dst in (
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("metadata", "metadata"),
    ):
        if src in body:
            chat[dst] = body[src]
    if body.get("max_output_tokens") == 0:
        raise _bad("'max_output_tokens' must be at least 1", "max_output_tokens")
    effort = _reasoning(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = _text(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    session = body.get("prompt_cache_key") or body.get("user") or body.get("safety_identifier")
    if session:
        chat["user"] = session
    include = _include(body.get("include") or [])
    return Converted(
        chat=chat_request_from_dict(chat),
        items=tuple(items),
        encrypted_reasoning=INCLUDE_ENCRYPTED_REASONING in include,
        body=body,
        history_messages=history_messages,
        namespaced=namespaced,
    )


def to_chat(request: rpb.ResponseRequest) -> pb.ChatCompletionRequest:
    """The chat request the endpoint picker decides on (`Method.to_chat`): the new turn only,
    without the stored conversation behind `previous_response_id` (the picker does not load
    it; session affinity still holds through `prompt_cache_key` / `user`).

    Raises:
        InvalidArgumentError: as `convert`.
    """
    return convert(request).chat


# -- refusals ----------------------------------------------------------------------------------


def _check_refused(body: Mapping[str, Any]) -> None:
    if body.get("background"):
        raise _unsupported("'background' responses are not supported", "background")
    if body.get("conversation") not in (None, ""):
        raise _unsupported(
            "'conversation' is not supported: continue a stored response with "
            "'previous_response_id'",
            "conversation",
        )
    if body.get("prompt"):
        raise _unsupported("stored prompt templates ('prompt') are not supported", "prompt")
    if body.get("top_logprobs"):
        raise _unsupported("'top_logprobs' is not supported on /v1/responses", "top_logprobs")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        if truncation == "auto":
            raise _unsupported(
                "truncation 'auto' is not supported: a prompt that does not fit the context is "
                "refused (context_length_exceeded), never cut",
                "truncation",
            )
        raise _bad("'truncation' must be 'auto' or 'disabled'", "truncation")
    tier = body.get("service_tier")
    if tier is not None and tier not in _SERVICE_TIERS:
        raise _bad(
            f"'service_tier' must be one of {', '.join(sorted(_SERVICE_TIERS))}", "service_tier"
        )
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in _CACHE_RETENTION:
        raise _bad(
            "'prompt_cache_retention' must be 'in_memory' or '24h'", "prompt_cache_retention"
        )
    metadata = body.get("metadata")
    if metadata is not None and not _valid_metadata(metadata):
        raise _bad(
            "'metadata' holds at most 16 pairs of strings (keys up to 64 characters, "
            "values up to 512)",
            "metadata",
        )
    for key in body.get("stream_options") or {}:
        if key != "include_obfuscation":
            raise _bad(f"Unrecognized request argument supplied: {key}", f"stream_options.{key}")


def _valid_metadata(metadata: Mapping[str, Any]) -> bool:
    return len(metadata) <= 16 and all(
        isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
    )


def _include(include: Sequence[Any]) -> set[str]:
    out = set()
    for i, value in enumerate(include):
        if value == "message.output_text.logprobs":
            raise _unsupported("log probabilities are not supported", f"include[{i}]")
        if value != INCLUDE_ENCRYPTED_REASONING and value not in _INCLUDE_IGNORED:
            raise _bad(f"unknown include value {value!r}", f"include[{i}]")
        out.add(value)
    return out


# -- input items -------------------------------------------------------------------------------


def _input_items(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or an array of input items", "input")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _bad("each input item must be an object", f"input[{i}]")
        item = dict(item)
        if "type" not in item and "role" in item:
            item["type"] = "message"  # OpenAI's EasyInputMessage has no type
        out.append(item)
    return out


def _messages(items: Sequence[Mapping[str, Any]], path: str) -> list[dict[str, Any]]:
    """Items → chat messages; consecutive assistant-side items merge into one assistant turn.
    Errors name `path[n]` (`input[2]`)."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
        return turn

    for n, item in enumerate(items):
        where = f"{path}[{n}]"
        kind = item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(
                    "a message's role must be user, system, developer or assistant",
                    f"{where}.role",
                )
            text = _content_text(item.get("content"), f"{where}.content", role)
            if role == "assistant":
                target = assistant()
                target["content"] = (target["content"] or "") + text
            else:
                turn = None
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            target = assistant()
            if target["content"] or target.get("tool_calls"):
                # Reasoning after visible output starts the model's next turn.
                turn = None
                target = assistant()
            target["reasoning_content"] = target.get("reasoning_content", "") + text
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a function_call needs its 'call_id'", f"{where}.call_id")
            if not isinstance(name, str) or not name:
                raise _bad("a function_call needs its 'name'", f"{where}.name")
            if not isinstance(arguments, str):
                raise _bad("'arguments' must be a JSON string", f"{where}.arguments")
            namespace = item.get("namespace")
            if namespace is not None:
                if not isinstance(namespace, str) or not namespace:
                    raise _bad(
                        "a function_call's 'namespace' must be a non-empty string",
                        f"{where}.namespace",
                    )
                name = flat_name(namespace, name)  # as the model wrote it
            assistant().setdefault("tool_calls", []).append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a function_call_output needs its 'call_id'", f"{where}.call_id")
            output = _content_text(item.get("output"), f"{where}.output", "tool")
            turn = None
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "item_reference":
            raise _unsupported(
                "item references are not supported: send the item itself", f"{where}.type"
            )
        else:
            raise _unsupported(
                f"input items of type {kind!r} are not supported (message, function_call, "
                "function_call_output and reasoning are)",
                f"{where}.type",
            )
    return messages


def _content_text(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _unsupported(
                f"content parts of type {kind!r} are not supported: the model reads text "
                "(input_text, output_text)",
                f"{where}[{j}].type",
            )
    return "".join(texts)


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _bad(f"a reasoning item's '{key}' must be an array", f"{where}.{key}")
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type:
                raise _bad(f"expected {part_type} parts", f"{where}.{key}[{j}]")
            texts.append(str(part.get("text", "")))
        if texts:
            return "\n".join(texts) if key == "summary" else "".join(texts)
    encrypted = item.get("encrypted_content")
    if encrypted:
        return decode_reasoning(str(encrypted), f"{where}.encrypted_content")
    return ""


# -- options -------------------------------------------------------------------------------


def _reasoning(reasoning: Mapping[str, Any] | None) -> str | None:
    if not reasoning:
        return None
    for key, value in reasoning.items():
        if key == "effort":
            if value is not None and value not in _EFFORTS:
                raise _bad(
                    f"'reasoning.effort' must be one of {', '.join(_EFFORTS)}", "reasoning.effort"
                )
        elif key in ("summary", "generate_summary"):
            if value is not None and value not in _SUMMARIES:
                raise _bad(
                    f"'reasoning.{key}' must be auto, concise or detailed", f"reasoning.{key}"
                )
        else:
            raise _bad(f"Unrecognized request argument supplied: {key}", f"reasoning.{key}")
    effort = reasoning.get("effort")
    return _EFFORTS[effort] if effort is not None else None


def _text(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    for key, value in text.items():
        if key == "verbosity":
            if value is not None and value not in _VERBOSITY:
                raise _bad("'text.verbosity' must be low, medium or high", "text.verbosity")
        elif key != "format":
            raise _bad(f"Unrecognized request argument supplied: {key}", f"text.{key}")
    fmt = text.get("format")
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema must be a JSON schema object", "text.format.schema")
        spec: dict[str, Any] = {"name": fmt.get("name") or "response", "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        if fmt.get("description"):
            spec["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format.type must be text, json_object or json_schema", "text.format.type")


def settings_json(body: Mapping[str, Any]) -> str:
    """A stable fingerprint source of what renders a prompt's head (instructions, tools,
    tool choice, reasoning): a turn replays a stored prompt's token ids only when its own is
    equal (`inferplane.replica.server.responses`)."""
    keys = ("instructions", "tools", "tool_choice", "reasoning", "text", "parallel_tool_calls")
    return json.dumps({k: body.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))

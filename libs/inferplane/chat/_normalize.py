"""Request → template inputs: the fixes of issue 3 §1, before the chat template sees anything.

Each rule exists because rendering Kimi K2 requests straight through the template broke tool
calling (vLLM blog, "Chasing 100% Accuracy: A Deep Dive into Debugging Kimi K2's Tool-Calling
on vLLM", 2025-10-28; ``docs/kimi.md``): content lists reached the template as Python reprs,
history tool-call ids lacked ``functions.``; and schemas that had crossed a protobuf ``Struct``
rendered ``0.0`` where the client sent ``0``.
The rules that belong to one family's template (Kimi's ids, the thinking keyword, the form of
tool-call arguments) follow the request's ``ChatFamily`` (``inferplane.chat._family``); the
rest apply to every family.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferplane.chat._errors import ChatRenderError
from inferplane.chat._family import KIMI_K2, ArgumentsForm, ChatFamily, HistoryIds

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Accepted message roles. ``developer`` (OpenAI's newer name for system) renders as system."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
"""``chat_template_kwargs`` keys a client may not set: the renderer owns them."""

# `functions.get_weather:0` or `get_weather:0`; the name may itself contain dots or colons.
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>.+):(?P<n>[0-9]+)$")


@dataclass(frozen=True)
class ChatInputs:
    """What goes into the chat template: normalised messages and tools, and the thinking flag.

    ``messages`` and ``tools`` are plain JSON-like dicts in OpenAI shape (tools as
    ``{"type": "function", "function": {name, description?, parameters?}}``); ``tools`` is
    empty when the request declares none. ``thinking`` is the value of the family's thinking
    keyword (the client's or the family's default; False for a family without one), and
    ``template_kwargs`` holds the client's other ``chat_template_kwargs``.
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    thinking: bool
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def prepare_chat(request: Mapping[str, Any], family: ChatFamily = KIMI_K2) -> ChatInputs:
    """Validate and normalise an OpenAI chat request (plain JSON-like values) for `family`'s
    template (default Kimi K2, the format of the ``kimi-tiny`` fixture).

    Raises:
        ChatRenderError: the request is malformed (see the module's rules), including a
            non-boolean value of the family's thinking keyword.
    """
    if not isinstance(request, Mapping):
        raise ChatRenderError("the request body must be a JSON object")
    tools = normalize_tools(request.get("tools"))
    check_tool_choice(request.get("tool_choice"), tools)
    kwargs = dict(_mapping(request.get("chat_template_kwargs"), "chat_template_kwargs"))
    thinking = False
    if family.thinking_kwarg is not None:
        thinking = kwargs.pop(family.thinking_kwarg, family.thinking_default)
        if not isinstance(thinking, bool):
            where = f"chat_template_kwargs.{family.thinking_kwarg}"
            raise ChatRenderError(f"{where} must be a boolean", param=where)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ChatRenderError(
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param=f"chat_template_kwargs.{reserved[0]}",
        )
    messages = normalize_messages(request.get("messages"), family)
    return ChatInputs(messages, tools, thinking, kwargs)


def integral_floats_to_int(value: Any) -> Any:
    """Copy of a JSON-like value with every integral float turned into an int (``0.0`` → ``0``).

    protobuf ``Struct`` carries every number as a double (``google/protobuf/struct.proto``:
    ``Value.number_value`` is the only number), so a schema that crossed the gRPC edge would
    otherwise render ``"minimum":1.0`` where the client sent ``1`` and change the prompt.
    Non-integral and non-finite floats, bools and everything else are kept.
    """
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else value
    if isinstance(value, Mapping):
        return {k: integral_floats_to_int(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [integral_floats_to_int(v) for v in value]
    return value


def content_text(content: Any, param: str) -> str:
    """The text of a message's content: ``None``/``""`` → ``""``, a string as is, a list of
    parts → its text parts concatenated (never the list's Python repr).

    Parts are joined with nothing in between, as Kimi's own template concatenates them.

    Raises:
        ChatRenderError: a non-text part (images are not supported) or a malformed part.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes | bytearray):
        raise ChatRenderError(f"{param} must be a string or an array of content parts", param=param)
    texts: list[str] = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatRenderError(f"{where} must be a content part object", param=where)
        kind = part.get("type", "text")
        if kind != "text":
            raise ChatRenderError(
                f"{where}.type {kind!r} is not supported: this model takes text parts only",
                param=f"{where}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatRenderError(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(text)
    return "".join(texts)


def normalize_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI ``tools`` → ``({"type": "function", "function": {name, description?,
    parameters?}}, ...)``, dropping every other field (``strict``, vendor extras) so that
    irrelevant fields do not change the prompt; integral floats in schemas become ints.

    Raises:
        ChatRenderError: not an array, a non-function tool, a missing or duplicate name.
    """
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ChatRenderError("tools must be an array", param="tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, Mapping):
            raise ChatRenderError(f"{where} must be an object", param=where)
        kind = tool.get("type", "function")
        if kind != "function":
            raise ChatRenderError(
                f"{where}.type {kind!r} is not supported; only 'function' tools are",
                param=f"{where}.type",
            )
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ChatRenderError(f"{where}.function must be an object", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatRenderError(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        if name in seen:
            raise ChatRenderError(
                f"{where}.function.name {name!r} is declared twice", param=f"{where}.function.name"
            )
        seen.add(name)
        decl: dict[str, Any] = {"name": name}
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise ChatRenderError(
                    f"{where}.function.description must be a string",
                    param=f"{where}.function.description",
                )
            decl["description"] = description
        parameters = fn.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise ChatRenderError(
                    f"{where}.function.parameters must be a JSON schema object",
                    param=f"{where}.function.parameters",
                )
            decl["parameters"] = integral_floats_to_int(parameters)
        out.append({"type": "function", "function": decl})
    return tuple(out)


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> None:
    """Reject a ``tool_choice`` that cannot be honoured with the declared tools.

    Raises:
        ChatRenderError: an unknown value, ``required`` without tools, or a named function that
            is not declared.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return
    names = [t["function"]["name"] for t in tools]
    if tool_choice == "required":
        if not names:
            raise ChatRenderError(
                "tool_choice 'required' needs at least one tool in tools", param="tool_choice"
            )
        return
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str):
            raise ChatRenderError(
                "tool_choice.function.name must be a string", param="tool_choice.function.name"
            )
        if name not in names:
            raise ChatRenderError(
                f"tool_choice names function {name!r}, which is not declared in tools",
                param="tool_choice.function.name",
            )
        return
    raise ChatRenderError(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


class _VerbatimIds:
    """History tool-call ids as the client sent them; a tool result must name one of them."""

    def __init__(self) -> None:
        self.issued: set[str] = set()

    def assign(self, client_id: str | None, name: str) -> str | None:
        if client_id is not None:
            self.issued.add(client_id)
        return client_id

    def resolve(self, client_id: str) -> str | None:
        return client_id if client_id in self.issued else None


class _KimiIds:
    """Kimi ids for history tool calls, and the map from the client's ids to them.

    Kimi writes ids as ``functions.{name}:{n}`` with n counting calls across the conversation
    (``docs/kimi.md``); its template renders history ids verbatim, so a client id such as
    ``call_abc`` or ``search:2`` would show the model a format it never produced. A client id
    that already carries a number (``search:2``, ``functions.search:2``) keeps it, as written,
    unless the conversation already holds that id (a client that restarted numbering each
    turn): the history then renders as the model generated it, even where the model's own
    numbering went backwards (``functions.search:1`` after ``functions.get_time:2``), so the
    next turn's prompt extends this one token for token. Every other id, and a repeated one,
    takes the next number (above every number seen). Tool results are mapped through the same
    table, the most recent call with that client id winning.
    """

    def __init__(self) -> None:
        self.next_n = 0
        self.by_client_id: dict[str, str] = {}
        self.issued: set[str] = set()

    def assign(self, client_id: str | None, name: str) -> str | None:
        m = _KIMI_ID.match(client_id) if isinstance(client_id, str) else None
        if m is not None and m["name"] == name and f"functions.{name}:{m['n']}" not in self.issued:
            kimi_id = f"functions.{name}:{m['n']}"
            self.next_n = max(self.next_n, int(m["n"]) + 1)
        else:
            kimi_id = f"functions.{name}:{self.next_n}"
            self.next_n += 1
        self.issued.add(kimi_id)
        if isinstance(client_id, str):
            self.by_client_id[client_id] = kimi_id
        return kimi_id

    def resolve(self, client_id: str) -> str | None:
        if client_id in self.by_client_id:
            return self.by_client_id[client_id]
        return client_id if client_id in self.issued else None


def _mapping(value: Any, param: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ChatRenderError(f"{param} must be an object", param=param)
    return value


def _arguments(raw: Any, param: str, form: ArgumentsForm) -> str | dict[str, Any]:
    """Tool-call arguments in `form`; missing or empty → ``{}`` (text or object).

    ``JSON_TEXT``: a string verbatim (it is what the model wrote, so the history renders token
    for token as generated), an object as JSON the way Kimi writes it and ``tojson`` prints it
    (``", "`` and ``": "``, non-ASCII kept). ``OBJECT``: an object as is, a string parsed when
    it holds a JSON object, else kept verbatim (for a template with a string branch). Integral
    floats of an object become ints (protobuf ``Struct``).
    """
    if raw is None or raw == "":
        return "{}" if form is ArgumentsForm.JSON_TEXT else {}
    if isinstance(raw, str):
        if form is ArgumentsForm.JSON_TEXT:
            return raw
        try:
            parsed = json.loads(raw)
        except ValueError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    if isinstance(raw, Mapping):
        value = integral_floats_to_int(raw)
        if form is ArgumentsForm.JSON_TEXT:
            return json.dumps(value, ensure_ascii=False)
        return dict(value)
    raise ChatRenderError(f"{param} must be a JSON string", param=param)


_Ids = _KimiIds | _VerbatimIds


def _assistant(
    msg: Mapping[str, Any], where: str, ids: _Ids, form: ArgumentsForm
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": "assistant",
        "content": content_text(msg.get("content"), where + ".content"),
    }
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")  # vLLM's newer field name
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ChatRenderError(
                f"{where}.reasoning_content must be a string", param=f"{where}.reasoning_content"
            )
        if reasoning:
            out["reasoning_content"] = reasoning
    raw_calls = msg.get("tool_calls")
    if raw_calls is None:
        return out
    if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, str | bytes):
        raise ChatRenderError(f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")
    calls: list[dict[str, Any]] = []
    seen: set[str] = set()
    for j, call in enumerate(raw_calls):
        cw = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ChatRenderError(f"{cw} must be an object", param=cw)
        if call.get("type", "function") != "function":
            raise ChatRenderError(f"{cw}.type must be 'function'", param=f"{cw}.type")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatRenderError(f"{cw}.function must be an object", param=f"{cw}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatRenderError(
                f"{cw}.function.name must be a non-empty string", param=f"{cw}.function.name"
            )
        client_id = call.get("id")
        if client_id is not None and not isinstance(client_id, str):
            raise ChatRenderError(f"{cw}.id must be a string", param=f"{cw}.id")
        if client_id:
            if client_id in seen:
                raise ChatRenderError(
                    f"{cw}.id {client_id!r} is used twice in one message", param=f"{cw}.id"
                )
            seen.add(client_id)
        rendered: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": name,
                "arguments": _arguments(fn.get("arguments"), f"{cw}.function.arguments", form),
            },
        }
        call_id = ids.assign(client_id or None, name)
        if call_id is not None:
            rendered = {"id": call_id, **rendered}
        calls.append(rendered)
    if calls:
        out["tool_calls"] = calls
    return out


def normalize_messages(messages: Any, family: ChatFamily = KIMI_K2) -> tuple[dict[str, Any], ...]:
    """OpenAI ``messages`` → template messages with text content, tool-call ids and arguments
    as `family`'s template wants them (default Kimi K2).

    Output dicts hold only: ``role``, ``content`` (str), ``name`` (if given, str),
    ``reasoning_content`` (assistant, non-empty), ``tool_calls`` (assistant: ``id`` Kimi's or
    the client's, absent when the client gave none outside Kimi; ``arguments`` in the
    family's form), ``tool_call_id`` (tool: its call's id as rendered).

    Raises:
        ChatRenderError: empty or non-array messages, an unknown role, a malformed field, a tool
            message without ``tool_call_id`` or whose id matches no earlier tool call.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise ChatRenderError("messages must be a non-empty array", param="messages")
    ids: _Ids = _KimiIds() if family.history_ids is HistoryIds.KIMI else _VerbatimIds()
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatRenderError(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role not in ROLES:
            raise ChatRenderError(
                f"{where}.role {role!r} is not one of {', '.join(ROLES)}", param=f"{where}.role"
            )
        if role == "assistant":
            rendered = _assistant(msg, where, ids, family.arguments)
        elif role == "tool":
            client_id = msg.get("tool_call_id")
            if not isinstance(client_id, str) or not client_id:
                raise ChatRenderError(
                    f"{where}.tool_call_id is required for role 'tool'",
                    param=f"{where}.tool_call_id",
                )
            call_id = ids.resolve(client_id)
            if call_id is None:
                raise ChatRenderError(
                    f"{where}.tool_call_id {client_id!r} matches no tool call of an earlier "
                    "assistant message",
                    param=f"{where}.tool_call_id",
                )
            rendered = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": content_text(msg.get("content"), where + ".content"),
            }
        else:
            rendered = {
                "role": "system" if role == "developer" else role,
                "content": content_text(msg.get("content"), where + ".content"),
            }
        name = msg.get("name")
        if name is not None and role != "tool":
            if not isinstance(name, str):
                raise ChatRenderError(f"{where}.name must be a string", param=f"{where}.name")
            rendered["name"] = name
        out.append(rendered)
    return tuple(out)

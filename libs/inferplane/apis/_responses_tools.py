"""The tools of an OpenAI Responses request → chat's tools and tool choice
(`inferplane.apis.responses`, which documents the rules; docs/api-responses.md).

    chat_tools, namespaced = tools(body["tools"])   # namespaced: flat name → (namespace, name)
    tool_choice(body["tool_choice"])                 # chat's tool_choice

A namespace tool's functions are offered flattened, `flat_name(namespace, name)`
(`mcp__weather` + `get_weather` → `mcp__weather__get_weather`): `[A-Za-z0-9_-]` names joined
by `NAMESPACE_SEPARATOR`, which every call format the parsers read carries unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from inferplane.runtime import InvalidArgumentError

NAMESPACE_SEPARATOR: Final = "__"
"""Between a namespace and a function's name in the flat name the model is offered
(`flat_name`)."""

_TOOL_NAME: Final = re.compile(r"[A-Za-z0-9_-]+")
"""The characters of a namespace's and its functions' names: OpenAI's function-name rule
(without its length), which every call format the parsers read (Kimi's `functions.NAME:N`,
gpt-oss's `to=functions.NAME`, JSON and XML headers) carries as it is."""
_IGNORED_TOOLS: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
    }
)
_FUNCTION_TOOL_KEYS: Final = frozenset({"type", "name", "description", "parameters", "strict"})
_NAMESPACED_IGNORED_KEYS: Final = frozenset(
    {"allowed_callers", "async", "defer_loading", "output_schema"}
)
"""What a namespace's function tool may carry besides `_FUNCTION_TOOL_KEYS` (the openai SDK's
`NamespaceTool.ToolFunction`): accepted and ignored (the platform has no tool search,
programmatic callers or asynchronous results; an output schema is not shown to the model)."""
_NAMESPACE_KEYS: Final = frozenset({"type", "name", "description", "tools"})
_CHOICES: Final = frozenset({"none", "auto", "required"})


def bad(message: str, param: str, code: str = "invalid_value") -> InvalidArgumentError:
    """A malformed value's 400, `param` its JSON path."""
    return InvalidArgumentError(message, param=param, code=code)


def unsupported(message: str, param: str) -> InvalidArgumentError:
    """A refused field's or value's 400 (`unsupported_parameter`), `param` its JSON path."""
    return InvalidArgumentError(message, param=param, code="unsupported_parameter")


def flat_name(namespace: str, name: str) -> str:
    """The name a namespace's function is offered to the model under:
    `flat_name("mcp__weather", "get_weather")` → `"mcp__weather__get_weather"`."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def tools(
    declared: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """Responses tools → chat's tools, and each namespaced function's flat name →
    `(namespace, name)`.

    Raises:
        InvalidArgumentError: a tool type the platform refuses (`tools[i].type`), an unknown
            key, a missing or malformed name (`tools[i].tools[j].name`), a namespaced
            function whose flat name another tool has.
    """
    out: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    names: set[str] = set()  # every name offered so far (a flat name may not repeat one)
    for i, tool in enumerate(declared):
        kind = tool.get("type")
        if kind in _IGNORED_TOOLS:
            continue
        if kind == "namespace":
            for flat, pair, function in _namespace(tool, f"tools[{i}]", names):
                namespaced[flat] = pair
                out.append(function)
            continue
        if kind != "function":
            raise unsupported(
                f"tools of type {kind!r} are not supported: the platform runs no built-in "
                "tools; declare a function tool instead",
                f"tools[{i}].type",
            )
        function = _function(tool, f"tools[{i}]", _FUNCTION_TOOL_KEYS)
        name = function["function"]["name"]
        if name in namespaced:
            raise bad(f"the tool name {name!r} is a namespaced tool's too", f"tools[{i}].name")
        names.add(name)
        out.append(function)
    return out, namespaced


def _function(tool: Mapping[str, Any], where: str, keys: frozenset[str]) -> dict[str, Any]:
    """A function tool → chat's `{type: function, function: {...}}`; `keys` are those it may
    carry (others are a 400 naming them)."""
    for key in tool:
        if key not in keys:
            raise bad(f"Unrecognized request argument supplied: {key}", f"{where}.{key}")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad("a function tool needs its 'name'", f"{where}.name")
    function: dict[str, Any] = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _namespace(
    tool: Mapping[str, Any], where: str, names: set[str]
) -> list[tuple[str, tuple[str, str], dict[str, Any]]]:
    """A namespace tool's function tools, flattened: `(flat name, (namespace, name), chat
    tool)` each; its other entries are left out. `names` (the names offered so far) gains
    the flat names.

    Raises:
        InvalidArgumentError: an unknown key, a namespace or function name missing or outside
            `[A-Za-z0-9_-]`, a flat name another tool has.
    """
    for key in tool:
        if key not in _NAMESPACE_KEYS:
            raise bad(f"Unrecognized request argument supplied: {key}", f"{where}.{key}")
    namespace = tool.get("name")
    if not isinstance(namespace, str) or not _TOOL_NAME.fullmatch(namespace):
        raise bad(
            "a namespace tool needs a 'name' of letters, digits, '_' and '-'", f"{where}.name"
        )
    inner = tool.get("tools") or []
    if not isinstance(inner, list):
        raise bad("a namespace tool's 'tools' must be an array", f"{where}.tools")
    out = []
    for j, entry in enumerate(inner):
        at = f"{where}.tools[{j}]"
        if not isinstance(entry, dict):
            raise bad("each tool of a namespace must be an object", at)
        if entry.get("type") != "function":
            continue  # custom tools: an open model's call format has none
        function = _function(entry, at, _FUNCTION_TOOL_KEYS | _NAMESPACED_IGNORED_KEYS)
        name = function["function"]["name"]
        if not _TOOL_NAME.fullmatch(name):
            raise bad(
                "a namespaced function's 'name' must be letters, digits, '_' and '-'",
                f"{at}.name",
            )
        flat = flat_name(namespace, name)
        if flat in names:
            raise bad(
                f"the namespaced tool {namespace}.{name} is offered as {flat!r}, which another "
                "tool of the request is named",
                f"{at}.name",
            )
        names.add(flat)
        function["function"]["name"] = flat
        out.append((flat, (namespace, name), function))
    return out


def tool_choice(choice: Any) -> Any:
    """Responses' `tool_choice` → chat's: `none` / `auto` / `required`, or `{type: function,
    name}` (with `namespace`: the namespaced function's flat name).

    Raises:
        InvalidArgumentError: another string or type, a missing name, a malformed namespace
            (`tool_choice`, `tool_choice.name`, `tool_choice.namespace`, `tool_choice.type`).
    """
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise bad("'tool_choice' must be none, auto, required or a function", "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad("a function tool_choice needs its 'name'", "tool_choice.name")
        namespace = choice.get("namespace")
        if namespace is not None:
            if not isinstance(namespace, str) or not namespace:
                raise bad(
                    "a function tool_choice's 'namespace' must be a non-empty string",
                    "tool_choice.namespace",
                )
            name = flat_name(namespace, name)
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise unsupported(
        f"tool_choice of type {kind!r} is not supported (none, auto, required, function are)",
        "tool_choice.type" if kind else "tool_choice",
    )

"""Anthropic Messages → chat: `tools` and `tool_choice`. The mapping and its reasons:
`inferplane.apis.anthropic` and docs/api-messages.md.

A custom tool (`type` absent or "custom") is a chat function: `name`, `description`,
`input_schema` → `parameters`, `strict`. Its other keys:

- `input_examples` (example inputs) are appended to the description, one JSON object a line
  after `EXAMPLES_HEADING`, so the model sees them (Anthropic shows them to its model too);
- `defer_loading: true` keeps the tool out of the prompt until a `tool_reference` block in a
  tool result names it (Anthropic's tool search, which Claude Code runs as its own ToolSearch
  tool): it is then declared like the others;
- `allowed_callers` must allow `"direct"` calls (the model's own): calls from Anthropic's code
  execution are not served;
- `cache_control`, `eager_input_streaming` change nothing here (automatic prefix cache, input
  always streamed).

Server tools (any other `type`: `web_search_…`, `bash_…`, `text_editor_…`, ...) are 400s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from inferplane.api.inference.v1 import anthropic_pb2 as apb
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.apis._anthropic_content import References, bad, check_keys, value

CUSTOM_TOOL: Final = "custom"
"""The one tool `type` the platform serves (absent means the same); every other is a server
tool Anthropic runs itself (web search, code execution, computer use, ...)."""
_SCHEMA = "input_schema"
DIRECT_CALLER: Final = "direct"
"""The `allowed_callers` value for calls the model makes itself."""
EXAMPLES_HEADING: Final = "\n\nInput examples:\n"
"""What precedes a tool's `input_examples` in its description."""

_TOOL_KEYS: Final = frozenset(
    {
        "type",
        "name",
        "description",
        "input_schema",
        "strict",
        "input_examples",
        "defer_loading",
        "allowed_callers",
        # Change nothing the model sees: the prefix cache is automatic, input always streams.
        "cache_control",
        "eager_input_streaming",
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    """A declared custom tool: its chat form (the schema copied as the proto Struct it came
    in: a Claude Code turn declares ~25 tools, and a round trip through dicts cost the picker
    milliseconds per request), and whether it waits for a `tool_reference`."""

    chat: pb.Tool
    deferred: bool

    @property
    def name(self) -> str:
        return str(self.chat.function.name)

    def argument_order(self) -> list[str]:
        """The schema's `required` names, then its other `properties` (`key_orders`)."""
        fields = self.chat.function.parameters.fields
        required = []
        if "required" in fields:
            required = [v.string_value for v in fields["required"].list_value.values]
        names = list(fields["properties"].struct_value.fields) if "properties" in fields else []
        return required + [k for k in names if k not in required]


def _bool(tool: Mapping[str, Any], key: str, where: str) -> bool | None:
    flag = tool.get(key)
    if flag is not None and not isinstance(flag, bool):
        raise bad(f"{where}.{key} must be a boolean", f"{where}.{key}")
    return flag


def _description(tool: Mapping[str, Any], where: str) -> str | None:
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.description must be a string", f"{where}.description")
    examples = tool.get("input_examples")
    if examples is None:
        return description
    if not isinstance(examples, list) or not all(isinstance(e, Mapping) for e in examples):
        raise bad(f"{where}.input_examples must be an array of objects", f"{where}.input_examples")
    if not examples:
        return description
    lines = "\n".join(json.dumps(e, ensure_ascii=False) for e in examples)
    return (description or "") + EXAMPLES_HEADING + lines


def _check_callers(tool: Mapping[str, Any], where: str) -> None:
    callers = tool.get("allowed_callers")
    if callers is None:
        return
    if not isinstance(callers, list) or not all(isinstance(c, str) for c in callers):
        raise bad(
            f"{where}.allowed_callers must be an array of strings", f"{where}.allowed_callers"
        )
    if DIRECT_CALLER not in callers:
        raise bad(
            f"{where}.allowed_callers: only calls from code execution are allowed, which the "
            f"platform does not run; allow '{DIRECT_CALLER}'",
            f"{where}.allowed_callers",
            code="unsupported_tool",
        )


def tools(request: apb.MessagesRequest) -> list[Tool]:
    """The request's tools, checked, in their chat form.

    Raises:
        InvalidArgumentError: a server tool, an unknown key, a missing name or schema, a
            value of the wrong type (`param`: `tools[i].key`).
    """
    out: list[Tool] = []
    for i, struct in enumerate(request.tools):
        where = f"tools[{i}]"
        # Everything but the schema as JSON; the schema stays a Struct (checked, then copied).
        tool: dict[str, Any] = {k: value(v) for k, v in struct.fields.items() if k != _SCHEMA}
        schema = struct.fields.get(_SCHEMA)
        kind = tool.get("type")
        if kind is not None and kind != CUSTOM_TOOL:
            raise bad(
                f"{where}.type: server tool {kind!r} is not supported: the platform runs no "
                "tools; declare a custom tool (name, description, input_schema) and run it "
                "in the client",
                f"{where}.type",
                code="unsupported_tool",
            )
        check_keys({**tool, _SCHEMA: schema}, _TOOL_KEYS, where)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
        if schema is None or schema.WhichOneof("kind") != "struct_value":
            raise bad(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema")
        _check_callers(tool, where)
        chat = pb.Tool(type="function")
        chat.function.name = name
        chat.function.parameters.CopyFrom(schema.struct_value)
        description = _description(tool, where)
        if description is not None:
            chat.function.description = description
        strict = _bool(tool, "strict", where)
        if strict is not None:
            chat.function.strict = strict
        _bool(tool, "eager_input_streaming", where)
        deferred = bool(_bool(tool, "defer_loading", where))
        out.append(Tool(chat, deferred))
    return out


def declared(all_tools: Sequence[Tool], references: References) -> list[pb.Tool]:
    """The tools the model is shown: every tool not deferred, and each deferred one a
    `tool_reference` names, in the request's order.

    Raises:
        InvalidArgumentError: a `tool_reference` names no tool of the request (param: its
            `tool_name`'s path).
    """
    names = {t.name for t in all_tools}
    for name, where in references.paths.items():
        if name not in names:
            raise bad(f"{where}: {name!r} names no tool of the request", where)
    return [t.chat for t in all_tools if not t.deferred or t.name in references.paths]


def tool_choice(choice: apb.AnthropicToolChoice, body: dict[str, Any]) -> None:
    """`tool_choice` → chat's `tool_choice` (and `parallel_tool_calls: false` for
    `disable_parallel_tool_use`) in `body`.

    Raises:
        InvalidArgumentError: an unknown type, or `name` missing with (present without)
            type "tool".
    """
    kind = choice.type
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool":
        if not choice.name:
            raise bad("tool_choice.name is required with type 'tool'", "tool_choice.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        raise bad(
            f"tool_choice.type must be one of auto, any, tool, none; got {kind!r}",
            "tool_choice.type",
        )
    if kind != "tool" and choice.HasField("name"):
        raise bad("tool_choice.name is only allowed with type 'tool'", "tool_choice.name")
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False

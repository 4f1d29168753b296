"""Decoding constraints that make invalid tool calls impossible, not just detectable.

vLLM's gRPC ``Generate`` takes ``SamplingParams.constraint``, a oneof of ``json_schema |
regex | grammar | structural_tag | json_object | choice`` (``smg_grpc_proto``'s
``vllm_engine.proto``). vLLM 0.32 hands a ``structural_tag`` string to xgrammar
(``vllm/v1/structured_output/backend_xgrammar.py``: ``compile_structural_tag(spec)`` for the
non-legacy form), so the value built here is xgrammar's structural-tag JSON::

    {"type": "structural_tag", "format": <format>}

The tag is built from the output format's ``CallSyntax`` (``EngineConfig.call_syntax``:
Kimi K2, Qwen3, DeepSeek-V3.1, GLM-4.5, gpt-oss; Kimi's when none is given). The shapes mirror
xgrammar 0.2's built-in structural tags for those models
(``xgrammar.builtin_structural_tag``: ``kimi``, ``qwen_3``, ``deepseek_v3_1``, ``glm_4_7``,
``harmony``), written out here so that this library needs neither xgrammar nor vLLM at run
time. Deliberate differences (described for Kimi; the other formats follow the same rules):

- ``required`` / a named function: the reasoning span excludes the tool markers, so the model
  must close reasoning with ``</think>`` before calling (our parser would otherwise end
  reasoning at the section marker, which is also correct, but the grammar would then be one
  marker out of step).
- ``auto`` (``constrain_auto``) guards the tool section only: free text before it, reasoning
  included, is the same for the grammar whether thinking is on or off. xgrammar's tag requires
  ``</think>`` first, which forbids two outputs the unconstrained model gives and the parser
  handles: a section opened straight from reasoning (Kimi skips ``</think>``), and an answer
  that ends inside reasoning; under that tag the fixture model, denied them, ran on to
  ``max_tokens`` (bench/README.md, tool_call_validity).
- Arguments: at most ``MAX_WHITESPACE`` consecutive whitespace characters between JSON tokens
  (xgrammar's ``max_whitespace_cnt``; unbounded by default), and properties in the order of
  ``required`` (see ``_in_required_order``).

Not excluded: a call or section marker inside a JSON string of the arguments. The grammar
allows it (it is JSON), our parser ends the arguments there. xgrammar's ``excludes`` on the
arguments would close the gap, but it drops the length bounds of every string it filters, and
on a 163k-token vocabulary it made compiling a new tool set's grammar about 15 times slower at
p90 (bench/README.md, tool_call_validity). A model writes a marker inside a value only when the
value is about the markers, and then it is data: the parser, which tracks the JSON string it
is in, is the place to keep it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from inferplane.parsers._answer import answer_excludes, bounded_strings_as_patterns
from inferplane.parsers._errors import ConstraintError
from inferplane.parsers._syntax import CallSyntax

__all__ = ["Constraint", "ConstraintKind", "build_json_constraint", "build_tool_constraint"]

ConstraintKind = Literal[
    "json_schema", "regex", "grammar", "structural_tag", "json_object", "choice"
]

# Consecutive whitespace characters allowed between JSON tokens of the arguments. Unbounded,
# a model that favours whitespace pads until max_tokens (vLLM #38696); 8 keeps pretty-printed
# JSON possible (newline plus indent) and is the cap vLLM #44619 proposes for json_schema.
MAX_WHITESPACE = 8


@dataclass(frozen=True, slots=True)
class Constraint:
    """One value of ``SamplingParams.constraint`` (field name = ``kind``).

    Attributes:
        kind: the oneof field to set.
        value: its value; for ``structural_tag`` a JSON string (xgrammar format).
    """

    kind: ConstraintKind
    value: str


JSON = dict[str, Any]


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """(name, parameters schema) of every function tool, in request order."""
    out: list[tuple[str, Any]] = []
    for tool in tools:
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping):
            if isinstance(tool.get("name"), str) and "function" not in tool:
                fn = tool
            else:
                continue
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ConstraintError(f"a function tool has no name: {dict(fn)!r}")
        params = fn.get("parameters")
        # OpenAI function arguments are always an object; a missing schema means "any object".
        out.append((name, params if params is not None else {"type": "object"}))
    return out


def _call_tag(syntax: CallSyntax, name: str, schema: Any) -> JSON:
    """One call of function `name`: ``call_begin``, the id, ``args_begin``, the arguments,
    ``call_end`` (Kimi: ``<|tool_call_begin|>functions.{name}:{N}<|tool_call_argument_begin|>
    {args}<|tool_call_end|>``)."""
    elements: list[JSON] = []
    if syntax.call_id is not None:
        elements.append({"type": "regex", "pattern": syntax.call_id})
    if syntax.args_begin:
        elements.append({"type": "const_string", "value": syntax.args_begin})
    elements.append(_arguments(syntax, schema))
    content = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return {"type": "tag", "begin": syntax.begin(name), "content": content, "end": syntax.call_end}


def _arguments(syntax: CallSyntax, schema: Any) -> JSON:
    """The arguments: `schema` in required order, whitespace capped, in the format's style."""
    out: JSON = {
        "type": "json_schema",
        "json_schema": _in_required_order(schema),
        "max_whitespace_cnt": MAX_WHITESPACE,
    }
    if syntax.arguments_style is not None:
        out["style"] = syntax.arguments_style
    return out


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _in_required_order(schema: Any) -> Any:
    """`schema` with each object's `properties` in the order of its `required` list first, then
    the others as they come, nested schemas included.

    xgrammar makes the model write properties in the schema's order. The client's order does
    not survive the wire (`google.protobuf.Struct` is a map: `{"query", "max_results"}` arrives
    as `{"max_results", "query"}`), but lists do, and clients list `required` in declaration
    order (pydantic, zod, hand-written schemas), so it is the best record of the order the
    model was shown and trained on. Validity does not depend on the order."""
    if isinstance(schema, list):
        return [_in_required_order(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _in_required_order(sub) for name, sub in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_VALUES):
        if key in out:
            out[key] = _in_required_order(out[key])
    properties, required = out.get("properties"), out.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        first = [n for n in dict.fromkeys(required) if isinstance(n, str) and n in properties]
        rest = [n for n in properties if n not in first]
        out["properties"] = {n: properties[n] for n in (*first, *rest)}
    return out


def _calls(syntax: CallSyntax, functions: list[tuple[str, Any]], parallel: bool) -> JSON:
    return {
        "type": "tags_with_separator",
        "tags": [_call_tag(syntax, n, s) for n, s in functions],
        "separator": syntax.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def _in_section(syntax: CallSyntax, calls: JSON) -> JSON:
    """`calls` wrapped in the format's section markers (as is when it has none)."""
    if not syntax.section_begin:
        return calls
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": syntax.section_begin},
            calls,
            {"type": "const_string", "value": syntax.section_end},
        ],
    }


def _forced_name(tool_choice: Mapping[str, Any]) -> str:
    if tool_choice.get("type") != "function":
        raise ConstraintError(f"unsupported tool_choice {dict(tool_choice)!r}")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if not isinstance(name, str) or not name:
        raise ConstraintError(f"tool_choice names no function: {dict(tool_choice)!r}")
    return name


def _auto(
    syntax: CallSyntax, functions: list[tuple[str, Any]], thinking: bool, parallel: bool
) -> JSON:
    """``auto``: free text (reasoning included), but whatever the trigger opens must be
    declared calls with schema-valid arguments."""
    # With thinking on, the free text starts inside reasoning, so its end marker may appear;
    # with thinking off the prompt already closed it. A model that opens reasoning itself
    # (optional_reasoning) may write both markers.
    excludes: list[str] = []
    if not syntax.optional_reasoning:
        if not (thinking and syntax.model_writes_think):
            excludes.append(syntax.reasoning_begin)
        if not thinking:
            excludes.append(syntax.reasoning_end)
    excludes += syntax.text_excludes
    if syntax.section_begin:
        tags = [
            {
                "type": "tag",
                "begin": syntax.section_begin,
                "content": _calls(syntax, functions, parallel),
                "end": syntax.section_end,
            }
        ]
        triggers = [syntax.section_begin]
    else:
        tags = [_call_tag(syntax, n, s) for n, s in functions]
        triggers = [syntax.trigger]
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "excludes": excludes,
        "at_least_one": False,
        "stop_after_first": not parallel,
    }


def _reasoning_prefix(syntax: CallSyntax, thinking: bool) -> JSON | None:
    """What may come before a forced call: the reasoning the prompt opened (it must be
    closed), or, for a model that opens reasoning itself, an optional block of it."""
    excludes = list(syntax.reasoning_excludes)
    if thinking:
        if not syntax.model_writes_think:
            excludes.insert(0, syntax.reasoning_begin)
        begin = ""  # the prompt already opened reasoning
    elif syntax.optional_reasoning:
        begin = syntax.reasoning_begin
    else:
        return None
    block = {
        "type": "tag",
        "begin": begin,
        "content": {"type": "any_text", "excludes": excludes},
        "end": syntax.reasoning_end + syntax.after_reasoning,
    }
    return block if thinking else {"type": "optional", "content": block}


def build_tool_constraint(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    *,
    syntax: CallSyntax | None = None,
    thinking: bool = True,
    parallel_tool_calls: bool = True,
    constrain_auto: bool = False,
) -> Constraint | None:
    """The structural-tag constraint for a request's tool calls, or None if none applies.

    Args:
        tools: the request's tools (OpenAI shape ``{"type":"function","function":{...}}``).
        tool_choice: ``"none"``, ``"auto"`` (or None), ``"required"``, or a named function
            ``{"type": "function", "function": {"name": ...}}``.
        syntax: the output format's call syntax (``parser.config.call_syntax``); None means
            Kimi K2's.
        thinking: the prompt opened reasoning (K2.5 with thinking on): for ``required`` and
            a named function, output must first close it (``</think>``). A format whose model
            opens reasoning itself (``CallSyntax.optional_reasoning``: GLM, gpt-oss) may
            write one block of it first when the prompt did not.
        parallel_tool_calls: False allows exactly one call.
        constrain_auto: also constrain ``auto``: free text (reasoning included), but any
            calls must be declared tools with schema-valid arguments, and only one call (one
            section) when ``parallel_tool_calls`` is false.

    Returns:
        ``Constraint("structural_tag", json)``; None for ``"none"``, for ``auto`` unless
        ``constrain_auto``, and for ``auto`` without tools.

    Raises:
        ConstraintError: ``required`` / a named function without matching tools, or a
            tool_choice this function does not understand.
    """
    if syntax is None:
        from inferplane.parsers._kimi_k2 import KIMI_K2_CALLS

        syntax = KIMI_K2_CALLS
    functions = _functions(tools or ())
    if tool_choice is None or tool_choice == "auto":
        if not constrain_auto or not functions:
            return None
        auto = _auto(syntax, functions, thinking, parallel_tool_calls)
        return Constraint("structural_tag", _structural_tag(auto))
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        if not functions:
            raise ConstraintError("tool_choice 'required' needs at least one function tool")
        suffix = _in_section(syntax, _calls(syntax, functions, parallel_tool_calls))
    elif isinstance(tool_choice, Mapping):
        name = _forced_name(tool_choice)
        schema = dict(functions).get(name)
        if schema is None:
            declared = ", ".join(n for n, _ in functions) or "none"
            raise ConstraintError(f"tool_choice names {name!r}, not a declared tool ({declared})")
        suffix = _in_section(syntax, _call_tag(syntax, name, schema))
    else:
        raise ConstraintError(f"unsupported tool_choice {tool_choice!r}")

    prefix = _reasoning_prefix(syntax, thinking)
    fmt = suffix if prefix is None else {"type": "sequence", "elements": [prefix, suffix]}
    return Constraint("structural_tag", _structural_tag(fmt))


def build_json_constraint(
    schema: Mapping[str, Any] | None,
    *,
    syntax: CallSyntax | None = None,
    thinking: bool = True,
    markers: Sequence[str] = (),
) -> Constraint:
    """The constraint for ``response_format`` ``json_object`` (`schema` None) or
    ``json_schema``, in the output format's own shape, so that reasoning is not forced into
    JSON and the answer lands where the parser reads content.

    Without reasoning and without an answer header the whole output is the JSON value (vLLM's
    ``json_schema`` / ``json_object``). Otherwise a structural tag: the reasoning the prompt
    opened, closed (or, for a model that opens it itself, an optional block of it; rules of
    ``build_tool_constraint``), then the answer header when the format has one (harmony's
    ``<|channel|>final<|message|>``, vLLM's variants), then the JSON value.

    With `markers` (the tokenizer's marker and special-token texts), the answer's strings
    may not hold them (``_answer.py``: why, and what it costs), whitespace between JSON tokens
    is capped at ``MAX_WHITESPACE``, and the constraint is always a structural tag (vLLM's
    ``json_schema`` has no exclusions).

    Args:
        schema: the JSON schema, or None for any JSON object.
        syntax: the format's call syntax (``parser.config.call_syntax``); None: Kimi K2's.
        thinking: the prompt opened reasoning.
        markers: texts the answer must never show (``ModelAssets.marker_texts``); empty: no
            exclusion (vLLM's plain json_schema / json_object without reasoning).
    """
    if syntax is None:
        from inferplane.parsers._kimi_k2 import KIMI_K2_CALLS

        syntax = KIMI_K2_CALLS
    prefix = _reasoning_prefix(syntax, thinking)
    if prefix is None and not syntax.answer_begins and not markers:
        if schema is None:
            return Constraint("json_object", "true")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))
    answer: JSON = {
        "type": "json_schema",
        "json_schema": schema if schema is not None else {"type": "object"},
    }
    if markers:
        answer["json_schema"] = bounded_strings_as_patterns(answer["json_schema"], markers)
        answer["excludes"] = list(answer_excludes(markers))
        answer["max_whitespace_cnt"] = MAX_WHITESPACE
    if syntax.answer_begins:
        heads = [{"type": "const_string", "value": b} for b in syntax.answer_begins]
        head = heads[0] if len(heads) == 1 else {"type": "or", "elements": heads}
        answer = {"type": "sequence", "elements": [head, answer]}
    fmt = answer if prefix is None else {"type": "sequence", "elements": [prefix, answer]}
    return Constraint("structural_tag", _structural_tag(fmt))


def _structural_tag(fmt: JSON) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)

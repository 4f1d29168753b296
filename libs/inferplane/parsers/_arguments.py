"""A tool call's JSON arguments, streamed through two repairs, and the request's tools.

`ArgumentsStream` rewrites arguments as they stream, so that a split never changes the
result (streaming and one-piece parsing give the same arguments):

* **trailing commas** (``{"a": 1,}``, seen from Kimi models in the wild) are dropped: a comma
  outside strings is held until the next non-whitespace character shows whether a value
  follows; before ``}`` or ``]`` it goes, and the call records the repair ``trailing_comma``.
* **schema coercion**: a top-level property whose declared type is integer, number or boolean
  (and not string) that the model wrote as a JSON string (``"5"``, ``"true"``) is written as
  the typed value (``5``, ``true``) when the string holds exactly such a literal; the call
  records ``coerced``. Only that string is held back while it streams. Strings that do not
  convert, nested properties and ``anyOf`` / ``oneOf`` schemas are left as written.

A whole-text repair library (json-repair) cannot be used here: arguments are streamed to the
client as they come, and a repair decided on the whole text could not change what was already
sent. The two repairs above are the ones that can be decided while streaming.

`ToolSet` is the request's declared tools, compiled once per request: the names, each
function's coercions, the parameters whose raw key/value text is JSON (``json_valued``, for
GLM's ``<arg_value>``), and the resolution of a call whose header named no function.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

__all__ = [
    "COERCED",
    "TRAILING_COMMA",
    "ArgumentsStream",
    "ToolSchema",
    "ToolSet",
    "declared_types",
    "decode_json_value",
]

TRAILING_COMMA = "trailing_comma"
COERCED = "coerced"

_OUTSIDE = re.compile(r'["{}\[\],:]')  # what matters outside strings
_INSIDE = re.compile(r'["\\]')  # what ends or escapes inside a string
_INTEGER = re.compile(r"-?(?:0|[1-9]\d*)")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WS = " \t\r\n"

Coercions = Mapping[str, tuple[str, ...]]
"""Top-level property -> the non-string scalar types its schema declares, in the order tried."""


def _coercible_types(schema: Any) -> tuple[str, ...]:
    if not isinstance(schema, Mapping):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list) or "string" in types:
        return ()
    return tuple(t for t in ("integer", "number", "boolean") if t in types)


def _coerce(text: str, types: tuple[str, ...]) -> str | None:
    """The JSON literal for the string value `text` under `types`, or None (left as written)."""
    value = text.strip()
    for kind in types:
        if kind == "integer" and _INTEGER.fullmatch(value):
            return value
        if kind == "number" and _NUMBER.fullmatch(value):
            return value
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower()
    return None


_MAX_SCHEMA_DEPTH = 8  # anyOf / oneOf nesting followed by `declared_types`
_MAX_LITERAL_CHARS = 65536  # longer values are not handed to ast.literal_eval


def declared_types(schema: Any, _depth: int = 0) -> frozenset[str]:
    """The JSON types a property's schema declares: ``type`` (a name or a list), the members
    of ``anyOf`` / ``oneOf``, else what ``enum`` / ``const`` values, ``properties`` (object) or
    ``items`` (array) imply; empty when the schema says nothing about its type. Mirrors
    SGLang's ``infer_type_from_json_schema`` (``function_call/utils.py``)."""
    if not isinstance(schema, Mapping) or _depth > _MAX_SCHEMA_DEPTH:
        return frozenset()
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for union in ("anyOf", "oneOf"):
        members = schema.get(union)
        if isinstance(members, list):
            for member in members:
                types |= declared_types(member, _depth + 1)
    if types:
        return frozenset(types)
    values = schema.get("enum")
    values = list(values) if isinstance(values, list) else []
    if "const" in schema:
        values.append(schema["const"])
    for v in values:
        types.add(_json_type(v))
    if "properties" in schema:
        types.add("object")
    if "items" in schema:
        types.add("array")
    return frozenset(types)


def _json_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_json_value(raw: str) -> str:
    """The JSON text for a raw key/value-format value whose parameter is declared non-string.

    GLM writes such values as JSON (``42``, ``true``, ``[1, 2]``), sometimes with escaped
    quotes (``[{\\"id\\": 1}]``) or as a Python literal (``{'a': 1}``, ``True``). Tried in
    order, as vLLM's ``Glm4MoeModelToolParser._deserialize`` and SGLang's
    ``glm4_moe_detector.parse_arguments`` do: strict JSON (``NaN`` / ``Infinity`` rejected),
    JSON after unescaping (SGLang), a Python literal (both); a value none of them reads stays
    the JSON string it was written as (whitespace-trimmed, like vLLM). Never raises.
    """
    text = raw.strip()
    value: Any
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        try:
            value = json.loads(json.loads('"' + text + '"'), parse_constant=_reject_constant)
        except (ValueError, TypeError, RecursionError):
            value = _literal(text)
            if value is _NOTHING:
                return json.dumps(text, ensure_ascii=False)
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return json.dumps(text, ensure_ascii=False)


_NOTHING = object()


def _literal(text: str) -> Any:
    """``ast.literal_eval(text)``, or `_NOTHING` when it is not a Python literal (or too long:
    the parser must stay cheap on any model output)."""
    if not text or len(text) > _MAX_LITERAL_CHARS:
        return _NOTHING
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes warn (SGLang #30644)
            return ast.literal_eval(text)
    except Exception:  # ValueError, SyntaxError, MemoryError, RecursionError: not a literal
        return _NOTHING


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """One declared function.

    Attributes:
        name: the function's name.
        parameters: its ``parameters`` JSON schema (None when it declared none).
        coercions: see `Coercions` (empty: nothing to coerce).
        json_valued: top-level properties whose declared types (`declared_types`) exclude
            ``string``: a key/value format's raw value for them is JSON and is decoded
            (`decode_json_value`); every other value is a string, verbatim.
    """

    name: str
    parameters: Any
    coercions: Coercions
    json_valued: frozenset[str] = frozenset()


class ToolSet:
    """The request's declared function tools (OpenAI ``tools``, or bare function definitions).

    An empty set means the request offered no tools. Malformed entries are skipped (the
    request was validated before; the parser never raises on them).
    """

    __slots__ = ("_closed", "by_name", "tools")

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        by_name: dict[str, ToolSchema] = {}
        for tool in tools:
            if not isinstance(tool, Mapping):
                continue
            fn = tool.get("function", tool)
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if not isinstance(name, str) or not name or name in by_name:
                continue
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            props = props if isinstance(props, Mapping) else {}
            coercions = {k: t for k, v in props.items() if (t := _coercible_types(v))}
            json_valued = frozenset(
                k
                for k, v in props.items()
                if isinstance(k, str) and (types := declared_types(v)) and "string" not in types
            )
            by_name[name] = ToolSchema(name, params, coercions, json_valued)
        self.by_name: Mapping[str, ToolSchema] = by_name
        self.tools: tuple[ToolSchema, ...] = tuple(by_name.values())
        self._closed: dict[str, Validator | None] = {}  # compiled on first resolution

    def __bool__(self) -> bool:
        return bool(self.tools)

    def resolve(self, arguments: str) -> tuple[ToolSchema, str, tuple[str, ...]] | None:
        """The declared function a call meant whose header named none (a bare counter, a
        client-style id), from its complete raw `arguments`: ``(tool, arguments rewritten
        for it, repairs)``, or None when it cannot be told (the call is then dropped, never
        invented).

        SGLang's rule (``python/sglang/srt/function_call/kimik2_detector.py``,
        ``_infer_tool_name``): a single declared tool is the answer, whatever the arguments;
        otherwise the arguments must be a JSON object that exactly one tool's ``parameters``
        accepts with no property it does not declare (``unevaluatedProperties: false``);
        none or several → None. Each tool sees the arguments coerced to its own schema.
        """
        found: list[tuple[ToolSchema, str, tuple[str, ...]]] = []
        for tool in self.tools:
            stream = ArgumentsStream(tool.coercions)
            text = stream.feed(arguments) + stream.finish()
            if len(self.tools) == 1:
                return tool, text, tuple(stream.repairs)
            try:
                args = json.loads(text)
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            validator = self._validator(tool)
            if validator is not None and validator.is_valid(args):
                found.append((tool, text, tuple(stream.repairs)))
        return found[0] if len(found) == 1 else None

    def _validator(self, tool: ToolSchema) -> Validator | None:
        """The tool's schema closed to undeclared properties; None when it is no schema."""
        if tool.name not in self._closed:
            schema = tool.parameters if tool.parameters is not None else {"type": "object"}
            validator: Validator | None = None
            if isinstance(schema, Mapping):
                closed = dict(schema)
                closed.setdefault("unevaluatedProperties", False)
                try:
                    jsonschema.Draft202012Validator.check_schema(closed)
                    validator = jsonschema.Draft202012Validator(closed)
                except jsonschema.SchemaError:
                    validator = None
            elif schema is False or schema is True:
                validator = jsonschema.Draft202012Validator({"const": {}} if schema else False)
            self._closed[tool.name] = validator
        return self._closed[tool.name]


class ArgumentsStream:
    """Rewrites one call's argument fragments (see the module docstring); split-invariant.

    ``feed`` returns what may be sent now; ``finish`` returns what was held back (an unclosed
    string or a comma at the very end stay as written). ``repairs`` names what was changed.
    """

    __slots__ = (
        "_coercions",
        "_comma",
        "_depth",
        "_escape",
        "_expect_key",
        "_fast",
        "_held",
        "_in_string",
        "_is_key",
        "_key",
        "_top_key",
        "repairs",
    )

    def __init__(self, coercions: Coercions | None = None) -> None:
        self._coercions = coercions or {}
        self._depth: list[str] = []  # open '{' / '['
        self._in_string = False
        self._escape = False  # the last character inside the string was a backslash
        self._is_key = False  # the current string is an object key
        self._expect_key = False  # the next string in this object is a key
        self._key: list[str] | None = None  # the top-level key being read, raw
        self._top_key: str | None = None  # the last top-level key read, decoded
        self._held: list[str] | None = None  # a held string value (coercion), raw
        self._comma: list[str] | None = None  # a held comma and the whitespace after it
        self._fast = False  # inside a plain string: a piece without '"' or '\\' passes as is
        self.repairs: list[str] = []

    def feed(self, text: str) -> str:
        if self._fast and '"' not in text and "\\" not in text:
            return text  # the common case: inside a long string value
        out: list[str] = []
        pos, end = 0, len(text)
        while pos < end:
            if self._in_string:
                pos = self._string(text, pos, out)
                continue
            if self._comma is not None:
                stripped = len(text) - len(text[pos:].lstrip(_WS))
                if stripped > pos:
                    self._comma.append(text[pos:stripped])
                    pos = stripped
                    if pos == end:
                        break
                held, self._comma = self._comma, None
                if text[pos] in "}]":
                    if TRAILING_COMMA not in self.repairs:
                        self.repairs.append(TRAILING_COMMA)
                    out.append("".join(held[1:]))
                else:
                    out.append("".join(held))
            m = _OUTSIDE.search(text, pos)
            if m is None:
                out.append(text[pos:])
                break
            i = m.start()
            if i > pos:
                out.append(text[pos:i])
            pos = i + 1
            c = text[i]
            if c == '"':
                self._open_string(out)
            elif c == ",":
                self._comma = [","]
                self._expect_key = bool(self._depth) and self._depth[-1] == "{"
            elif c in "{[":
                self._depth.append(c)
                self._expect_key = c == "{"
                out.append(c)
            elif c in "}]":
                if self._depth:
                    self._depth.pop()
                self._expect_key = False
                out.append(c)
            else:  # ':'
                self._expect_key = False
                out.append(c)
        self._fast = (
            self._in_string and self._held is None and self._key is None and not self._escape
        )
        return "".join(out)

    @property
    def in_string(self) -> bool:
        """Whether the arguments so far end inside a JSON string."""
        return self._in_string

    def finish(self) -> str:
        """What is still held: a comma at the end, an unclosed held string, as written."""
        out = []
        if self._comma is not None:
            out.append("".join(self._comma))
            self._comma = None
        if self._held is not None:
            out.append('"' + "".join(self._held))
            self._held = None
        return "".join(out)

    def _open_string(self, out: list[str]) -> None:
        self._in_string = True
        self._escape = False
        top = len(self._depth) == 1 and self._depth[0] == "{"
        self._is_key = self._expect_key
        if self._is_key:
            self._expect_key = False
            self._key = [] if top and self._coercions else None
            out.append('"')
        elif top and self._key_types():
            self._held = []  # a value that may need coercion: held until it closes
        else:
            out.append('"')

    def _key_types(self) -> tuple[str, ...]:
        key = self._top_key
        return self._coercions.get(key, ()) if key is not None else ()

    def _string(self, text: str, pos: int, out: list[str]) -> int:
        """Consumes string characters from `pos`; returns where it stopped."""
        end = len(text)
        while pos < end:
            if self._escape:
                self._escape = False
                self._emit(text[pos], out)
                pos += 1
                continue
            m = _INSIDE.search(text, pos)
            stop = m.start() if m is not None else end
            if stop > pos:
                self._emit(text[pos:stop], out)
            if m is None:
                return end
            if text[stop] == "\\":
                self._escape = True
                self._emit("\\", out)
                pos = stop + 1
                continue
            self._close_string(out)
            return stop + 1
        return pos

    def _emit(self, piece: str, out: list[str]) -> None:
        if self._held is not None:
            self._held.append(piece)
            return
        if self._key is not None:
            self._key.append(piece)
        out.append(piece)

    def _close_string(self, out: list[str]) -> None:
        self._in_string = False
        if self._held is not None:
            raw = "".join(self._held)
            self._held = None
            literal = None
            with contextlib.suppress(ValueError):
                literal = _coerce(json.loads('"' + raw + '"'), self._key_types())
            if literal is None:
                out.append('"' + raw + '"')
            else:
                out.append(literal)
                if COERCED not in self.repairs:
                    self.repairs.append(COERCED)
            return
        out.append('"')
        if self._is_key:
            key, self._key = self._key, None
            self._top_key = None
            if key is not None:
                with contextlib.suppress(ValueError):
                    self._top_key = json.loads('"' + "".join(key) + '"')

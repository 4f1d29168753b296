"""Validate parsed tool calls against the request's tools (jsonschema).

A call is valid when its name is declared, its arguments parse as a JSON object (strict
JSON: ``NaN`` / ``Infinity`` are rejected) and they validate against that function's
``parameters`` schema. The verdicts are what telemetry counts as tool-call validity: the
"schema accuracy" of Moonshot's K2-Vendor-Verifier (github.com/MoonshotAI/K2-Vendor-Verifier:
the share of tool calls whose arguments validate against the request's JSON schema).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.protocols import Validator

from inferplane.parsers._errors import InvalidToolCallError
from inferplane.parsers._types import ToolCall

__all__ = ["ToolCallVerdict", "ToolValidator", "VerdictReason", "validate_tool_calls"]


class VerdictReason(StrEnum):
    """Why a tool call is invalid (stable codes: telemetry labels use them)."""

    UNKNOWN_TOOL = "unknown_tool"  # the name is not among the request's tools
    INVALID_JSON = "invalid_json"  # arguments are not valid JSON
    NOT_AN_OBJECT = "arguments_not_object"  # valid JSON, but not an object
    SCHEMA_MISMATCH = "schema_mismatch"  # the object does not match ``parameters``
    INVALID_SCHEMA = "invalid_schema"  # the request's own ``parameters`` is not a schema


@dataclass(frozen=True, slots=True)
class ToolCallVerdict:
    """The verdict on one tool call.

    Attributes:
        index: the call's 0-based position in the response.
        id: the call's id.
        name: the called function's name.
        reason: None when valid, else why not.
        message: human-readable detail ("" when valid), e.g. the JSON error position or the
            failing schema path.
        repairs: what the parser changed in the arguments before this check
            (``ToolCall.repairs``: ``trailing_comma``, ``coerced``); a repaired call may be
            valid.
    """

    index: int
    id: str
    name: str
    reason: VerdictReason | None = None
    message: str = ""
    repairs: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        """True when the call matches a declared tool and its schema."""
        return self.reason is None


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON")


def _function_of(tool: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The function definition of an OpenAI tool (``{"type":"function","function":{..}}``)
    or of a bare function definition (``{"name":..,"parameters":..}``)."""
    fn = tool.get("function")
    if isinstance(fn, Mapping):
        return fn
    if isinstance(tool.get("name"), str):
        return tool
    return None


class ToolValidator:
    """The request's tools compiled once; checks any number of calls.

    Args:
        tools: the request's ``tools`` (OpenAI shape, or bare function definitions).
            Non-function tools are ignored. A function without ``parameters`` accepts any
            JSON object.
    """

    __slots__ = ("_schema_errors", "_validators")

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self._validators: dict[str, Validator | None] = {}
        self._schema_errors: dict[str, str] = {}
        for tool in tools:
            fn = _function_of(tool)
            if fn is None:
                continue
            name = fn.get("name")
            if not isinstance(name, str):
                continue
            schema = fn.get("parameters")
            if schema is None:
                self._validators[name] = None
                continue
            cls = jsonschema.validators.validator_for(
                schema, default=jsonschema.Draft202012Validator
            )
            try:
                cls.check_schema(schema)
            except SchemaError as e:
                self._schema_errors[name] = e.message
                continue
            self._validators[name] = cls(schema)

    @property
    def names(self) -> tuple[str, ...]:
        """Declared function names."""
        return tuple(self._validators) + tuple(self._schema_errors)

    def check(self, index: int, call: ToolCall) -> ToolCallVerdict:
        """The verdict on one call (never raises)."""

        def bad(reason: VerdictReason, message: str) -> ToolCallVerdict:
            return ToolCallVerdict(index, call.id, call.name, reason, message, call.repairs)

        if call.name in self._schema_errors:
            return bad(VerdictReason.INVALID_SCHEMA, self._schema_errors[call.name])
        if call.name not in self._validators:
            declared = ", ".join(sorted(self.names)) or "none"
            return bad(
                VerdictReason.UNKNOWN_TOOL,
                f"{call.name!r} is not a declared tool (declared: {declared})",
            )
        try:
            args = json.loads(call.arguments, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            return bad(VerdictReason.INVALID_JSON, str(e))
        if not isinstance(args, dict):
            return bad(VerdictReason.NOT_AN_OBJECT, f"arguments are a JSON {type(args).__name__}")
        validator = self._validators[call.name]
        if validator is not None:
            error = best_match(validator.iter_errors(args))
            if error is not None:
                path = "/".join(str(p) for p in error.absolute_path)
                return bad(VerdictReason.SCHEMA_MISMATCH, f"at /{path}: {error.message}")
        return ToolCallVerdict(index, call.id, call.name, repairs=call.repairs)

    def validate(self, calls: Sequence[ToolCall], *, strict: bool = False) -> list[ToolCallVerdict]:
        """Verdicts for every call, in order.

        Raises:
            InvalidToolCallError: ``strict`` and at least one call is invalid.
        """
        verdicts = [self.check(i, c) for i, c in enumerate(calls)]
        if strict and any(not v.valid for v in verdicts):
            raise InvalidToolCallError(verdicts)
        return verdicts


def validate_tool_calls(
    calls: Sequence[ToolCall],
    tools: Sequence[Mapping[str, Any]],
    *,
    strict: bool = False,
) -> list[ToolCallVerdict]:
    """Check ``calls`` against the request's ``tools``; one verdict per call.

    By default an invalid call is only reported (the response still carries it, as OpenAI
    would); ``strict=True`` turns any invalid call into an error.

    Raises:
        InvalidToolCallError: ``strict`` and at least one call is invalid.
    """
    return ToolValidator(tools).validate(calls, strict=strict)

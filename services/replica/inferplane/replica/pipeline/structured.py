"""vLLM's `structured_outputs` (and its pre-0.12 `guided_*` spellings) → the decoding constraint.

vLLM's `StructuredOutputsParams` (vllm/sampling_params.py) takes exactly one constraint of
`json` (a schema, as an object or JSON text), `json_object` (true), `regex`, `choice` (a list of
strings), `grammar` (EBNF / GBNF / Lark text) or `structural_tag` (its JSON text), plus the
options `disable_any_whitespace`, `disable_additional_properties` and `whitespace_pattern`,
which the platform's engines do not take (a 400 when set to anything but their default).
Older clients send `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM <
0.12); they mean the same constraint.

A JSON constraint is built as `response_format` builds it (`build_json_constraint`: with
thinking on, the JSON follows the reasoning). The other kinds constrain the whole output, which
would leave no room for the reasoning the prompt opened, so they need thinking off (a 400 says
so) and a format without an answer header (harmony's `final` channel).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from inferplane.parsers import CallSyntax, build_json_constraint, unenforced_keyword
from inferplane.replica.engines.base import EngineConstraint
from inferplane.runtime import InvalidArgumentError

#: The constraint keys of StructuredOutputsParams, in vLLM's order.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: Its option keys, with the default each must keep.
OPTION_DEFAULTS: Mapping[str, Any] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}
#: The pre-0.12 request fields and the key each stands for.
GUIDED_FIELDS: Mapping[str, str] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _bad(message: str, param: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, param=param, code="invalid_value")


def requested(body: Mapping[str, Any]) -> tuple[str, str, Any] | None:
    """`(param, kind, value)` of the constraint the body asks for through `structured_outputs`
    or a `guided_*` field, or None.

    Raises:
        InvalidArgumentError: none or several constraints in `structured_outputs`, an unknown
            key, an option set to a value the engines do not take, or two fields at once.
    """
    found: list[tuple[str, str, Any]] = []
    spec = body.get("structured_outputs")
    if spec is not None:
        if not isinstance(spec, Mapping):
            raise _bad("'structured_outputs' must be an object", "structured_outputs")
        for key, value in spec.items():
            param = f"structured_outputs.{key}"
            if key in OPTION_DEFAULTS:
                if value is not None and value != OPTION_DEFAULTS[key]:
                    raise InvalidArgumentError(
                        f"'{param}' is not supported: the engines use their default",
                        param=param,
                        code="unsupported_parameter",
                    )
            elif key not in CONSTRAINT_KEYS:
                raise _bad(f"unknown key '{key}' in 'structured_outputs'", param)
            elif value is not None and value is not False:
                found.append((param, key, value))
        if not found:
            raise _bad(
                "'structured_outputs' must hold one of " + ", ".join(CONSTRAINT_KEYS),
                "structured_outputs",
            )
        # The object's key order does not survive its proto Struct: vLLM's order decides.
        found.sort(key=lambda item: CONSTRAINT_KEYS.index(item[1]))
    for field, key in GUIDED_FIELDS.items():
        value = body.get(field)
        if value not in (None, "", []):
            found.append((field, key, value))
    if len(found) > 1:
        raise _bad(
            "only one structured-output constraint may be given; got "
            + ", ".join(p for p, _, _ in found),
            found[1][0],
        )
    return found[0] if found else None


def build(
    wanted: tuple[str, str, Any],
    *,
    thinking: bool,
    syntax: CallSyntax | None,
    markers: Sequence[str] = (),
) -> EngineConstraint:
    """The engine constraint for `requested`'s answer, in the model's output format (`syntax`:
    the replica parser's call syntax; None: Kimi's or no parser; `thinking`: the prompt opened
    reasoning; always False for text completions; `markers`: texts a JSON answer's strings may
    not hold, `ModelAssets.marker_texts`, as `build_json_constraint` takes them).

    Raises:
        InvalidArgumentError: a value of the wrong type (a schema that is neither an object
            nor JSON text, a choice that is not a list of strings), or a non-JSON kind with
            thinking on or under a format with an answer header.
    """
    param, kind, value = wanted
    if kind in ("json", "json_object"):
        schema: Mapping[str, Any] | None = None
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise _bad(f"'{param}' is not valid JSON: {exc}", param) from exc
            if not isinstance(value, Mapping):
                raise _bad(f"'{param}' must be a JSON schema object", param)
            schema = value
        elif value is not True:
            raise _bad(f"'{param}' must be true", param)
        if schema is not None and unenforced_keyword(schema) is not None:
            markers = ()  # as response_format without strict (requests._answer_markers)
        built = build_json_constraint(schema, syntax=syntax, thinking=thinking, markers=markers)
        return EngineConstraint(built.kind, built.value)
    if thinking or (syntax is not None and syntax.answer_begins):
        raise _bad(
            f"'{param}' constrains the whole output, which leaves no room for the model's "
            "reasoning: turn thinking off (reasoning_effort 'none') or use a JSON constraint",
            param,
        )
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise _bad(f"'{param}' must be a non-empty list of strings", param)
        return EngineConstraint("choice", json.dumps(value, ensure_ascii=False))
    if kind == "structural_tag" and isinstance(value, Mapping):
        value = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise _bad(f"'{param}' must be a non-empty string", param)
    return EngineConstraint(kind, value)

"""What differs between engine versions (engines/versions.py, issue 30): on an xgrammar without
`JSONSchemaFormat.excludes` (vLLM 0.31's 0.2.7) a JSON answer's strings keep the model's
markers out through patterns; on one with them (vLLM 0.32's 0.2.8) the constraint is as built."""

from __future__ import annotations

import json
import re

from inferplane.parsers import Constraint, build_json_constraint
from inferplane.replica.engines.versions import engine_constraint, grammar_has_excludes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "short": {"type": "string", "maxLength": 3},
        "code": {"type": "string", "pattern": "^[A-Z]+$"},
        "kind": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2}},
    },
    "required": ["name"],
}
MARKERS = ("<|im_end|>", "<|tool_calls_section_begin|>", "<think>", "</think>")


def answer_format(constraint: Constraint) -> dict[str, object]:
    tag = json.loads(constraint.value)
    fmt = tag["format"]
    while fmt.get("type") == "sequence":
        fmt = fmt["elements"][-1]
    return fmt  # type: ignore[no-any-return]


def test_without_excludes_free_strings_leave_out_the_marker_opener() -> None:
    built = build_json_constraint(SCHEMA, markers=MARKERS)
    assert "excludes" in answer_format(built)
    adapted = engine_constraint(built, excludes=False)
    assert adapted.kind == "structural_tag"
    fmt = answer_format(adapted)
    assert "excludes" not in fmt
    props = fmt["json_schema"]["properties"]  # type: ignore[index]
    assert props["name"] == {"type": "string", "pattern": "^[^<]{0,}$"}
    # Bounded strings were patterns already (build_json_constraint): too short for a marker.
    assert props["short"] == {"type": "string", "pattern": r"^[\s\S]{0,3}$"}
    assert props["code"] == SCHEMA["properties"]["code"]  # type: ignore[index]
    assert props["kind"] == SCHEMA["properties"]["kind"]  # type: ignore[index]
    assert props["tags"]["items"] == {"type": "string", "pattern": "^[^<]{2,}$"}
    assert re.fullmatch(props["name"]["pattern"], "a note") is not None
    assert re.fullmatch(props["name"]["pattern"], "x<|im_end|>") is None


def test_with_excludes_or_another_kind_the_constraint_is_unchanged() -> None:
    built = build_json_constraint(SCHEMA, markers=MARKERS)
    assert engine_constraint(built, excludes=True) is built
    plain = Constraint("json_schema", json.dumps(SCHEMA))
    assert engine_constraint(plain, excludes=False) is plain
    assert engine_constraint(None) is None
    # The installed engine's own answer: vLLM 0.32's xgrammar 0.2.8 has excludes.
    assert engine_constraint(built) is built if grammar_has_excludes() else True

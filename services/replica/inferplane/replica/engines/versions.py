"""What differs between the engine versions a replica runs on (issue 30: engines side by side),
in one place: the transports (`inproc.py`, `http_client.py`, `grpc_client.py`) ask here.

The replica process runs in its engine's environment (the default `.venv`, or an engine
environment of engines/), so what is installed beside it is what its engine runs.

- **Marker exclusion in JSON answers** (`engine_constraint`): a constrained JSON answer's
  strings exclude the model's marker texts through xgrammar's `JSONSchemaFormat.excludes`
  (`inferplane.parsers._answer`: why). xgrammar 0.2.7 (vLLM 0.31) has no `excludes` and
  ignores the key without a word, so the fixture model wrote markers inside strings and the
  parser cut the answer there (`finish_reason: "stop"`, invalid JSON: 7 of 24 strict
  json_schema answers, services/replica/tests/test_structured_answer_e2e.py). There every free
  string of such a schema (no `pattern`, `format`, `enum` or `const`) becomes a `pattern`
  that leaves out the opener of the excluded texts (`<`: every marker text `answer_excludes`
  covers begins with it), with its length bounds kept, and `excludes` is dropped. What stays
  open there: strings the schema does not declare (keys and values of free-form objects,
  `json_object`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from importlib import metadata
from typing import Any

from inferplane.parsers import Constraint
from inferplane.parsers._answer import bounded_strings_as_patterns  # the one rewrite of strings

#: The first xgrammar release with `JSONSchemaFormat.excludes` (vLLM 0.32 pins it).
XGRAMMAR_EXCLUDES_SINCE = (0, 2, 8)

# Schema keys whose values are data, not schemas (never rewritten).
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


@functools.cache
def grammar_has_excludes() -> bool:
    """Whether this environment's xgrammar honours `excludes` (True without xgrammar: no
    engine grammar here to adapt for)."""
    try:
        installed = metadata.version("xgrammar")
    except metadata.PackageNotFoundError:
        return True
    parts = tuple(int(p) for p in installed.split(".")[:3] if p.isdigit())
    return parts >= XGRAMMAR_EXCLUDES_SINCE


def engine_constraint(constraint: Constraint | None, *, excludes: bool | None = None) -> Any:
    """`constraint` as this environment's engine takes it: unchanged, except a structural tag
    whose JSON answers carry `excludes` on an xgrammar without them (`excludes` None: probe
    `grammar_has_excludes`), rewritten as the module doc says.

    Returns:
        The same `Constraint` or a rewritten one (same kind), or None for None.
    """
    if constraint is None or constraint.kind != "structural_tag":
        return constraint
    if grammar_has_excludes() if excludes is None else excludes:
        return constraint
    tag = json.loads(constraint.value)
    if not _drop_excludes(tag):
        return constraint
    return Constraint("structural_tag", json.dumps(tag, ensure_ascii=False))


def _drop_excludes(node: Any) -> bool:
    """Rewrites, in place, every `json_schema` format of a structural tag that has `excludes`;
    True when one was found."""
    found = False
    if isinstance(node, list):
        for item in node:
            found = _drop_excludes(item) or found
    elif isinstance(node, dict):
        if node.get("type") == "json_schema" and "excludes" in node:
            openers = _openers(node.pop("excludes"))
            schema = _bound_free_strings(node.get("json_schema", {}))
            node["json_schema"] = bounded_strings_as_patterns(schema, openers)
            return True
        for value in node.values():
            found = _drop_excludes(value) or found
    return found


def _openers(excludes: Iterable[str]) -> list[str]:
    """One character per excluded text that every marker text it stands for begins with: `<`
    for `answer_excludes`'s `<|` and `name>` (from `<name>` / `</name>`), else its first."""
    return sorted({"<" if e.startswith("<") or e.endswith(">") else e[0] for e in excludes if e})


def _bound_free_strings(schema: Any) -> Any:
    """`schema` with `minLength: 0` on every free string without bounds, so that
    `bounded_strings_as_patterns` rewrites it too (nested schemas included; data keys left)."""
    if isinstance(schema, list):
        return [_bound_free_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else _bound_free_strings(v) for k, v in schema.items()}
    free = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and free and "minLength" not in out and "maxLength" not in out:
        out["minLength"] = 0
    return out

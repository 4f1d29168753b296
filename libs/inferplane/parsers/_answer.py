"""What a constrained JSON answer (``response_format`` json_schema / json_object) may not hold:
the text of the model's markers and special tokens.

Why (measured on the fixture model kimi-tiny, issue 27): under a plain ``json_schema``
constraint the grammar lets a JSON string hold ANY token whose text is legal string content.
xgrammar's vocabulary treats every token of the tokenizer as its text (vLLM builds it with
``xgrammar.TokenizerInfo.from_huggingface``; only ids without a token are "special" to it), so
``<|tool_calls_section_begin|>``, ``</think>`` or ``<|im_assistant|>`` are, to the grammar, just
characters a string may contain. The model wrote them inside values; the parser read the
section marker as the start of a tool section and cut the content there (``finish_reason:
"stop"`` with a JSON value cut mid-string: 10 of 18 strict json_schema requests), dropped a
stray ``</think>``, and left unknown special tokens (``<|im_assistant|>``) in the content.
The engine's stop tokens are not the cause: vLLM 0.32 masks every stop and eos id until the
grammar can end (``StructuredOutputManager._create_grammar`` passes
``sampling_params.all_stop_token_ids`` to ``GrammarMatcher(override_stop_tokens=...)``).

The fix is the grammar's: the JSON value's strings exclude those texts (xgrammar's
``json_schema`` ``excludes``), so the model cannot write a marker token, or spell one, inside
the answer. Two costs of ``excludes`` shape what is excluded:

- Compile time grows with the excluded text (xgrammar builds an automaton over the excluded
  strings for every string rule): on a Kimi-sized 163k-token vocabulary, excluding the
  fixture's 13 marker texts one by one made a new schema's compile p90 seconds, while one
  ``<|`` costs about nothing (bench/README.md, structured_output_validity). So
  ``answer_excludes`` covers every ``<|…|>`` text by its opener ``<|`` (Kimi's, Qwen's and
  harmony's special tokens and Kimi's tool markers all have that form) and ``<name>`` /
  ``</name>`` pairs by their shared ``name>``.
- xgrammar drops ``minLength`` / ``maxLength`` from a string it filters (it warns:
  "not applied together with JSONSchemaFormat.excludes"), so the answer could break the
  schema. ``bounded_strings_as_patterns`` rewrites such a string into a ``pattern`` that keeps
  its bounds (a string with a pattern is not filtered), and leaves out of it the first
  character of every marker text when a marker would fit (``<`` for Kimi and Qwen): a bounded
  string then cannot hold ``<``.

Strings with the client's own ``pattern`` or ``format`` are matched by it alone (xgrammar does
not filter them): a pattern that allows ``<|`` lets the model write a marker there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["answer_excludes", "bounded_strings_as_patterns", "unenforced_keyword"]

# (opener, closer) of special-token texts whose opener alone stands for all of them.
_BRACKETS = (("<|", "|>"), ("<\uff5c", "\uff5c>"))  # ASCII, and DeepSeek's full-width bar

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _cover(text: str) -> str:
    """The short substring of `text` that stands for it in the excludes."""
    for opener, closer in _BRACKETS:
        if text.startswith(opener) and text.endswith(closer) and len(text) > len(opener):
            return opener
    if text.startswith("</") and text.endswith(">") and len(text) > 3:
        return text[2:]  # "</think>" -> "think>", which "<think>" holds too
    if text.startswith("<") and text.endswith(">") and len(text) > 2 and text[1] != "/":
        return text[1:]
    return text


def answer_excludes(texts: Iterable[str]) -> tuple[str, ...]:
    """The substrings a constrained JSON answer's strings must not hold so that no text of
    `texts` (the tokenizer's added tokens: markers and special tokens) can appear in it.

    Each ``<|…|>`` text is covered by ``<|``, ``<name>`` and ``</name>`` by ``name>``, any
    other text by itself; whitespace-only texts are skipped (they are not markers), and an
    exclude that holds another is dropped. Sorted, so equal inputs give equal grammars (vLLM
    caches compiled grammars by their text).

    Example: Kimi's markers -> ``("<|", "think>")``.
    """
    covers = {_cover(t) for t in texts if t and not t.isspace()}
    return tuple(sorted(c for c in covers if not any(o != c and o in c for o in covers)))


def bounded_strings_as_patterns(schema: Any, texts: Iterable[str]) -> Any:
    """`schema` with every length-bounded string (``minLength`` / ``maxLength``, no
    ``pattern``, ``format``, ``enum`` or ``const``) rewritten as a ``pattern`` with the same
    bounds, nested schemas included, so that xgrammar keeps the bounds under ``excludes``.

    A string long enough to hold the shortest of `texts` leaves out the first character of
    every text (``^[^<]{0,40}$``); a shorter one allows any character. Bounds count
    characters, as JSON Schema's do.
    """
    words = [t for t in texts if t and not t.isspace()]
    shortest = min((len(t) for t in words), default=0)
    firsts = "".join(sorted({t[0] for t in words}))
    return _rewrite(schema, shortest, firsts)


def _rewrite(schema: Any, shortest: int, firsts: str) -> Any:
    if isinstance(schema, list):
        return [_rewrite(s, shortest, firsts) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: _rewrite(v, shortest, firsts) for k, v in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_VALUES):
        if key in out:
            out[key] = _rewrite(out[key], shortest, firsts)
    bounded = "minLength" in out or "maxLength" in out
    free = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and bounded and free:
        low = int(out.pop("minLength", 0) or 0)
        high = out.pop("maxLength", None)
        fits = firsts and (high is None or int(high) >= shortest)
        chars = "[^" + _class_escape(firsts) + "]" if fits else r"[\s\S]"
        upper = "" if high is None else str(int(high))
        out["pattern"] = f"^{chars}{{{low},{upper}}}$"
    return out


def _class_escape(chars: str) -> str:
    """`chars` safe inside a regex character class."""
    return "".join("\\" + c if c in "\\]^-[" else c for c in chars)


# String formats xgrammar 0.2.8 enforces (vLLM 0.32's STRING_SUPPORTED_FORMATS).
_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """Where `schema` uses a keyword xgrammar 0.2.8 compiles but does not enforce (it warns
    and ignores it), as ``"path: keyword"``, or None.

    An answer grammar (a structural tag) is always xgrammar's, so such a schema could be
    answered with JSON that does not validate. The list is the one vLLM 0.32 keeps to send
    plain ``json_schema`` requests to another backend instead
    (``vllm/v1/structured_output/backend_xgrammar.py``,
    ``has_xgrammar_unsupported_json_features``): ``multipleOf`` on numbers; ``uniqueItems``,
    ``contains``, ``minContains``, ``maxContains`` on arrays; a string ``format`` xgrammar does
    not know; ``pattern`` or ``format`` with a length bound; ``propertyNames`` with
    ``properties``, ``patternProperties`` or ``unevaluatedProperties``; ``patternProperties``
    with ``properties`` or with more than one pattern; ``allOf`` with several branches.
    """
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unenforced_keyword(item, f"{path}[{i}]")
            if found:
                return found
        return None
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    here = path or "schema"
    bounded = "minLength" in schema or "maxLength" in schema
    checks = (
        (bool(types & {"integer", "number"}) and "multipleOf" in schema, "multipleOf"),
        (
            "array" in types
            and any(k in schema for k in ("uniqueItems", "contains", "minContains", "maxContains")),
            "uniqueItems / contains",
        ),
        (
            "string" in types and "format" in schema and schema["format"] not in _FORMATS,
            f"format {schema.get('format')!r}",
        ),
        (
            "string" in types and ("pattern" in schema or "format" in schema) and bounded,
            "pattern or format with minLength / maxLength",
        ),
        (
            "propertyNames" in schema
            and (
                any(k in schema for k in ("properties", "patternProperties"))
                or schema.get("unevaluatedProperties", True) is not True
            ),
            "propertyNames",
        ),
        (
            isinstance(schema.get("patternProperties"), Mapping)
            and ("properties" in schema or len(schema["patternProperties"]) > 1),
            "patternProperties",
        ),
        (isinstance(schema.get("allOf"), list) and len(schema["allOf"]) >= 2, "allOf"),
    )
    for hit, keyword in checks:
        if hit:
            return f"{here}: {keyword}"
    for key, value in schema.items():
        if isinstance(value, Mapping | list):
            found = unenforced_keyword(value, f"{path}.{key}" if path else key)
            if found:
                return found
    return None
